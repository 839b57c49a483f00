"""Export a fine-tuned model for the runtime it will run in, and prove the export transcribes
as its source does, in that runtime.

    whisper-train export --model OUTPUT --format ct2 --quantization int8 --output model-ct2

1. Load: any `--model` spec; a whisper-train run folder (OUTPUT or OUTPUT/final) holding a
   LoRA adapter (`adapter_config.json`) is loaded onto its base model in float32 and merged
   with peft's `merge_and_unload`. Merging happens in float weights only: merging into int8 /
   4-bit weights rounds the adapter away (a frequent complaint with other tools).
2. Save, by `--format`:
     hf      safetensors + tokenizer + preprocessor + generation config (transformers);
     ct2     CTranslate2 (faster-whisper), with tokenizer.json and preprocessor_config.json;
     ggml    whisper.cpp's ggml-model.bin, written here (ggml.py);
     openai  openai-whisper's model.pt (openai_whisper.py).
3. Check, like with like: the source (transformers) transcribes the check clips greedily,
   and the export's own runtime (faster-whisper's CTranslate2, whisper.cpp, openai-whisper,
   transformers) scores exactly those tokens, teacher forced, from its own log-mel of the same
   audio (runtimes.py). The export fails when the mean |Δ log p| per token exceeds what the
   runtime's arithmetic explains (`logprob_tolerance`), when its vocabulary spells a transcript
   differently, or when the runtime cannot run it. Each runtime's own greedy transcripts are
   compared too, for the report only: two runtimes' greedy decoders tip near-tied words apart
   even on bit-identical weights (issue 33: base as ct2 float16, bitwise equal to Systran's
   conversion, differed in 7 words of 126).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from whisper_train.config import require_positive
from whisper_train.deploy.runtimes import MissingRuntimeError
from whisper_train.errors import UserError
from whisper_train.models import (
    HUB_ID,
    is_multilingual,
    load_model,
    model_folder,
    resolve_alias,
    save_model_folder,
)
from whisper_train.runfolder import CONFIG_FILE, aside_path
from whisper_train.training.model_card import CARD_FILE, export_card

log = logging.getLogger(__name__)

FORMATS = ("hf", "ct2", "ggml", "openai")
EXPORT_QUANTIZATIONS = ("float32", "float16", "int8", "int8_float16")
# Weight precisions each format can hold (int8 is CTranslate2's).
FORMAT_QUANTIZATIONS = {
    "hf": ("float32", "float16"),
    "ct2": EXPORT_QUANTIZATIONS,
    "ggml": ("float32", "float16"),
    "openai": ("float32", "float16"),
}
# The file each runtime format's folder holds (an earlier export, for --overwrite).
EXPORT_MARKERS = ("config.json", "ggml-model.bin", "model.pt")
DEVICES = ("cpu", "cuda")
# The largest mean |log p_source - log p_export| per token of the source's transcripts, in nats,
# by the arithmetic the export's runtime scores in (logprob_tolerance says where they come from).
LOGPROB_TOLERANCE = {"float32": 0.005, "float16": 0.05, "int8": 0.1}
CHECK_CLIPS = 12
# Spoken by espeak-ng when no --check-data is given: everyday sentences, about 110 words, so
# that one near-tied word is under 1% of the check.
CHECK_SENTENCES = (
    "open the door and turn on the light in the kitchen",
    "my brother plays football every saturday afternoon",
    "there are twelve eggs in the box on the table",
    "turn left at the church and walk for five minutes",
    "i would like a cup of tea with milk and sugar",
    "the train to london leaves at half past seven in the morning",
    "please put the books back on the shelf when you are done",
    "we planted tomatoes and beans in the garden last spring",
    "the meeting has been moved to thursday at three o'clock",
    "she bought a new coat because the winter was very cold",
    "can you tell me where the nearest bus stop is",
    "the children were playing in the park until it started to rain",
)


class ExportParityError(UserError):
    """The exported model transcribes clearly worse than the model it came from."""


@dataclass
class ExportResult:
    output: Path
    format: str
    quantization: str
    merged_lora: bool
    parity: ParityCheck | None
    moved_aside: Path | None = None  # where --overwrite put the earlier export


def default_device() -> str:
    """Where the export will run when --device is not given: this machine."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_quantization(format: str, device: str) -> tuple[str, str]:
    """(quantization, why) when --quantization is not given.

    ggml and openai: float16, what whisper.cpp and OpenAI ship (float32 on request).
    hf: float32, the precision transformers loads by default. ct2 on cuda: float16, half the
    size at no measurable WER cost. ct2 on cpu: float32. CTranslate2 has no fast float16 on
    CPUs, so a float16 model is converted to float32 (with a warning) on every load anyway.
    int8 is faster-whisper's usual CPU choice and smaller still, but it changes the weights;
    the default stays exact (the parity check then holds it to 1 point) and int8 is one flag.
    """
    if format == "hf":
        return "float32", "the default for --format hf"
    if format in ("ggml", "openai"):
        return "float16", f"the default for --format {format}, as its runtime's own models"
    if device == "cuda":
        return "float16", "the default for --device cuda"
    return "float32", (
        "the default for --device cpu, where CTranslate2 would convert float16 to float32 on "
        "every load; --quantization int8 is smaller and faster on a CPU"
    )


# -- loading and merging --------------------------------------------------------------------


def _base_model_spec(adapter_dir: Path) -> str:
    """The base model of a LoRA adapter: adapter_config.json, else the run's whisper-train.yaml."""
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    candidates = [adapter_config.get("base_model_name_or_path")]
    for config_file in (adapter_dir / CONFIG_FILE, adapter_dir.parent / CONFIG_FILE):
        if config_file.is_file():
            run = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
            candidates.append((run.get("model") or {}).get("model"))

    for spec in filter(None, candidates):
        if Path(resolve_alias(spec)).expanduser().exists() or HUB_ID.match(resolve_alias(spec)):
            return spec
    raise UserError(
        f"{adapter_dir}: cannot find the LoRA adapter's base model (adapter_config.json names "
        f"{adapter_config.get('base_model_name_or_path')!r}); set base_model_name_or_path there"
    )


def merge_lora(adapter_dir: str | Path):
    """A LoRA adapter folder → (merged WhisperForConditionalGeneration in float32, processor)."""
    from peft import PeftModel
    from transformers import GenerationConfig, WhisperProcessor

    adapter_dir = Path(adapter_dir)
    base, processor = load_model(_base_model_spec(adapter_dir))
    quantised = [name for name, p in base.named_parameters() if not p.is_floating_point()]
    if quantised:
        raise UserError(
            f"{adapter_dir}: the base model holds quantised weights ({quantised[0]}); merging a "
            "LoRA adapter into them loses it: load the base model in float16/32"
        )
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    # The run folder's processor and generation config carry the training language/task.
    if any(
        (adapter_dir / name).exists()
        for name in ("preprocessor_config.json", "processor_config.json")
    ):
        processor = WhisperProcessor.from_pretrained(str(adapter_dir))
    if (adapter_dir / "generation_config.json").exists():
        merged.generation_config = GenerationConfig.from_pretrained(str(adapter_dir))
    return merged, processor


def load_for_export(model_spec: str):
    """(model in float32, processor, whether a LoRA adapter was merged) for any spec."""

    path = model_folder(model_spec)
    if (path / "adapter_config.json").is_file():
        model, processor = merge_lora(path)
        return model, processor, True
    model, processor = load_model(model_spec)
    return model, processor, False


# -- saving ---------------------------------------------------------------------------------


# -- parity check ---------------------------------------------------------------------------


@dataclass
class ClipComparison:
    """One check clip: the source's transcript scored by both sides, and each side's own
    greedy transcript (informative)."""

    name: str  # the audio file's name, or "synthesised #N"
    reference: str
    source: str  # the source's greedy transcript: the tokens both sides score
    exported: str  # the export's own greedy transcript in its runtime (informative)
    spelled: str  # the source's tokens turned into text by the export's runtime
    deviations: np.ndarray  # |log p_source - log p_export| of each token, in nats
    words: int  # in the source's transcript, normalised
    errors: int  # word edits turning the source's transcript into the export's (informative)

    @property
    def spelled_alike(self) -> bool:
        return self.spelled == self.source


@dataclass
class ParityCheck:
    """The export against its source, like with like: the export's runtime scores the tokens of
    the source's transcripts (teacher forcing) and spells them with its own vocabulary."""

    runtime: str
    language: str | None  # forced in both decoders (None: an English-only model)
    clips: list[ClipComparison]
    tolerance: float  # the largest mean |Δ log p| per token the precision explains, in nats
    quantization: str
    arithmetic: str  # what the runtime computed in (scoring_arithmetic)
    source_wer: float  # against the references: context, not the test
    export_wer: float
    runtime_error: str | None = None  # the runtime could not load or run the export

    @property
    def tokens(self) -> int:
        return sum(len(clip.deviations) for clip in self.clips)

    @property
    def deviation(self) -> float:
        """Mean |Δ log p| per token over every clip's tokens (nan: no tokens to score)."""
        if not self.tokens:
            return math.nan
        return float(np.concatenate([clip.deviations for clip in self.clips]).mean())

    @property
    def misspelled(self) -> list[ClipComparison]:
        return [clip for clip in self.clips if not clip.spelled_alike]

    @property
    def passed(self) -> bool:
        return (
            self.runtime_error is None
            and self.tokens > 0
            and self.deviation <= self.tolerance
            and not self.misspelled
        )

    @property
    def words(self) -> int:
        return sum(clip.words for clip in self.clips)

    @property
    def word_errors(self) -> int:
        return sum(clip.errors for clip in self.clips)

    @property
    def differing(self) -> list[ClipComparison]:
        return [clip for clip in self.clips if clip.errors]

    def summary(self) -> str:
        if self.runtime_error is not None:
            return f"{self.runtime} could not run the export: {self.runtime_error}"
        worst = max(self.clips, key=lambda clip: clip.deviations.max(initial=0.0))
        return (
            f"the source's transcripts of {len(self.clips)} clips ({self.tokens} tokens) scored "
            f"through {self.runtime}: mean |Δ log p| {self.deviation:.4f} nats per token "
            f"(allowed {self.tolerance} for {self.quantization} in {self.arithmetic} arithmetic; "
            f"largest "
            f"{worst.deviations.max(initial=0.0):.3f} in {worst.name}), "
            f"{len(self.clips) - len(self.misspelled)}/{len(self.clips)} spelled alike by its "
            f"vocabulary; greedy transcripts (informative): {self.word_errors} of {self.words} "
            f"words differ, WER against the references {100 * self.export_wer:.1f}% exported vs "
            f"{100 * self.source_wer:.1f}% source"
        )


def scoring_arithmetic(format: str, quantization: str) -> str:
    """The precision the export's runtime computes in when the check scores it: what bounds the
    difference from the source. float16 weights alone change nothing measurable (CTranslate2
    converts them to float32 on a CPU; openai-whisper's model holds float32); float16
    arithmetic does (whisper.cpp always, CTranslate2 on a GPU)."""
    if quantization.startswith("int8"):
        return "int8"
    if format == "ggml":
        return "float16"
    if format == "ct2" and quantization == "float16":
        import ctranslate2

        return "float16" if ctranslate2.get_cuda_device_count() > 0 else "float32"
    return "float32"


def logprob_tolerance(arithmetic: str) -> float:
    """The largest mean |Δ log p| per token of the source's transcripts an intact export shows,
    by `scoring_arithmetic`.

    Measured (BENCHMARKS.md, "The export check, like with like") over the 12 synthesised clips
    on tiny.en and base: float32 arithmetic (float32 or float16 weights in CTranslate2 or
    openai-whisper on a CPU) 0.0000 nats; whisper.cpp's float16 arithmetic 0.0074 (tiny.en)
    and 0.0172 (base); int8 0.029 (tiny.en) and 0.021 (base). Each bound is about 3x the
    largest of these. A q/k pair swapped in tiny.en's first decoder layer, the subtlest
    breakage measured, moved float16 weights 0.044 (caught in float32 arithmetic) and int8
    0.062 (within int8's own noise: not caught).
    """
    return LOGPROB_TOLERANCE.get(arithmetic, LOGPROB_TOLERANCE["int8"])


def check_clips(
    check_data: str | None, n_clips: int = CHECK_CLIPS
) -> list[tuple[str, np.ndarray, str, str | None]]:
    """(name, audio, reference, language) of the first `n_clips` of `check_data`, or of
    synthesised English speech."""
    from whisper_train.audio import load_audio

    if check_data is not None:
        from whisper_train.data.layouts import load_examples

        examples = load_examples(check_data)[:n_clips]
        return [
            (
                Path(e.audio).name,
                load_audio(e.audio, start=e.start, end=e.end),
                e.text,
                e.language,
            )
            for e in examples
        ]
    from whisper_train.data.synth import synthesize

    return [
        (f"synthesised #{i + 1}", synthesize(text), text, "en")
        for i, text in enumerate(CHECK_SENTENCES[:n_clips])
    ]


def check_language(model, processor, clips) -> str | None:
    """The one language both sides are forced to: None for English-only models; else the
    language the check data states, or the one the model was fine-tuned for (its generation
    config), or English for the synthesised clips, or the source's detection on the first clip."""
    from whisper_train.deploy.runtimes import detect_language

    if not is_multilingual(model):
        return None
    synthesised = clips[0][0].startswith("synthesised")
    stated = [language for _, _, _, language in clips if language]
    if stated and not synthesised:
        if len(set(stated)) > 1:
            log.info("the check data states several languages; forcing %s (the first)", stated[0])
        return language_code(stated[0])
    pinned = getattr(model.generation_config, "language", None)
    if pinned:
        return language_code(pinned)
    if synthesised:
        return "en"
    return detect_language(model, processor, clips[0][1])


def language_code(language: str) -> str:
    """`<|de|>`, `german` or `de` -> `de`."""
    from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

    language = language.strip("<|>").lower()
    return TO_LANGUAGE_CODE.get(language, language)


@dataclass
class SourceSide:
    """What the source made of the check clips: its greedy transcripts, their tokens, and its
    own teacher-forced scores of them."""

    clips: list
    language: str | None
    prompt: list[int]
    texts: list[str]
    tokens: list[list[int]]
    scores: list  # runtimes.TokenScores per clip


def score_source(model, processor, clips, language: str | None) -> SourceSide:
    """The source's greedy transcripts of `clips` and its scores of their tokens (before the
    export is written: saving in float16 converts `model` in place)."""
    from whisper_train.deploy.runtimes import (
        prompt_ids,
        transformers_greedy_tokens,
        transformers_scores,
    )

    audio = [clip[1] for clip in clips]
    texts, tokens = transformers_greedy_tokens(model, processor, audio, language)
    prompt = prompt_ids(processor.tokenizer, is_multilingual(model), language)
    scores = transformers_scores(model, processor, audio, prompt, tokens)
    return SourceSide(clips, language, prompt, texts, tokens, scores)


def check_export(
    source: SourceSide, format: str, output: Path, quantization: str, *, greedy: bool = True
) -> ParityCheck:
    """The export at `output` against `source`, in the export's own runtime.

    The verdict rests on teacher forcing: the runtime scores the source's transcript tokens from
    its own log-mel of the same audio, and the mean |Δ log p| per token must stay within what
    the precision explains; its vocabulary must spell every transcript as the source's does.
    The runtime's own greedy transcripts are compared too (unless not `greedy`), for the report
    only: a near-tied word tipped by another runtime's arithmetic is not a defect of the file
    (issue 33).
    """
    from whisper_train.deploy.runtimes import RUNTIME_NAMES, runtime_greedy, runtime_scores

    audio = [clip[1] for clip in source.clips]
    runtime = RUNTIME_NAMES[format]
    arithmetic = scoring_arithmetic(format, quantization)
    try:
        scores = runtime_scores(format, output, audio, source.prompt, source.tokens)
        exported = (
            runtime_greedy(format, output, audio, source.language) if greedy else source.texts
        )
    except UserError as exc:
        if isinstance(exc, MissingRuntimeError):
            raise
        error = str(exc)
    except Exception as exc:  # the runtime's own refusal of a damaged file, in its words
        error = f"{type(exc).__name__}: {exc}"
    else:
        return compare(
            source,
            scores,
            exported,
            runtime=runtime,
            quantization=quantization,
            arithmetic=arithmetic,
        )
    return ParityCheck(
        runtime=runtime,
        language=source.language,
        clips=[],
        tolerance=logprob_tolerance(arithmetic),
        quantization=quantization,
        arithmetic=arithmetic,
        source_wer=math.nan,
        export_wer=math.nan,
        runtime_error=error.splitlines()[0][:300] if error else "no message",
    )


def compare(
    source: SourceSide,
    scores,
    exported: list[str],
    *,
    runtime: str,
    quantization: str,
    arithmetic: str,
) -> ParityCheck:
    """Per clip: the token log-probabilities' differences, the spelling, and (informative) the
    word differences between the greedy transcripts."""
    from whisper_train.evaluation.scoring import get_normalizer, score, word_counts

    normalize = get_normalizer(None, source.language)
    rows = []
    for (name, _, reference, _), text, theirs, ours, exp in zip(
        source.clips, source.texts, scores, source.scores, exported, strict=True
    ):
        words, subs, dels, ins = word_counts(normalize(text), normalize(exp))
        deviations = np.abs(np.asarray(ours.logprobs) - np.asarray(theirs.logprobs))
        rows.append(
            ClipComparison(
                name, reference, text, exp, theirs.text, deviations, words, subs + dels + ins
            )
        )
    references = [reference for _, _, reference, _ in source.clips]
    return ParityCheck(
        runtime=runtime,
        language=source.language,
        clips=rows,
        tolerance=logprob_tolerance(arithmetic),
        quantization=quantization,
        arithmetic=arithmetic,
        source_wer=score(references, source.texts, normalizer=normalize).wer,
        export_wer=score(references, exported, normalizer=normalize).wer,
    )


def parity_failure(check: ParityCheck, format: str) -> ExportParityError:
    """The failure message: what differs (scores, spelling, the runtime's refusal), each clip
    concerned, advice that fits the finding."""
    lines = [f"export check failed: {check.summary()}"]
    for clip in check.misspelled:
        lines += [
            f"  {clip.name}: the export's vocabulary spells the source's tokens differently",
            f"    source: {clip.source!r}",
            f"    export: {clip.spelled!r}",
        ]
    if check.runtime_error is None and check.deviation > check.tolerance:
        worst = sorted(
            check.clips,
            key=lambda clip: -float(clip.deviations.mean()) if len(clip.deviations) else 0.0,
        )
        for clip in worst[:3]:
            lines.append(
                f"  {clip.name}: mean |Δ log p| {clip.deviations.mean():.3f} over "
                f"{len(clip.deviations)} tokens of {clip.source!r} (export's own transcript: "
                f"{clip.exported!r})"
            )
    if check.runtime_error is None and not check.tokens:
        advice = (
            "the source transcribed none of the check clips, so there was nothing to score: "
            "pass --check-data with speech the model transcribes"
        )
    elif check.quantization.startswith("int8") and not check.misspelled and not check.runtime_error:
        advice = (
            "int8 moved the scores more than int8 rounding does elsewhere: try --quantization "
            "float16 (or float32), and please report it"
        )
    else:
        advice = (
            "the precision does not explain this, so the conversion itself is suspect: please "
            "report it with the lines above"
        )
    lines.append(f"  the export was written to its folder anyway; {advice}")
    return ExportParityError("\n".join(lines))


# -- the library entry point ----------------------------------------------------------------


def export_model(
    model_spec: str,
    *,
    format: str = "hf",
    output: str | Path,
    quantization: str | None = None,
    check_data: str | None = None,
    check: bool = True,
    n_check_clips: int = CHECK_CLIPS,
    device: str | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Merge (LoRA), save as `format` into `output`, then check it in its own runtime.

    `quantization` None picks one from `format` and `device` (where the export will run; None
    means this machine): see `default_quantization`. An `output` that is not empty is refused
    unless `overwrite`, which moves it aside to `<output>.old-<date>-<time>` (an earlier export
    only). Raises ExportParityError (after writing the export) when the check fails, and
    runtimes.MissingRuntimeError before writing anything when the check's runtime client is
    not installed.
    """
    from whisper_train.deploy.runtimes import require_client

    if format not in FORMATS:
        raise UserError(f"--format {format}: expected one of {', '.join(FORMATS)}")
    device = device or default_device()
    if device not in DEVICES:
        raise UserError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    if quantization is None:
        quantization, why = default_quantization(format, device)
        log.info("quantization %s: %s (pass --quantization to choose)", quantization, why)
    if quantization not in EXPORT_QUANTIZATIONS:
        raise UserError(
            f"--quantization {quantization}: expected one of {', '.join(EXPORT_QUANTIZATIONS)}"
        )
    if quantization not in FORMAT_QUANTIZATIONS[format]:
        raise UserError(
            f"--quantization {quantization} needs --format ct2; --format {format} takes "
            f"{' or '.join(FORMAT_QUANTIZATIONS[format])}"
        )
    if check:
        require_positive("--check-clips", n_check_clips, alternative="use --no-check")
        require_client(format)  # before the work: one line naming the extra
        if format == "ggml" and quantization == "float32":
            # Measured with pywhispercpp 1.5.1: its CPU convolution asserts float16 kernels
            # (ggml-cpu ops.cpp GGML_ASSERT) and aborts the whole process on a float32 file.
            raise UserError(
                "--format ggml --quantization float32: whisper.cpp's CPU build (pywhispercpp "
                "1.5.1) aborts on float32 convolution kernels, so this export cannot be checked; "
                "add --no-check to write it anyway (it reads back into whisper-train exactly), "
                "or keep the float16 default"
            )
    output = Path(output)
    if overwrite:  # moving --output aside must not take the model to export with it
        source = Path(resolve_alias(model_spec)).expanduser().resolve()
        if source == output.resolve() or output.resolve() in source.parents:
            raise UserError(
                f"--model {model_spec} is inside --output {output}, which --overwrite would "
                "move aside; export to a new folder"
            )
    moved_aside = _clear_output(output, overwrite=overwrite)

    model, processor, merged = load_for_export(model_spec)
    if torch.cuda.is_available():
        model = model.to("cuda")  # only speeds up the source's transcripts; saving is the same
    if check:
        # Score the clips before saving: saving in float16 converts `model` in place.
        clips = check_clips(check_data, n_check_clips)
        source = score_source(model, processor, clips, check_language(model, processor, clips))
    card = None  # an hf folder's README.md: the source run's model card, or the base's
    if format == "hf":
        card = export_card(model_spec, output=output, quantization=quantization, merged_lora=merged)
    save_export(model, processor, output, format=format, quantization=quantization, card=card)
    log.info("saved %s export to %s", format, output)
    parity = None
    if check:
        parity = check_export(source, format, output, quantization)
        if not parity.passed:
            raise parity_failure(parity, format)
    return ExportResult(output, format, quantization, merged, parity, moved_aside)


def save_export(
    model, processor, output: Path, *, format: str, quantization: str, card: str | None = None
) -> None:
    """Write `model` into `output` as `format` in `quantization` (no check); `card`: an hf
    folder's model card (README.md)."""
    if format == "hf":
        dtype = torch.float16 if quantization == "float16" else torch.float32
        readme = {CARD_FILE: card} if card is not None else None
        save_model_folder(model, processor, output, dtype=dtype, extra_files=readme)
    elif format == "ggml":
        from whisper_train.formats.ggml import save_ggml

        save_ggml(model, processor, output, quantization=quantization)
    elif format == "openai":
        from whisper_train.formats.openai import save_openai

        dtype = torch.float16 if quantization == "float16" else torch.float32
        save_openai(model, processor, output, dtype=dtype)
    else:
        from whisper_train.formats.ct2 import save_ct2

        with tempfile.TemporaryDirectory(prefix="whisper-train-export-") as hf_dir:
            save_model_folder(model, processor, Path(hf_dir))
            save_ct2(hf_dir, output, quantization=quantization, overwrite=True)
            # Keep the generation config (language/task) beside the CTranslate2 weights.
            shutil.copyfile(
                Path(hf_dir) / "generation_config.json", output / "generation_config.json"
            )


def _clear_output(output: Path, *, overwrite: bool) -> Path | None:
    """Refuse a non-empty --output; with `overwrite`, move an earlier export aside (never a
    folder of other files: --output /home/me must not take the user's files with it)."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} is a file: choose a folder path for the export")
    if not output.exists() or not any(output.iterdir()):
        return None
    if not overwrite:
        raise UserError(
            f"--output {output} is not empty: add --overwrite to move it aside to "
            f"{output.name}.old-<date>-<time>, or choose a new folder"
        )
    if not any((output / marker).is_file() for marker in EXPORT_MARKERS):
        raise UserError(
            f"--output {output}: --overwrite replaces only an earlier export "
            f"({', '.join(EXPORT_MARKERS)}), and "
            "this folder holds other files; choose a new folder"
        )

    aside = aside_path(output)
    try:
        output.rename(aside)
    except OSError as exc:
        raise UserError(
            f"--overwrite: could not move {output} aside to {aside} ({exc.strerror or exc}); "
            "move or delete it yourself, or choose a new --output"
        ) from None
    log.info("--overwrite: moved the earlier export %s to %s", output, aside)
    return aside
