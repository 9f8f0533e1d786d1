# The README's two commands: `make demo` and `make test`. Each sets up what it needs first.
.PHONY: setup demo test clean

VENV := .venv
PY := $(VENV)/bin/python

setup:
	@bash scripts/setup.sh

demo: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/triton-vlm demo --workdir build/demo --size small

test: setup
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf build .pytest_cache
