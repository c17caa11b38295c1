# Both targets create or reuse .venv. A torch already present there (say a GPU user's CUDA build) is kept.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test test-nightly bench gpu-check clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	if $(PY) -c "import torch" 2>/dev/null; then \
	    $(PY) -m pip install -q -e ".[test]"; \
	else \
	    $(PY) -m pip install -q -c constraints.txt -e ".[test]"; \
	fi
	touch $@

demo: $(VENV)/.installed
	$(PY) -m cgcompile.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The randomized parity test with fresh randomness and many more examples (CI runs a fixed set of 200).
test-nightly: $(VENV)/.installed
	CGCOMPILE_FUZZ_NIGHTLY=1 $(PY) -m pytest -q tests/test_random_models.py $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_cpu.py

# On a CUDA machine: installs into that machine's Python and torch (not .venv), runs the GPU tests and benchmarks
# under time limits, writes one markdown report. Without CUDA it prints what it would run and fails.
GPU_PYTHON ?= python3
REPORT ?= gpu-check.md
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --report "$(REPORT)"

clean:
	rm -rf $(VENV) build *.egg-info
