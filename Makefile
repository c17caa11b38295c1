# Both targets create or reuse .venv. A torch already present there (say a GPU user's CUDA build) is kept.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test bench clean megatron-parity megatron-record

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

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_cpu.py

# Megatron-Core parity, live: the parity cases through megatron.core itself (it needs Python >= 3.12 and torch;
# PyPI's torch, a large download, is installed into that venv on first use). MCORE_VENV=... reuses a venv.
MCORE_PYTHON ?= python3.12
MCORE_VENV ?= .venv-mcore
MCORE_PY := $(MCORE_VENV)/bin/python

$(MCORE_VENV)/.installed:
	test -x $(MCORE_PY) || $(MCORE_PYTHON) -m venv $(MCORE_VENV)
	$(MCORE_PY) -m pip install -q "megatron-core==0.19.2" pytest
	touch $@

megatron-parity: $(MCORE_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(MCORE_PY) -m pytest -q -p no:cacheprovider tests/test_megatron_parity.py

# Re-record tests/data/megatron_core_<version>.json from the installed megatron-core.
megatron-record: $(MCORE_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(MCORE_PY) tests/megatron_oracle.py --write

clean:
	rm -rf $(VENV) $(MCORE_VENV) build *.egg-info
