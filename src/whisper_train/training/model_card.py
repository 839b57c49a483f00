"""The model card: README.md in the Hugging Face Hub's format, in a run's final/ (`run_card`)
and in an `export --format hf` folder (`export_card`).

The front matter (written by huggingface_hub's `ModelCard`) names the base model when it is a
Hub model, the training language(s) when known, the base's license when its own card states
one, `pipeline_tag`, tags and a `model-index` with each evaluation set's WER (in percent) at the
step final/ holds. The body gives each set's figures before (step 0, when the run evaluated it)
and after, the mode and main hyper-parameters, the clip counts, and what the figures rest on.
Only numbers the run measured appear: a run that evaluated nothing gets no results."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache
from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

from whisper_train import runfolder
from whisper_train.choices import NONSPEECH_ALONGSIDE, NONSPEECH_SPREAD
from whisper_train.config.record import RunRecord
from whisper_train.data.examples import Example
from whisper_train.data.labels import DEFAULT_NONSPEECH_FORM, NONSPEECH_TAUGHT
from whisper_train.errors import UserError
from whisper_train.formats import packaged
from whisper_train.models import could_be_hub_id, folder_is_multilingual, model_folder
from whisper_train.runlog import TrainResult, read_result
from whisper_train.units import format_share

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
TASK = "automatic-speech-recognition"
# A snapshot in the Hub's cache: .../models--owner--name/snapshots/<revision>
HUB_CACHE_SNAPSHOT = re.compile(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+$")


# -- the base model --------------------------------------------------------------------------


def base_model_id(spec: str) -> str | None:
    """The Hub id `--model` names: an alias's, a hub id's own, a Hub cache snapshot's; None
    for any other local folder (a filesystem path is no `base_model`)."""
    aliases = {"tiny.en": "openai/whisper-tiny.en", packaged.BASE_ALIAS: packaged.BASE_HUB_ID}
    if spec in aliases:
        return aliases[spec]
    path = Path(spec).expanduser()
    if not path.exists():
        return spec if could_be_hub_id(spec) else None
    snapshot = HUB_CACHE_SNAPSHOT.search(path.resolve().as_posix())
    return f"{snapshot[1]}/{snapshot[2]}" if snapshot else None


def _describe_base(spec: str) -> str:
    """The base model in a sentence's words, never its local path."""
    hub_id = base_model_id(spec)
    if hub_id is not None:
        return f"[{hub_id}](https://huggingface.co/{hub_id})"
    name = Path(spec).expanduser().resolve().name
    return f"a local model folder named `{name}` (not a Hub model: the card names no base_model)"


def base_license(spec: str) -> str | None:
    """The license the base model's own card (README.md in its folder, or in the Hub cache)
    states; None when there is none to read (never guessed)."""
    folder = model_folder(spec)
    readme = folder / CARD_FILE if folder.is_dir() else None
    hub_id = base_model_id(spec)
    if (readme is None or not readme.is_file()) and hub_id is not None:
        cached = try_to_load_from_cache(hub_id, CARD_FILE)
        readme = Path(cached) if isinstance(cached, str) else None
    if readme is None or not readme.is_file():
        return None
    try:
        license = ModelCard.load(readme, ignore_metadata_errors=True).data.license
    except (ValueError, OSError, yaml.YAMLError):
        return None
    return license if isinstance(license, str) else None


def base_is_multilingual(spec: str) -> bool | None:
    """Whether the base model has language tokens, from its small files (its folder's, or the
    Hub cache's config.json); None when they are not there."""
    folder, hub_id = model_folder(spec), base_model_id(spec)
    if not folder.exists() and hub_id is not None:
        cached = try_to_load_from_cache(hub_id, "config.json")
        folder = Path(cached).parent if isinstance(cached, str) else folder
    try:
        return folder_is_multilingual(folder) if folder.exists() else None
    except (UserError, OSError):  # unreadable: the card then names no language it cannot tell
        return None


def language_code(language: str) -> str:
    """`german`, `<|de|>` or `de` → `de` (the Hub's ISO 639-1 codes)."""
    language = language.strip("<|>").lower()
    return TO_LANGUAGE_CODE.get(language, language)


def training_languages(
    record: RunRecord, multilingual: bool | None, train_examples: Iterable[Example] = ()
) -> list[str]:
    """--language, else the languages the training rows state, else English for an
    English-only model; empty when not known."""
    if record.data.language:
        return [language_code(record.data.language)]
    stated = sorted({language_code(e.language) for e in train_examples if e.language})
    if stated:
        return stated
    return ["en"] if multilingual is False else []


# -- the card of a run -----------------------------------------------------------------------


def run_card(
    record: RunRecord,
    result: TrainResult | None,
    train_examples: Iterable[Example] = (),
    *,
    note: str = "",
) -> str | None:
    """README.md of a run's final/: `record` is the run's (its decisions are what the card
    describes), `result` what it measured (None: not known, so no results), `train_examples`
    the rows it trained on (their languages), `note` a closing paragraph. None, said in a
    warning, if the card cannot be made: a card is no reason to lose the model a run
    trained."""
    try:
        return _run_card(record, result, train_examples, note)
    except Exception as exc:  # anything: final/ is written without its card
        log.warning("the model card was not written (%s: %s)", type(exc).__name__, exc)
        return None


def _run_card(
    record: RunRecord,
    result: TrainResult | None,
    train_examples: Iterable[Example],
    note: str,
) -> str:
    spec = record.model.model
    name = Path(record.output.output_dir).name or "whisper-train-model"
    rows = _final_rows(result)
    languages = training_languages(record, base_is_multilingual(spec), train_examples)
    data = ModelCardData(
        base_model=base_model_id(spec),
        language=languages or None,
        license=base_license(spec),
        library_name="transformers",
        pipeline_tag=TASK,
        tags=["whisper", "whisper-train", record.model.mode],
        model_name=name if rows else None,
        eval_results=[_eval_result(record, set_name, row) for set_name, row in rows.items()]
        or None,
    )
    body = [
        f"# {name}",
        f"A fine-tune of {_describe_base(spec)} with whisper-train (mode `{record.model.mode}`).",
        *_results_section(record, result, rows),
        *_training_section(record, result, languages),
    ]
    if note:
        body.append(note)
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(body) + "\n"))


def _final_rows(result: TrainResult | None) -> dict[str, dict]:
    """{set: its evaluation row} at the step final/ holds, finite WERs only."""
    if result is None:
        return {}
    return {
        row.get("set", result.primary_set): row
        for row in result.evaluations
        if row["step"] == result.final_step and math.isfinite(row.get("wer", math.nan))
        if row.get("averaged") == result.final_averaged  # the average's rows, or the step's
    }


def _eval_result(record: RunRecord, set_name: str, row: dict) -> EvalResult:
    eval_set = record.evaluation.set_named(set_name)
    path = eval_set.path if eval_set is not None else ""
    hub_dataset = path if could_be_hub_id(path) and not Path(path).exists() else None
    return EvalResult(
        task_type=TASK,
        dataset_type=hub_dataset or set_name,
        dataset_name=set_name,
        metric_type="wer",
        metric_value=round(100 * row["wer"], 2),
        metric_name=f"WER (%) at step {row['step']}",
    )


def _percent(value: float | None) -> str:
    return "–" if value is None or not math.isfinite(value) else f"{100 * value:.2f}%"


def _before_after(before: dict | None, after: dict, key: str) -> str:
    then = _percent(before.get(key)) if before else "–"
    return f"{then} → {_percent(after.get(key))}"


def _role(record: RunRecord, result: TrainResult, set_name: str) -> str:
    if set_name == record.evaluation.guard:
        return "guard"
    return "picks final/" if set_name == result.primary_set else "evaluation"


def _results_section(
    record: RunRecord, result: TrainResult | None, rows: dict[str, dict]
) -> list[str]:
    if result is None:
        return ["## Results", "No result.json was found for this model: this card has no results."]
    if not result.evaluations:
        return [
            "## Results",
            "This run evaluated nothing (`--only-train`): the card states no WER, and nothing "
            "in it measures how well this model transcribes.",
        ]
    if not rows:
        return [
            "## Results",
            f"No evaluation scored step {result.final_step}, the step final/ holds: the card "
            "states no WER for it.",
        ]
    start = {
        row.get("set", result.primary_set): row for row in result.evaluations if not row["step"]
    }
    language_id = any("language_id_accuracy" in row for row in [*rows.values(), *start.values()])
    header = ["set", "role", "clips", "WER", "loops", "insertions"]
    header += ["language ID accuracy"] if language_id else []
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for set_name, row in rows.items():
        before = start.get(set_name)
        cells = [f"`{set_name}`", _role(record, result, set_name), str(row.get("clips", "–"))]
        cells += [
            _before_after(before, row, key)
            for key in ("wer", "repeated_ngram_rate", "insertion_rate")
            + (("language_id_accuracy",) if language_id else ())
        ]
        table.append("| " + " | ".join(cells) + " |")
    step = result.final_step
    before = (
        "Each figure reads step 0 (the starting model) → "
        if start
        else "The starting model was not evaluated (no `--eval-at-start` or `--guard`), so "
        "there is no before: – → "
    )
    return [
        "## Results",
        f"final/ holds step {step} of {result.steps}: {result.final_reason}."
        if not result.final_averaged
        else f"final/ holds {result.final_reason}.",
        "\n".join(table),
        f"{before}step {step} (this model). WER: word error rate after text normalisation; "
        "loops: repeated word 3-grams among all 3-grams of the transcripts; insertions: "
        "inserted words per reference word (words the model made up).",
        *_nonspeech_section(record, result),
        *_what_figures_rest_on(record, result, rows),
    ]


def _nonspeech_section(record: RunRecord, result: TrainResult) -> list[str]:
    """Each non-speech set's words per minute and share of clips with text, from its start
    to the step final/ holds."""
    lines = []
    for name in record.evaluation.nonspeech_sets:
        measured = {r["step"]: r for r in result.evaluations if r.get("set") == name}
        after = measured.get(result.final_step)
        if after is None:
            continue
        start = min(measured)
        before = measured[start]
        lines.append(
            f"| `{name}` | {after['clips']} | {before['words_per_minute']:.1f} → "
            f"{after['words_per_minute']:.1f} | {_percent(before['share_with_text'])} → "
            f"{_percent(after['share_with_text'])} |"
        )
    if not lines:
        return []
    header = "| non-speech set | clips | words per minute | clips with text |\n|---|---|---|---|"
    return [
        "\n".join([header, *lines]),
        "Text the model writes where nobody speaks (silence, noise, tones, music), from each "
        f"set's start to step {result.final_step}; final/ holds no step that invented more "
        f"than {record.evaluation.max_nonspeech_rise:g} words per minute over the start.",
    ]


def _what_figures_rest_on(
    record: RunRecord, result: TrainResult, rows: dict[str, dict]
) -> list[str]:
    lines = [
        f"- `{name}`: {row.get('clips', 'an unknown number of')} clips"
        for name, row in rows.items()
    ]
    split = [s.name for s in record.evaluation.sets if s.split and s.name in rows]
    if split:
        lines.append(
            f"- `{split[0]}` is a seeded random {record.data.eval_split:g} split of the "
            "training data: the same speakers, recording conditions and often words as "
            "training, so its WER says little about speech this model has not heard."
        )
    else:
        lines.append(
            "- whisper-train cannot tell who speaks in a set: a WER on data drawn like the "
            "training data proves little unless the set's speakers (and words) were held out "
            "from training."
        )
    guard = record.evaluation.guard
    if guard in rows:
        start = (result.guard_start or {}).get("step", 0)
        lines.append(
            f"- `{guard}` is the guard set: what the model must keep knowing; final/ holds no "
            f"step whose guard WER rose more than {record.evaluation.max_regression:g} points "
            f"over its start (step {start})."
        )
    return ["### What these figures rest on", "\n".join(lines)]


# -- how it was trained ----------------------------------------------------------------------


def _training_section(
    record: RunRecord, result: TrainResult | None, languages: list[str]
) -> list[str]:
    m, d, mem, training = record.model, record.data, record.memory, record.training
    mode = f"`{m.mode}`"
    if m.lora_r is not None:
        variant = {"dora": "DoRA, ", "rslora": "rsLoRA, "}.get(m.lora_variant or "", "")
        mode += (
            f" ({variant}r {m.lora_r}, alpha {m.lora_alpha}, dropout {m.lora_dropout:g}, on "
            f"{', '.join(m.lora_targets)}; merged into full weights here)"
        )
    if m.quantize_base != "none":
        bits = {"int8": "8-bit (LLM.int8)", "nf4": "4-bit NF4, double-quantized"}
        mode += (
            f"; the frozen base held in {bits[m.quantize_base]} weights while training "
            "(bitsandbytes), the adapters merged into its original full-precision weights"
        )
    rate = f"- learning rate: {training.learning_rate:g}"
    if training.encoder_learning_rate != training.learning_rate:
        rate += f", the encoder's {training.encoder_learning_rate:g}"
    rate += (
        f" ({training.lr_scheduler} schedule, {training.warmup_steps} warm-up steps), weight "
        f"decay {training.weight_decay:g}, optimizer {mem.optim}"
    )
    step = (
        f"- batch: {d.clips_per_step} clips per optimizer step (--batch-size "
        f"{d.clips_per_micro_batch} x --gradient-accumulation {d.accumulation} x "
        f"{d.processes} process(es)); packing {d.packing}"
    )
    lines = [
        f"- mode: {mode}",
        rate,
        step,
        f"- length: {training.total_steps} optimizer steps planned"
        + (f", {result.steps} done" if result is not None else ""),
        f"- precision: {mem.precision}; gradient checkpointing: {mem.checkpointing}",
        f"- task: {d.task}; training language: {', '.join(languages) or 'not stated'}"
        + (" (--pin-language: saved in the model)" if d.pin_language else ""),
        f"- seed: {training.seed}",
    ]
    if m.teacher is not None:
        student = (
            f"{m.decoder_layers} of the teacher's decoder layers (first and last kept) and its "
            "encoder"
            if m.decoder_layers
            else "the base above"
        )
        lines.append(
            f"- distilled from {_describe_base(m.teacher)}: the student is {student}; loss "
            f"{training.distill_ce_weight:g} x cross-entropy + {training.distill_kl_weight:g} x "
            f"KL(teacher || student) at temperature {training.distill_temperature:g} (x T^2)"
        )
    if d.nonspeech is not None:
        lines.append(
            f"- clips where nobody speaks: --nonspeech {d.nonspeech}, "
            f"{format_share(d.nonspeech_share)} of "
            f"each epoch, taught {NONSPEECH_TAUGHT[d.nonspeech_label or DEFAULT_NONSPEECH_FORM]} "
            + (
                "riding in the room the speech's windows left "
                if d.nonspeech_placement == NONSPEECH_ALONGSIDE
                else "dealt evenly through the steps "
                if d.nonspeech_placement == NONSPEECH_SPREAD
                else ""
            )
            + "(so that silence stays silent)"
        )
    if m.new_language is not None:
        lines.append(
            f"- added language: `{m.new_language}` (the token <|{m.new_language}|>, its "
            f"embedding row initialised from <|{m.new_language_init}|>'s and trained; "
            f"transcribe with language `{m.new_language}`)"
        )
    if result is not None:
        clips = f"- training data: {result.train_examples} clips"
        if result.skipped_clips:
            clips += f" ({result.skipped_clips} clips skipped as unreadable during training)"
        lines.append(clips)
        if result.skipped_steps:
            lines.append(f"- {result.skipped_steps} optimizer steps skipped (NaN or infinite)")
    lines += [f"- {note}" for note in record.notes]
    return ["## Training", "\n".join(lines)]


# -- the card of an export -------------------------------------------------------------------


def export_card(
    model_spec: str, *, output: Path, quantization: str, merged_lora: bool
) -> str | None:
    """README.md of an `export --format hf` folder: the source's whisper-train card, else one
    made from its run's files (whisper-train.yaml, result.json), else a card of the base model
    with no results; each ends by saying what the export did. None (a warning) if a run's
    card cannot be made again."""
    folder = model_folder(model_spec)
    note = (
        f"This folder is `whisper-train export --format hf` of that model in {quantization}"
        + (", its LoRA adapter merged" if merged_lora else "")
        + ": the figures above were measured before the export."
    )
    source_card = folder / CARD_FILE
    card = None
    if source_card.is_file():  # (load() of a path that is no file asks the Hub)
        try:
            card = ModelCard.load(source_card, ignore_metadata_errors=True)
        except (ValueError, OSError, yaml.YAMLError):  # not a card: one is made below
            card = None
    if card is not None and "whisper-train" in (card.data.tags or []):
        card.text = card.text.rstrip("\n") + f"\n\n{note}\n"
        return str(card)
    config_file = folder / runfolder.CONFIG_FILE
    if config_file.is_file():
        try:
            record = RunRecord.from_yaml(config_file.read_text(encoding="utf-8"))
        except (ValueError, TypeError, AttributeError, yaml.YAMLError):
            record = None
        if record is not None:
            return run_card(record, _run_result(folder), note=note)
    return _plain_export_card(model_spec, folder, output, quantization, merged_lora)


def _run_result(final_dir: Path) -> TrainResult | None:
    """The result.json of the run whose final/ is `final_dir`, if it is there."""
    if final_dir.name != runfolder.FINAL_DIR:
        return None
    try:
        return read_result(final_dir.parent)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _plain_export_card(
    model_spec: str, folder: Path, output: Path, quantization: str, merged_lora: bool
) -> str:
    data = ModelCardData(
        base_model=base_model_id(model_spec),
        language=["en"] if base_is_multilingual(model_spec) is False else None,
        license=base_license(model_spec),
        library_name="transformers",
        pipeline_tag=TASK,
        tags=["whisper", "whisper-train"],
    )
    body = [
        f"# {output.resolve().name}",
        f"`whisper-train export --format hf` of {_describe_base(model_spec)} in {quantization}"
        + (", its LoRA adapter merged" if merged_lora else "")
        + ".",
        "No whisper-train run's record came with it, so this card states no results: nothing "
        "in it measures how well this model transcribes.",
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(body) + "\n"))
