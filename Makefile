# Both targets create or reuse .venv. A torch already present there (say a GPU user's CUDA build) is kept.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# `make test` runs the suite in this many processes (pytest-xdist), each test file whole in one of them (the
# files' tests share compiled models and fixtures); TEST_WORKERS=0 runs it in this process alone.
TEST_WORKERS ?= 2

.PHONY: demo test test-oldest test-nightly docs docs-serve bench gpu-check gpu-perf gpu-lease megatron-parity megatron-record clean

# setup.py builds the optional compiled helpers (cgcompile/csrc) in place; a change to them reinstalls.
# torchtitan (tests/test_torchtitan_ep.py) goes into $(VENV)/torchtitan, not site-packages: --no-deps with the
# pinned packages its MoE and parallel code imports (tests/torchtitan-requirements.txt), so nothing in the venv is
# upgraded or downgraded and no other test sees them. Skipped on Python < 3.11 (torchtitan 0.3.0 needs 3.11).
$(VENV)/.installed: pyproject.toml setup.py constraints.txt $(wildcard cgcompile/csrc/*.cpp cgcompile/csrc/*.h) \
                    tests/torchtitan-requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	if $(PY) -c "import torch" 2>/dev/null; then \
	    $(PY) -m pip install -q -e ".[test,docs]"; \
	else \
	    $(PY) -m pip install -q -c constraints.txt -e ".[test,docs]"; \
	fi
	rm -rf $(VENV)/torchtitan
	if $(PY) -c "import sys; sys.exit(sys.version_info < (3, 11))"; then \
	    $(PY) -m pip install -q --no-deps --target $(VENV)/torchtitan -r tests/torchtitan-requirements.txt; \
	fi
	touch $@

demo: $(VENV)/.installed
	$(PY) -m cgcompile.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The suite on the oldest torch supported (torch>=2.11 in pyproject.toml), not in CI: PyPI's build of it (its CUDA
# libraries included, about 3 GB; the tests run on the CPU), in a copy of the tracked files under build/ (an
# editable install builds cgcompile/*.so in place, for that torch), so .venv and its build stay as they are.
OLDEST_TORCH ?= 2.11.0
OLDEST_DIR := $(CURDIR)/build/torch-$(OLDEST_TORCH)
test-oldest:
	rm -rf $(OLDEST_DIR)/src && mkdir -p $(OLDEST_DIR)/src
	git ls-files -z | xargs -0 cp --parents -t $(OLDEST_DIR)/src
	test -x $(OLDEST_DIR)/venv/bin/python || python3 -m venv $(OLDEST_DIR)/venv
	$(OLDEST_DIR)/venv/bin/python -m pip install -q "torch==$(OLDEST_TORCH)" "setuptools>=70.1"
	$(MAKE) -C $(OLDEST_DIR)/src test VENV=$(OLDEST_DIR)/venv PYTEST_ARGS="$(PYTEST_ARGS)"

# The randomized parity test with fresh randomness and many more examples (CI runs a fixed set of 120,
# CGCOMPILE_FUZZ_EXAMPLES).
test-nightly: $(VENV)/.installed
	CGCOMPILE_FUZZ_NIGHTLY=1 $(PY) -m pytest -q tests/test_random_models.py $(PYTEST_ARGS)

# The docs site (mkdocs.yml, docs/): strict, so a warning or a link that does not resolve fails the build.
# tests/test_docs.py runs the same build, so `make test` (CI) covers it. NO_MKDOCS_2_WARNING: Material's banner.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

docs-serve: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_cpu.py

# On a CUDA machine: installs into that machine's Python and torch (not .venv), runs the GPU tests and benchmarks
# under time limits, writes one markdown report. Without CUDA it prints what it would run and fails.
# WHEELS=dir installs offline from a folder of wheels (pip --no-index --find-links dir).
GPU_PYTHON ?= python3
REPORT ?= gpu-check.md
WHEELS ?=
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --report "$(REPORT)" $(if $(WHEELS),--wheels "$(WHEELS)")

# On a fresh CUDA machine without network: the GPU performance table of every workload (HF Llama training,
# Qwen3-MoE training and sync dispatch with dynamic_padding, 8B-shaped decode, the small launch-bound ones) in one
# 9-minute call (510 s budget, stage by stage, rows appended to $(OUT)/gpu-perf.md as they finish; OUT defaults
# to gpu-perf-out). It installs with pip install --no-deps --no-build-isolation -e . itself. Without CUDA it
# prints its stage plan and exits 0. Stage output goes to $(OUT)/gpu-perf.log; --cpu-plumbing checks the script on a CPU.
gpu-perf:
	$(if $(OUT),OUT="$(OUT)") $(GPU_PYTHON) benchmarks/gpu_perf.py

# A 15-minute lease holds a machine's start and one call of at most 10 minutes: gpu-perf and gpu-check do not both
# fit. This runs, in one call of about 9.5 minutes, gpu-perf's decode and training stages (the issue-36 rows and
# their kernel diffs), then gpu-check's GPU and NCCL tests, then gpu-perf's padded-MoE stage; each budget a limit,
# each step run even when the one before failed. Reports: $(OUT)/gpu-perf.md, $(OUT)/gpu-check.md (and its logs).
# Offline test packages (expecttest): WHEELS=dir of wheels.
gpu-lease:
	-$(if $(OUT),OUT="$(OUT)") $(GPU_PYTHON) benchmarks/gpu_perf.py --budget 320 \
	    --stages install,decode-b1,llama-train,moe-train
	-$(GPU_PYTHON) benchmarks/gpu_check.py --report "$(or $(OUT),gpu-perf-out)/gpu-check.md" \
	    --stages install,gpu-tests,gpu-nccl --budget 150 $(if $(WHEELS),--wheels "$(WHEELS)")
	-$(if $(OUT),OUT="$(OUT)") $(GPU_PYTHON) benchmarks/gpu_perf.py --budget 80 --stages moe-sync --skip-install

# Megatron-Core parity, live: the parity cases through megatron.core itself, and a tiny GPTModel tagged with
# tag_megatron trained against eager (it needs Python >= 3.12 and torch; PyPI's torch, a large download, is
# installed into that venv on first use). MCORE_VENV=... reuses a venv.
MCORE_PYTHON ?= python3.12
MCORE_VENV ?= .venv-mcore
MCORE_PY := $(MCORE_VENV)/bin/python

$(MCORE_VENV)/.installed:
	test -x $(MCORE_PY) || $(MCORE_PYTHON) -m venv $(MCORE_VENV)
	$(MCORE_PY) -m pip install -q "megatron-core==0.19.2" pytest
	touch $@

megatron-parity: $(MCORE_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(MCORE_PY) -m pytest -q -p no:cacheprovider tests/test_megatron_parity.py tests/test_megatron_train.py

# Re-record tests/data/megatron_core_<version>.json from the installed megatron-core.
megatron-record: $(MCORE_VENV)/.installed
	PYTHONPATH=$(CURDIR) $(MCORE_PY) tests/megatron_oracle.py --write

clean:
	rm -rf $(VENV) $(MCORE_VENV) build site *.egg-info
