#!/usr/bin/env bash
# The CUDA tests and the GPU benchmarks, on a machine with an NVIDIA GPU and the project set up
# (`make setup-test`). docs/gpu.md says what each part prints and what an H200 gave.
#
#   bash bench/gpu.sh                        # tests, memory, speed
#   PARTS="memory" bash bench/gpu.sh         # some of them
#   OUT=gpu-logs bash bench/gpu.sh           # where the logs go (default: gpu-results/)
#
# Each part runs under its own time cap, so one that hangs leaves the others their time; its
# whole output goes to $OUT/PART.log and its table to the screen. `speed` needs CMU AN4's clips:
# a folder holding audio/an4/ and manifest.jsonl (as bench/README.md describes), found beside
# the checkout as ../shared/realspeech or named by WHISPER_TRAIN_REALSPEECH.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PARTS=${PARTS:-tests memory speed}
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
want() { [[ " $PARTS " == *" $1 "* ]]; }

part() {  # part NAME SECONDS COMMAND...: runs COMMAND with a cap, its output to $OUT/NAME.log
  local name=$1 cap=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=5 "$cap" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - start)) s (cap $cap s; log $OUT/$name.log)"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || {
  echo "no NVIDIA GPU found (nvidia-smi failed): these parts need CUDA" >&2
  exit 2
}
"$PY" -c "import torch, transformers; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__)"

# The CUDA tests (`make test-gpu`): ~70 s on an H200; two skip with one GPU.
if want tests; then
  part tests 600 "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs
  tail -5 "$OUT/tests.log"
fi

# Peak memory of whole training steps against the planner's estimate, small to large-v3.
if want memory; then
  part memory 300 "$PY" bench/gpu_memory.py
  grep -v -i "warn" "$OUT/memory.log" | tail -20
fi

# whisper-small's shape on AN4's 1 s clips listed 40 times (100 steps): whisper-train eager and
# compiled, with and without data workers, against the Seq2SeqTrainer eager and compiled.
if want speed; then
  realspeech=$("$PY" -c "import sys; sys.path.insert(0, 'bench'); import common; print(common.REALSPEECH)")
  if [ -f "$realspeech/manifest.jsonl" ]; then
    WHISPER_TRAIN_REALSPEECH=$realspeech part speed 600 "$PY" bench/throughput.py \
      --d-model 768 --layers 12 --batch-size 16 --rounds 1 --compile-sets an4 --repeat 40
    grep -v -i "warn" "$OUT/speed.log" | tail -12
  else
    echo "== speed: skipped, no AN4 clips at $realspeech (set WHISPER_TRAIN_REALSPEECH)"
  fi
fi
