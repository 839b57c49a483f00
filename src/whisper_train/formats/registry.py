"""The export formats, one row each: whatever is particular to a format is in its row.

A row holds a format's files (whisper-train's own `write`r and `read`er, which checks the files
before any runtime loads them, and the `markers` that identify a folder of them), the weight
precisions it holds, and the runtime people run it with: that runtime's Python client and the
pip extra installing it, the export check's greedy transcripts and teacher-forced scores in it
(`formats.runtimes`), the arithmetic it scores in (which sets the check's tolerance,
`deploy.parity.logprob_tolerance`), and the `transcribe` backend that runs it
(`transcription.backends`). `deploy`, `models` and `transcription.transcribe` iterate
`EXPORT_FORMATS` and never name a format; a new format is a module of its files, its runtime's
functions, a backend and one row here (as a data layout is a reader and a row of
`data.layouts.LAYOUTS`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from whisper_train.errors import UserError
from whisper_train.formats import ct2, ct2_convert, ggml, hf, openai, runtimes
from whisper_train.formats.runtimes import MissingRuntimeError
from whisper_train.transcription.backends import (
    CTranslate2Backend,
    OpenAIWhisperBackend,
    TransformersBackend,
    WhisperCppBackend,
    ct2_device,
)

# Where an export will run: it picks a format's default precision.
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ExportFormat:
    """One `export --format`, its files and the runtime that runs them."""

    name: str  # `--format NAME`
    runtime: str  # the runtime that runs it, as its users know it
    markers: tuple[str, ...]  # the files a folder of this format holds, all of them
    model_file: str | None  # the one file its runtime loads (None: the whole folder)
    quantizations: tuple[str, ...]  # the weight precisions it holds
    default_quantization: Callable[[str], tuple[str, str]]  # device -> (precision, why)
    write: Callable[..., object]  # (model, processor, folder, *, quantization)
    read: Callable[..., tuple]  # (folder or model file, *, attn_implementation) -> model, processor
    # (folder or model file) -> None: its files as `read` reads them, refused in one line naming
    # the file, with no model built; asked before any runtime is handed them.
    check: Callable[[Path], None]
    arithmetic: Callable[[str], str]  # float precision -> what its runtime computes in
    greedy: Callable[..., list[str]]  # (what its runtime loads, clips, language) -> transcripts
    scores: Callable[..., list]  # (what its runtime loads, clips, prompt, tokens) -> TokenScores
    backend: Callable  # `transcribe`'s runner of it: its class, or a function making one
    client: str | None = None  # the runtime's Python module; None: transformers, always there
    extra: str | None = None  # the pip extra that installs the client
    writes_with_client: bool = False  # its writer needs the client too (CTranslate2's converter)
    carries_alignment_heads: bool = True  # its files keep a model's heads (word timestamps)
    model_card: bool = False  # its folder carries the source's model card (README.md)
    # Precisions its runtime cannot check, and why: `export` then asks for --no-check.
    unchecked: Mapping[str, str] = field(default_factory=dict)
    # Why its runtime cannot run a language a model adds (train --new-language), read in the
    # runtime's own code; None: it runs one (the token and lang_to_id travel in its files).
    no_new_language: str | None = None

    def holds(self, folder: Path) -> bool:
        """Whether `folder` holds this format's files."""
        return all((folder / marker).is_file() for marker in self.markers)

    def runtime_input(self, path: Path) -> Path:
        """What its runtime loads of `path` (an export folder, or the model file itself)."""
        if self.model_file is None or path.is_file():
            return path
        return path / self.model_file

    def accepted_input(self, path: Path) -> Path:
        """What its runtime loads of `path`, once whisper-train's own reader accepted its files
        (`check`): a runtime trusts the counts in a file, and a damaged or crafted one ends in
        its traceback, an allocation of petabytes or an abort; ours say it in one line."""
        self.check(path)
        return self.runtime_input(path)

    def client_installed(self) -> bool:
        if self.client is None:
            return True
        try:
            importlib.import_module(self.client)
        except ImportError:
            return False
        return True

    @property
    def install(self) -> str:
        """The command that installs this format's runtime client."""
        return f"pip install 'whisper-train[{self.extra}]'"

    def require_client(self, *, check: bool = True) -> None:
        """One line naming the extra that installs this format's runtime client when the export
        needs it (`MissingRuntimeError`): to be checked, or, for a format whose writer is the
        client's (`writes_with_client`), to be written at all."""
        if self.client_installed() or not (check or self.writes_with_client):
            return
        how = self.install
        if self.writes_with_client:
            raise MissingRuntimeError(
                f"--format {self.name}: writing it needs {self.runtime}, which is not "
                f"installed: {how}"
            )
        raise MissingRuntimeError(
            f"--format {self.name}: checking the export needs {self.runtime}, which is not "
            f"installed: {how} (or pass --no-check to only write the export)"
        )


def _check_hf(path: Path) -> None:
    hf.check_hf_folder(path, str(path))


def _float32_arithmetic(quantization: str) -> str:
    """transformers and openai-whisper (and CTranslate2 on a CPU) compute in float32, whatever
    the weights are stored in."""
    return "float32"


def _whisper_cpp_arithmetic(quantization: str) -> str:
    return "float16"  # whisper.cpp multiplies in float16 even with float32 weights


def _ctranslate2_arithmetic(quantization: str) -> str:
    """CTranslate2 computes float16 weights in float16 on a GPU, in float32 on a CPU."""
    if quantization == "float16" and ct2_device() == "cuda":
        return "float16"
    return "float32"


def _transformers_default(device: str) -> tuple[str, str]:
    return "float32", "the default for --format hf"  # what transformers loads by default


def _as_its_runtime_ships(name: str) -> Callable[[str], tuple[str, str]]:
    """float16, the precision whisper.cpp and OpenAI ship their own models in (float32 on
    request), whatever the device."""

    def default(device: str) -> tuple[str, str]:
        return "float16", f"the default for --format {name}, as its runtime's own models"

    return default


def _faster_whisper_backend(model_dir, **options) -> CTranslate2Backend:
    """transcribe's faster-whisper, in the compute type chosen for this machine's device."""
    return CTranslate2Backend(
        model_dir, compute_type=runtimes.ct2_compute_type(model_dir), **options
    )


def _ctranslate2_default(device: str) -> tuple[str, str]:
    """float16 on cuda: half the size at no measurable WER cost. float32 on a CPU: CTranslate2
    has no fast float16 there and converts a float16 model to float32 (with a warning) on every
    load. int8 is faster-whisper's usual CPU choice and smaller still, but it changes the
    weights; the default stays exact (the parity check then holds it to 1 point)."""
    if device == "cuda":
        return "float16", "the default for --device cuda"
    return "float32", (
        "the default for --device cpu, where CTranslate2 would convert float16 to float32 on "
        "every load; --quantization int8 is smaller and faster on a CPU"
    )


FLOATS = ("float32", "float16")

# In `--format`'s order (hf, the default, first).
EXPORT_FORMATS = (
    ExportFormat(
        name="hf",
        runtime="transformers",
        markers=("config.json",),
        model_file=None,
        quantizations=FLOATS,
        default_quantization=_transformers_default,
        write=hf.save_hf,
        read=hf.load_hf,
        check=_check_hf,
        arithmetic=_float32_arithmetic,
        greedy=runtimes.transformers_export_greedy,
        scores=runtimes.transformers_export_scores,
        backend=TransformersBackend,
        model_card=True,  # the folder people upload to the hub, where README.md is its page
    ),
    ExportFormat(
        name="ct2",
        runtime="faster-whisper",
        markers=(ct2.CT2_MODEL_FILE, ct2.MODEL_CONFIG),
        model_file=None,
        quantizations=(*FLOATS, "int8", "int8_float16"),  # int8 is CTranslate2's alone
        default_quantization=_ctranslate2_default,
        write=ct2_convert.save_ct2_model,
        read=ct2.load_ct2_whisper,
        check=ct2.check_ct2_folder,
        arithmetic=_ctranslate2_arithmetic,
        greedy=runtimes.faster_whisper_greedy,
        scores=runtimes.faster_whisper_scores,
        backend=_faster_whisper_backend,
        client="faster_whisper",
        extra="faster-whisper",
        writes_with_client=True,
        # faster_whisper/tokenizer.py: Tokenizer() raises ValueError for a code outside its
        # _LANGUAGE_CODES, whether given or detected (transcribe builds one from the detected
        # token), so CTranslate2's files could hold the token but the runtime never runs it.
        no_new_language="its tokenizer refuses every language code outside its own fixed "
        "table, given or detected",
    ),
    ExportFormat(
        name="ggml",
        runtime="whisper.cpp (pywhispercpp)",
        markers=(ggml.GGML_MODEL_FILE,),
        model_file=ggml.GGML_MODEL_FILE,
        quantizations=FLOATS,
        default_quantization=_as_its_runtime_ships("ggml"),
        write=ggml.save_ggml,
        read=ggml.load_ggml,
        check=ggml.check_ggml,
        arithmetic=_whisper_cpp_arithmetic,
        greedy=runtimes.whisper_cpp_greedy,
        scores=runtimes.whisper_cpp_scores,
        backend=WhisperCppBackend,
        client="pywhispercpp",
        extra="whispercpp",
        # whisper.cpp takes alignment heads at load, as a preset for OpenAI's own models (or a
        # custom list pywhispercpp 1.5.1 cannot pass); a ggml file has no field for them.
        carries_alignment_heads=False,
        # Measured with pywhispercpp 1.5.1: its CPU convolution asserts float16 kernels
        # (ggml-cpu ops.cpp GGML_ASSERT) and aborts the whole process on a float32 file.
        unchecked={
            "float32": "whisper.cpp's CPU build (pywhispercpp 1.5.1) aborts on float32 "
            "convolution kernels"
        },
        # whisper.cpp looks a language up in its fixed table ("unknown language") and numbers
        # the special tokens from n_vocab (a 51,866-token model reads as large-v3's 100
        # languages, every task token one off).
        no_new_language="it looks languages up in a fixed table and numbers its special "
        "tokens from the vocabulary's size (one token more reads as large-v3's)",
    ),
    ExportFormat(
        name="openai",
        runtime="openai-whisper",
        markers=(openai.OPENAI_MODEL_FILE,),
        model_file=openai.OPENAI_MODEL_FILE,
        quantizations=FLOATS,
        default_quantization=_as_its_runtime_ships("openai"),
        write=openai.save_openai,
        read=openai.load_openai,
        check=openai.check_openai,
        arithmetic=_float32_arithmetic,
        greedy=runtimes.openai_whisper_greedy,
        scores=runtimes.openai_whisper_scores,
        backend=OpenAIWhisperBackend,
        client="whisper",
        extra="openai",
        # whisper/tokenizer.py builds its special tokens from its LANGUAGES table, cut to
        # n_vocab - 51765 - 1 languages (model.py), and get_tokenizer refuses other codes.
        no_new_language="its tokenizer is built from a fixed language table sized by the "
        "vocabulary (one token more reads as large-v3's) and refuses other codes",
    ),
)
FORMATS = tuple(fmt.name for fmt in EXPORT_FORMATS)
DEFAULT_FORMAT = FORMATS[0]
# Every precision some format holds, in the order the formats name them.
EXPORT_QUANTIZATIONS = tuple(dict.fromkeys(q for fmt in EXPORT_FORMATS for q in fmt.quantizations))


def export_format(name: str) -> ExportFormat:
    """The row of `--format name`; one line listing the formats for any other name."""
    for fmt in EXPORT_FORMATS:
        if fmt.name == name:
            return fmt
    raise UserError(f"--format {name}: expected one of {', '.join(FORMATS)}")


def format_of(path: Path) -> ExportFormat | None:
    """The format of a model folder, or of the model file a runtime loads (by its suffix);
    None when `path` is neither."""
    if path.is_dir():
        # A CTranslate2 folder holds a transformers folder's config.json too: the format whose
        # markers are most specific is asked first.
        for fmt in sorted(EXPORT_FORMATS, key=lambda fmt: -len(fmt.markers)):
            if fmt.holds(path):
                return fmt
        return None
    if path.is_file():
        for fmt in EXPORT_FORMATS:
            if fmt.model_file is not None and path.suffix == Path(fmt.model_file).suffix:
                return fmt
    return None


__all__ = [
    "DEFAULT_FORMAT",
    "DEVICES",
    "EXPORT_FORMATS",
    "EXPORT_QUANTIZATIONS",
    "FORMATS",
    "ExportFormat",
    "export_format",
    "format_of",
]
