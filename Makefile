# Two commands a fresh machine needs: `make demo` and `make test`. Both set up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.setup-stamp
COMPAT := .venv-compat
COMPAT_STAMP := $(COMPAT)/.setup-stamp
# torch is pinned here, not in pyproject: this pin takes the CPU wheel on a CPU machine and the
# CUDA build on a GPU box; an unpinned torch would pull several GB of CUDA onto a CPU machine.
TORCH  := torch==2.13.0

.PHONY: setup demo test test-gpu test-compat lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[test]"
	# openai-whisper without its declared triton (a large CUDA wheel a CPU does not use):
	# pip cannot drop one dependency of an extra, so the test extra carries its other
	# dependencies (openai-deps) and the package itself comes in here with --no-deps.
	$(PY) -m pip install -q --no-deps "openai-whisper>=20250625"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/whisper-train demo

test: setup
	$(PY) -m pytest

# The CUDA tests (tests/test_gpu.py), on a machine with a GPU; docs/gpu-session.md for a lent one.
test-gpu: setup
	$(PY) -m pytest -m gpu

# The checkpointing suite again on transformers 4.56.2, the release users report the
# "backward through the graph a second time" error on.
$(COMPAT_STAMP): pyproject.toml
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q --upgrade pip
	$(COMPAT)/bin/python -m pip install -q $(TORCH)
	$(COMPAT)/bin/python -m pip install -q -e ".[test]" "transformers==4.56.2" "peft<0.18"
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT)/bin/python -m pytest -m compat

lint: setup
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

clean:
	rm -rf $(VENV) $(COMPAT) whisper-train-demo
