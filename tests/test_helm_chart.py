"""The Helm chart (deploy/helm/triton-vlm), rendered by Helm's own Go SDK (helm-python-sdk, pinned
in pyproject.toml) as `helm template` would: every object valid for Kubernetes 1.37
(kubernetes-validate, strict), the custom resources against tests/k8s/*.schema.json, the commands
the pods run parsed by triton-vlm's own parser, and the autoscaling query evaluated on a real
server's metrics, under load and at rest. No cluster runs here (no container runtime)."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import tritonclient.grpc as grpcclient
import yaml

from tests.servers import served
from triton_vlm.clients.client import close_stream, grpc_inputs, request_values

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "triton-vlm"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor",
        ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject"}
K8S_VERSION = "1.37.0"
RELEASE, NAMESPACE = "demo", "ml"
VALUES = {
    "default": {},
    "cpu": {"gpus": 0, "build": {"device": "cpu", "llmMaxRunning": 8, "extraArgs": ["--kv-cache-mb", "512"]},
            "serve": {"extraArgs": []}},
    "hpa": {"gpus": 2, "autoscaling": {"enabled": True}, "metrics": {"serviceMonitor": {"enabled": True}},
            "adminKey": {"existingSecret": "triton-vlm-admin"}, "resources": {"limits": {"memory": "64Gi"}}},
    "keda": {"autoscaling": {"enabled": True, "kind": "keda", "waitingPerPod": 3}},
}


def render(values: dict) -> list[dict]:
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def merged(values: dict) -> dict:
    """The values an install with `values` uses (the chart's defaults under them)."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


@pytest.mark.parametrize("case", list(VALUES))
def test_every_object_is_valid_kubernetes(case):
    objects = render(VALUES[case])
    kinds = sorted(o["kind"] for o in objects)
    expected = {"default": ["Deployment", "Job", "Service"], "cpu": ["Deployment", "Job", "Service"],
                "hpa": ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Job", "Service", "ServiceMonitor"],
                "keda": ["Deployment", "Job", "ScaledObject", "Service"]}[case]
    assert kinds == expected
    for obj in objects:
        crd = CRDS.get((obj["apiVersion"], obj["kind"]))
        if crd:
            jsonschema.validate(obj, json.loads((ROOT / "tests" / "k8s" / f"{crd}.schema.json").read_text()))
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_misspelt_or_wrong_value_is_refused_by_the_schema():
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        for bad in ({"gpu": 1}, {"gpus": -1}, {"shm": {"perInstanceMiB": 16}}, {"terminationGracePeriodSeconds": 5},
                    {"autoscaling": {"kind": "vpa"}}, {"build": {"device": "tpu"}}):
            with pytest.raises(helm.HelmValuesError):
                chart.validate_schema(bad)


def _container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("case", ["default", "cpu", "hpa"])
def test_the_pods_run_what_triton_vlm_accepts(case):
    """The serving pod's `triton-vlm serve` and the build hook's `triton-vlm build`, parsed by the
    CLI's own parser; the build writes where the pods read, on the same claim."""
    from triton_vlm.tools.cli import build_options, parser

    objects = by_kind(render(VALUES[case]))
    serve, build = _container(objects["Deployment"]), _container(objects["Job"])
    assert serve["command"] == build["command"] == ["triton-vlm"]
    serve_args = parser().parse_args(serve["args"])
    build_args = parser().parse_args(build["args"])
    assert (serve_args.command, build_args.command) == ("serve", "build")
    assert serve_args.repo == build_args.repo == "/models/repository"
    assert (serve_args.http_port, serve_args.grpc_port, serve_args.metrics_port) == (8000, 8001, 8002)
    options = build_options(build_args)
    assert options.device == ("cpu" if case == "cpu" else "gpu")
    assert options.llm_max_running == (8 if case == "cpu" else 64)
    assert options.kv_cache_bytes == (512 << 20 if case == "cpu" else 0)
    # more admitted than run at once: a load beyond the batch waits in the llm, where autoscaling reads it
    assert options.max_inflight_requests == 256 > options.llm_max_running
    assert objects["Job"]["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    claims = {v["persistentVolumeClaim"]["claimName"] for o in (objects["Deployment"], objects["Job"])
              for v in o["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"triton-vlm-models"}
    mounts = {m["mountPath"]: m.get("readOnly", False) for m in serve["volumeMounts"]}
    assert mounts["/models"] is True  # the replicas only read the repository


def test_pod_settings_follow_serve_and_the_python_backend():
    from triton_vlm.server.tritonserver import EXIT_TIMEOUT_S

    for case, gpus in (("default", 1), ("cpu", 0), ("hpa", 2)):
        pod = by_kind(render(VALUES[case]))["Deployment"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["terminationGracePeriodSeconds"] > EXIT_TIMEOUT_S
        assert pod["securityContext"]["runAsNonRoot"] and container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0) == gpus
        # /dev/shm: 128 MiB a Python-backend instance (2 preprocess, 4 fronts, an encoder and an
        # llm per GPU, the ensemble)
        shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]
        assert shm == {"medium": "Memory", "sizeLimit": f"{128 * (2 + 4 + 2 * max(gpus, 1) + 1)}Mi"}
        probes = {name: container[name]["httpGet"]["path"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert probes == {"startupProbe": "/v2/health/ready", "readinessProbe": "/v2/health/ready",
                          "livenessProbe": "/v2/health/live"}
        keys = [e for e in container["env"] if e["name"] == "TRITON_VLM_ADMIN_KEY"]
        assert keys == ([{"name": "TRITON_VLM_ADMIN_KEY", "valueFrom": {"secretKeyRef": {
            "name": "triton-vlm-admin", "key": "admin-key"}}}] if case == "hpa" else [])


# ---- the autoscaling query on a real server's metrics -----------------------------------------

_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')
_MATCHER = re.compile(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"')
_QUERY = re.compile(r'^sum\((\w+)\{(.*)\}\)(?: by \((\w*)\))?$')


def evaluate(query: str, exposition: str, target_labels: dict[str, str]) -> dict[str, float]:
    """A PromQL `sum(metric{matchers}) [by (label)]` over one scrape of `exposition`, its samples
    carrying the target labels Prometheus adds (namespace, pod)."""
    name, matchers, group = _QUERY.match(query).groups()
    rules = _MATCHER.findall(matchers)
    sums: dict[str, float] = {}
    for line in exposition.splitlines():
        sample = _SAMPLE.match(line)
        if not sample or sample.group(1) != name:
            continue
        labels = {**dict(re.findall(r'(\w+)="([^"]*)"', sample.group(2))), **target_labels}
        if all({"=": labels.get(k, "") == v, "!=": labels.get(k, "") != v,
                "=~": re.fullmatch(v, labels.get(k, "")) is not None}[op] for k, op, v in rules):
            key = labels.get(group, "") if group else ""
            sums[key] = sums.get(key, 0.0) + float(sample.group(3))
    return sums


def queries(pod: str) -> dict[str, str]:
    """The HPA's (the adapter rule as prometheus-adapter fills it in for this pod) and KEDA's."""
    hpa = by_kind(render(VALUES["hpa"]))
    rule = yaml.safe_load(hpa["ConfigMap"]["data"]["rules.yaml"])["rules"][0]
    series = re.match(r"\w+", rule["seriesQuery"]).group(0)
    adapter = (rule["metricsQuery"].replace("<<.Series>>", series)
               .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{pod}"').replace("<<.GroupBy>>", "pod"))
    keda = by_kind(render(VALUES["keda"]))["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"]
    return {"hpa": adapter, "keda": keda}


@pytest.fixture(scope="module")
def one_running_server(tiny_checkpoint, tmp_path_factory):
    """The llm runs one request at a time: the others wait, as under a load past `max_running`."""
    from triton_vlm.repository.options import BuildOptions

    options = BuildOptions(llm_max_running=1, preprocess_instances=1, encoder_frontends=1)
    with served(tiny_checkpoint, tmp_path_factory, "helm", options) as running:
        yield running


def test_the_autoscaling_metric_rises_above_its_target_under_load_and_falls_at_rest(one_running_server):
    server = one_running_server
    pod = f"{RELEASE}-triton-vlm-6d4f9c7b8-x2x7q"
    target_labels = {"namespace": NAMESPACE, "pod": pod, "job": "triton-vlm"}
    hpa_target, keda_target = (merged(VALUES[case])["autoscaling"]["waitingPerPod"] for case in ("hpa", "keda"))
    scrape = lambda: urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()  # noqa: E731
    expressions = queries(pod)

    def values() -> dict[str, float]:
        text = scrape()
        return {kind: sum(evaluate(q, text, target_labels).values()) for kind, q in expressions.items()}

    at_rest = values()
    assert at_rest == {"hpa": 0.0, "keda": 0.0}
    # Five streams long enough that the four behind the running one wait until they are cancelled.
    inputs = grpc_inputs(request_values("count from one to a thousand", max_tokens=3000, min_tokens=3000))
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(5)]
    try:
        for client in clients:
            client.start_stream(callback=lambda result, error: None)
            client.async_stream_infer("ensemble", inputs)
        deadline, peak = time.monotonic() + 60, {"hpa": 0.0, "keda": 0.0}
        while time.monotonic() < deadline and not (peak["hpa"] > hpa_target and peak["keda"] > keda_target):
            peak = values()
            time.sleep(0.05)
        assert peak["hpa"] > hpa_target and peak["keda"] > keda_target, peak  # 4 waiting behind the one running
    finally:
        for client in clients:
            close_stream(client, cancel=True)
            client.close()
    deadline = time.monotonic() + 30
    while (now := values()) != {"hpa": 0.0, "keda": 0.0} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now == {"hpa": 0.0, "keda": 0.0}
