# The README's two commands: `make demo` and `make test` (and `make docs`). Each sets up what it needs first.
.PHONY: setup demo test bench docs clean

VENV := .venv
PY := $(VENV)/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/triton-vlm demo --workdir build/demo --size small

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

SMALL := build/demo/qwen2_5_vl-small
bench: setup
	test -f $(SMALL)/config.json || $(VENV)/bin/triton-vlm demo-checkpoint --family qwen2_5_vl --size small --out $(SMALL)
	$(VENV)/bin/triton-vlm build --checkpoint $(SMALL) --repo build/bench/repository
	HF_HUB_OFFLINE=1 $(VENV)/bin/triton-vlm bench --repo build/bench/repository --concurrency 1:8:3

# The documentation site (mkdocs.yml) at http://127.0.0.1:8088; bench/plots.py redraws its figures first.
docs: setup
	$(PY) bench/plots.py
	$(VENV)/bin/mkdocs serve

clean:
	rm -rf build .pytest_cache
