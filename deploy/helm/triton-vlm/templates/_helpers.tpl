{{- define "triton-vlm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "triton-vlm.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "triton-vlm.labels" -}}
{{ include "triton-vlm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "triton-vlm.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{/* Python backend model instances of one pod: preprocess, the vision_encoder fronts, the batched
encoder per GPU, one llm per GPU, the ensemble. */}}
{{- define "triton-vlm.instances" -}}
{{- $gpus := max 1 (int .Values.gpus) -}}
{{- add (int .Values.build.preprocessInstances) (int .Values.build.encoderFrontends) (mul (int .Values.build.encoderInstances) $gpus) $gpus 1 -}}
{{- end -}}

{{- define "triton-vlm.repository" -}}
{{ printf "/models/%s" .Values.storage.repository }}
{{- end -}}
