#!/usr/bin/env bash
# Installs NVIDIA's genai-perf 0.0.16 into its own virtual environment (its dependencies, pandas
# and transformers among them, stay out of the project's) and a `perf_analyzer` wrapper that runs
# the project's perf_analyzer runtime (scripts/perf_analyzer_runtime.sh) through its loader.
# genai-perf's own `perf-analyzer` dependency is left out: its wheel needs glibc 2.38.
set -euo pipefail
DEST=${1:-.genai-perf}
PA_RUNTIME=${2:-.pa-runtime}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x "$DEST/bin/genai-perf" ]; then
  rm -rf "$DEST"
  "$PYTHON" -m venv "$DEST"
  "$DEST/bin/pip" install -q --upgrade pip
  "$DEST/bin/pip" install -q fastparquet==2026.9.0 Jinja2==3.1.6 kaleido==1.5.0 numpy==2.4.6 optuna==3.6.1 \
    orjson==3.13.0 pandas==3.1.1 pillow==13.0.0 plotly==7.1.0 pyarrow==26.0.1 pytest==9.2.0 pytest-mock==3.17.0 \
    PyYAML==6.0.4 responses==0.26.3 rich==15.0.0 soundfile==0.14.0 statsmodels==0.15.0 transformers==5.24.0
  "$DEST/bin/pip" install -q --no-deps genai-perf==0.0.16
fi
PA_RUNTIME=$(cd "$PA_RUNTIME" && pwd)
mkdir -p "$DEST/perf_analyzer"
cat > "$DEST/perf_analyzer/perf_analyzer" <<WRAP
#!/bin/sh
exec "$PA_RUNTIME/lib/ld-linux-x86-64.so.2" --library-path "$PA_RUNTIME/lib" "$PA_RUNTIME/bin/perf_analyzer" "\$@"
WRAP
chmod +x "$DEST/perf_analyzer/perf_analyzer"
"$DEST/bin/genai-perf" --version
