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

test: $(VENV)/.installed-ray
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
