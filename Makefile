# Two commands set everything up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch is installed only when no torch is importable; a machine that already has
# torch (CUDA or CPU) keeps it, because the venv sees the system site-packages.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

# The optional Ray Data group (generate --ray) is only for the test suite and for users who scale out:
# `make run` does not need it.
$(VENV)/.installed-ray: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test,ray]"
	touch $@

install: $(VENV)/.installed

# A batch file shipped in the package (16 prompts of 64 token ids) on dummy opt-350m (random
# weights: a throughput run, not text), half of its weights streamed from disk (O_DIRECT) by the
# policy in examples/make_run_policy.json; results in out/make_run.jsonl (rerun = fresh run).
run: install
	$(VENV)/bin/flexsarathi generate --model dummy:opt-350m --input pkg:dummy_opt.jsonl \
	    --output out/make_run.jsonl --overwrite --policy examples/make_run_policy.json \
	    --max-tokens 32 --offload-dir out/offload

# One pytest worker per core (pytest-xdist), each with one OpenMP/torch thread, a test file per
# worker (a module's Ray instance and fixtures stay in one process): the suite's models are tiny, so
# a test's ops gain nothing from a second thread, while two single-threaded workers keep both cores
# busy. On this project's 2-core CI class: 6m54s, against 12m47s serially with 2 threads each and
# 12m54s with 2 workers of 2 threads (oversubscribed). The kernels' multi-threaded splits keep
# their own tests (they set the thread count themselves).
test: $(VENV)/.installed-ray
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto --dist loadfile

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
