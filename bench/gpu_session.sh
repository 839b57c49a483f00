#!/usr/bin/env bash
# Everything a lent GPU machine runs for issue 31, in one device call (docs/gpu-session.md):
#   run(command="bash bench/gpu_session.sh", carry=[".whl", ".whl-compat", ".gpu"], timeout_s=590)
# after `bash bench/gpu_carry.sh` here. Each phase has its own time cap, so one that hangs leaves
# the others their time; each writes its log to $OUT (at most 8 files come back). Phases run in
# the issue's order of importance: the CUDA tests, peak memory against the planner, the seed
# reports on transformers 4.56.2 and 5.x, then throughput against the Seq2SeqTrainer. PHASES
# picks some (default: tests memory seed throughput; also: workers, compile, threshold, mfu,
# profile, loop, ttq).
set -u
PHASES=${PHASES:-tests memory seed throughput}
want() { [[ " $PHASES " == *" $1 "* ]]; }
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >"$OUT/env.log" 2>&1 || { cat "$OUT/env.log"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site-compat .whl-compat/*.whl >>"$OUT/env.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/.gpu
export WHISPER_TRAIN_REALSPEECH=$PWD/.gpu/realspeech
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, peft, accelerate, bitsandbytes; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate', accelerate.__version__, '| bitsandbytes', bitsandbytes.__version__)"
  nproc
} >>"$OUT/env.log" 2>&1
cat "$OUT/env.log"

phase() {  # phase NAME SECONDS COMMAND...: runs COMMAND with a cap, output to $OUT/NAME.log
  local name=$1 cap=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=5 "$cap" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s (cap $cap s)"
}

want tests && phase tests 170 python3 -m pytest -p no:cacheprovider -m gpu tests/test_gpu.py -q -rs \
  --durations=15
want tests && tail -25 "$OUT/tests.log"

want memory && phase memory 90 python3 bench/gpu_memory.py
want memory && grep -v -i "warn" "$OUT/memory.log" | tail -20

want seed && phase seed-4.56 60 env PYTHONPATH=/tmp/site-compat:$PYTHONPATH python3 bench/seed_scenarios.py
want seed && phase seed-5 45 python3 bench/seed_scenarios.py
want seed && grep -h "^device\|^medium\|^large" "$OUT/seed-4.56.log" "$OUT/seed-5.log"

# whisper-small's shape (d_model 768, 12 + 12 layers), bf16, batch 16, checkpointing off (both):
# AN4 (0.7-1.3 s) listed 40 times, the default (per-clip), joined and unpacked against the
# Trainer (issue 56's first goal), then the first 45 real clips (MFU).
want throughput && phase throughput 240 bash -c "python3 bench/throughput.py --d-model 768 --layers 12 \
  --batch-size 16 --rounds 1 --packing-sets an4 --repeat 40 \
  --packing-systems per-clip,packed,unpacked,trainer && \
  python3 bench/throughput.py --d-model 768 --layers 12 --batch-size 16 --rounds 1 \
  --clips 45 --scenarios full --full-epochs 2"
want throughput && grep -v -i "warn" "$OUT/throughput.log" | tail -30

# The same AN4 comparison with whisper-train's data loaded by 4 worker processes.
want workers && phase workers 130 python3 bench/throughput.py --d-model 768 --layers 12 \
  --batch-size 16 --rounds 1 --packing-sets an4 --repeat 40 --num-workers 4
want workers && grep -v -i "warn" "$OUT/workers.log" | tail -12

# Unpacked whisper-train (its defaults; eager and compiled, with and without data workers) and
# the Trainer (eager, compiled) on AN4 listed 40 times: loop and steady clips/s. COMPILE_ROWS
# picks runs (bench/throughput.py --compile-rows).
want compile && phase compile ${COMPILE_CAP:-330} python3 bench/throughput.py --d-model 768 --layers 12 \
  --batch-size 16 --rounds 1 --compile-sets an4 --repeat 40 ${COMPILE_ROWS:+--compile-rows $COMPILE_ROWS}
want compile && grep -v -i "warn" "$OUT/compile.log" | tail -12

# Whether compiling from 2,000 steps (setup_phases.COMPILE_BY_DEFAULT_FROM_STEPS, measured on
# whisper-small's shape) also pays for medium's (d_model 1024, 24 + 24 layers): eager and
# compiled, both with the default data workers, on the same clips; break-even = the compiled
# run's extra first-steps seconds / its saving a steady step.
want threshold && phase threshold ${THRESHOLD_CAP:-240} python3 bench/throughput.py --d-model 1024 \
  --layers 24 --batch-size 16 --rounds 1 --compile-sets an4 --repeat 40 \
  --compile-rows default,compiled-workers
want threshold && grep -v -i "warn" "$OUT/threshold.log" | tail -8

# MFU in whisper-train's own loop at a batch the model alone reached 32.7% with (64, compiled,
# default workers): AN4 listed 160 times = 100 steps.
want mfu && phase mfu ${MFU_CAP:-200} python3 bench/throughput.py --d-model 768 --layers 12 \
  --batch-size 64 --rounds 1 --compile-sets an4 --repeat 160 --compile-rows compiled-workers
want mfu && grep -v -i "warn" "$OUT/mfu.log" | tail -6

# The model's own step time (no data path), eager and compiled (the first batch size), and a
# profile of the first: PROFILE_ARGS (default batch 16 and 64).
want profile && phase profile 260 python3 bench/gpu_profile.py ${PROFILE_ARGS:---batches 16,64 --compile --profile}
want profile && grep -v -i "warn" "$OUT/profile.log" | tail -45

# whisper-train's own loop split into data wait, train step and after-step, with a profile.
want loop && phase loop 150 python3 bench/gpu_loop_profile.py --repeat 20
want loop && grep -v -i "warn\|^step " "$OUT/loop.log" | tail -42

# bench/time_to_quality.py on the real tiny.en and the demo's synth sets (TTQ=1 bash
# bench/gpu_carry.sh): its float16 weights came in two halves, .gpu-ttq-a with an earlier call
# on this warm machine and .gpu-ttq-b with this one; joined and widened to float32 here.
# TTQ_MODE full|lora; the Trainer at the two rates BENCHMARKS' CPU table gave it.
if want ttq; then
  model=.gpu-ttq-b/model-tiny.en
  if [ ! -f .gpu-ttq-a/model.fp16.part1 ] || [ ! -f .gpu-ttq-b/model.fp16.part2 ]; then
    echo "== ttq: a half of the model is missing (a fresh machine? carry .gpu-ttq-a again)"
  else
    cat .gpu-ttq-a/model.fp16.part1 .gpu-ttq-b/model.fp16.part2 > /tmp/model.fp16
    python3 -c "from safetensors.torch import load_file, save_file; w = load_file('/tmp/model.fp16'); save_file({k: v.float() for k, v in w.items()}, '$model/model.safetensors', {'format': 'pt'})"
    mode=${TTQ_MODE:-full}
    if [ "$mode" = full ]; then rates="1e-5 5e-5"; else rates="3e-4 1e-3"; fi
    # TTQ_RATES and TTQ_SEEDS cut the runs where the device time left is short.
    phase ttq ${TTQ_CAP:-480} python3 bench/time_to_quality.py --target synth --mode "$mode" \
      --model tiny.en --work-dir .gpu-ttq-b --trainer-learning-rates ${TTQ_RATES:-$rates} \
      --seeds ${TTQ_SEEDS:-0 1} --points ${TTQ_POINTS:-3} \
      --variant "per-clip=--packing per-clip --batch-size 1"
    cp .gpu-ttq-b/time_to_quality-synth-* "$OUT/" 2>/dev/null
    grep -v -i "warn" "$OUT/ttq.log" | tail -40
  fi
fi
