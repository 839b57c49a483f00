"""Transcribe recordings of any length to text, SRT, WebVTT or JSON: `whisper-train transcribe`.

Each `--model` runs in the runtime its format is deployed with (`load_backend`: the format's
row of `formats.registry` names its backend, `backends`): a CTranslate2 folder in
faster-whisper, a ggml-model.bin in whisper.cpp, a model.pt in openai-whisper, and whatever
else `--model` names (a transformers folder, a run folder, a hub id) in transformers; so does a
format whose runtime is not installed (whisper-train reads it), said in one line.

A file that cannot be read is reported and skipped; the others still get transcribed.

A recording is read and decoded a part at a time (`longform.transcribe_in_pieces`), by every
runtime: its memory does not grow with its length (faster-whisper, handed a path or a whole
array, would decode the whole file and compute its whole log-mel before its first window).
On a terminal, the progress bar's line says how much of the recording is decoded.

`--assistant MODEL` decodes with speculative decoding (`transcription.assistant`), which only
transformers runs: a model of another format is then read into transformers, said in one line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from whisper_train.audio import AUDIO_SUFFIXES, audio_pieces
from whisper_train.data.layouts import load_examples
from whisper_train.errors import AudioError, UserError, last_line
from whisper_train.files import check_output_path
from whisper_train.formats.registry import EXPORT_FORMATS, ExportFormat, format_of
from whisper_train.models import load_assistant, load_model, model_folder
from whisper_train.runlog import progress_bars_wanted
from whisper_train.transcription.assistant import make_assistant, refuse_unassistable
from whisper_train.transcription.backends import TransformersBackend, torch_device
from whisper_train.transcription.decoding import DecodingOptions
from whisper_train.transcription.longform import PIECE_SECONDS, transcribe_in_pieces
from whisper_train.transcription.transcripts import TRANSCRIPT_FORMATS, Transcript, render

AUDIO_EXTENSIONS = set(AUDIO_SUFFIXES)
MANIFEST_EXTENSIONS = {".jsonl", ".json", ".csv", ".tsv"}


def load_backend(
    model,
    *,
    language=None,
    task=None,
    beam_size=1,
    decoding=None,
    word_timestamps=False,
    assistant=None,
):
    """`model`: a spec string (folder, hub id, tiny.en) or a (model, processor) pair.

    `decoding`: the temperature fallback (`decoding.DecodingOptions`; None: on, openai-whisper's
    defaults); `word_timestamps`: segments carry their words' times (not for the formats that
    cannot carry a model's alignment heads: whisper.cpp's). `assistant`: the drafter of
    speculative decoding, a spec or a (model, processor) pair, loaded as `model` is."""
    options = {"language": language, "task": task, "beam_size": beam_size, "decoding": decoding}
    shown = assistant if assistant is None or isinstance(assistant, str) else "MODEL"
    refuse_unassistable(shown, beam_size=beam_size, word_timestamps=word_timestamps)
    if isinstance(model, tuple):
        return _transformers_backend(*model, assistant, word_timestamps, options)
    path = model_folder(str(model))
    export_format = format_of(path)
    if assistant is not None and export_format is not None:
        if export_format.backend is not TransformersBackend:
            # The user asked for speculative decoding, which only transformers runs.
            print(
                f"--assistant: transformers runs --model {model} ({export_format.runtime} has no "
                "speculative decoding)",
                file=sys.stderr,
                flush=True,
            )
    elif export_format is not None and export_format.backend is not TransformersBackend:
        cannot_time_words = word_timestamps and not export_format.carries_alignment_heads
        if export_format.client_installed() or cannot_time_words:
            return _runtime_backend(export_format, path, word_timestamps, options)
        # whisper-train reads every format itself: a missing runtime costs speed, not the run.
        print(
            f"--model {model}: {export_format.runtime} is not installed "
            f"({export_format.install}), so transformers runs it",
            file=sys.stderr,
            flush=True,
        )
    # Everything transformers runs is read as `--model` reads it: any folder, a hub id too.
    hf_model, processor = load_model(str(model))
    return _transformers_backend(
        hf_model.to(torch_device()), processor, assistant, word_timestamps, options
    )


def _transformers_backend(model, processor, assistant, word_timestamps, options):
    """A TransformersBackend, with its assistant (a spec or a (model, processor) pair) loaded
    as --model is and checked against the model (`make_assistant`)."""
    if isinstance(assistant, tuple):
        helper = make_assistant(model, processor, *assistant, "MODEL")
    else:
        helper = load_assistant(assistant, model, processor)
    return TransformersBackend(
        model, processor, word_timestamps=word_timestamps, assistant=helper, **options
    )


def _runtime_backend(export_format: ExportFormat, path: Path, word_timestamps: bool, options):
    """The backend of a model that its own runtime (not transformers) runs, handed its files
    only once whisper-train's reader of the format (train's) accepted them."""
    model_input = export_format.runtime_input(path)
    if word_timestamps:  # what the format cannot do is said before its files are read
        if not export_format.carries_alignment_heads:
            others = [fmt for fmt in EXPORT_FORMATS if fmt.carries_alignment_heads]
            instead = " or ".join(f"--format {fmt.name} ({fmt.runtime})" for fmt in others)
            raise UserError(
                f"--word-timestamps: not available for {export_format.runtime} models "
                f"({model_input}); export the model with {instead} instead"
            )
        options = {**options, "word_timestamps": True}
    export_format.require_client()
    export_format.accepted_input(path)
    try:
        return export_format.backend(model_input, **options)
    except UserError:
        raise
    except Exception as exc:  # what our reader cannot foresee, in the runtime's last words
        raise UserError(
            f"--model {model_input}: {export_format.runtime} could not load it "
            f"({last_line(exc)[:200]}); download, convert or export the model again"
        ) from None


@dataclass(frozen=True)
class _Input:
    path: str
    name: str
    start: float | None = None
    end: float | None = None
    problem: str | None = None  # set when the input itself is unusable


def collect_inputs(inputs: Sequence[str | Path]) -> list[_Input]:
    """Files, folders (searched for audio files) and manifests → recordings to transcribe."""
    found: list[_Input] = []
    for item in map(Path, inputs):
        if item.is_dir():
            files = sorted(p for p in item.rglob("*") if p.suffix.lower() in AUDIO_EXTENSIONS)
            if not files:
                found.append(_Input(str(item), item.name, problem="no audio files in this folder"))
            found += [_Input(str(p), p.stem) for p in files]
        elif item.suffix.lower() in MANIFEST_EXTENSIONS and item.is_file():
            for example in load_examples(item):
                name = Path(example.audio).stem
                if example.start is not None or example.end is not None:
                    name += f"_{example.start or 0:.2f}-{example.end or 0:.2f}"
                found.append(_Input(example.audio, name, example.start, example.end))
        elif not item.exists():
            found.append(_Input(str(item), item.stem, problem="no such file or folder"))
        else:
            found.append(_Input(str(item), item.stem))
    # Two recordings with the same file name must not overwrite each other's transcript.
    seen: dict[str, int] = {}
    unique = []
    for entry in found:
        count = seen.get(entry.name, 0)
        seen[entry.name] = count + 1
        unique.append(
            entry if count == 0 else _Input(**{**asdict(entry), "name": f"{entry.name}-{count}"})
        )
    return unique


# -- the library entry point ----------------------------------------------------------------


def transcribe_paths(
    model,
    inputs: Sequence[str | Path],
    *,
    format: str = "txt",
    language: str | None = None,
    task: str | None = None,
    beam_size: int = 1,
    output_dir: str | Path | None = None,
    progress: bool = True,
    decoding: DecodingOptions | None = None,
    word_timestamps: bool = False,
    assistant=None,
) -> list[Transcript]:
    """Transcribe every recording in `inputs`; write `<output_dir>/<name>.<format>` per file.

    `model` is a spec (`--model`) or a (model, processor) pair. Recordings that fail carry an
    `error` and are skipped; the rest are still transcribed. `decoding`: the temperature
    fallback (None: on, with openai-whisper's defaults; `NO_FALLBACK`: greedy only).
    `word_timestamps`: each segment gets its words' times (json: `words`; srt/vtt: each word
    underlined while spoken), from the model's alignment heads. `assistant`: a smaller model
    (a spec or a (model, processor) pair) that drafts for `model` (speculative decoding; the
    text is the model's own greedy text), on transformers.
    """
    if format not in TRANSCRIPT_FORMATS:
        raise UserError(f"--format {format}: expected one of {', '.join(TRANSCRIPT_FORMATS)}")
    if beam_size < 1:
        raise UserError(f"--beam-size {beam_size}: must be at least 1")
    if output_dir is not None:  # before the model loads and the first recording is decoded
        check_output_path(output_dir, "--output-dir", folder=True)
    recordings = collect_inputs(inputs)
    if not recordings:
        raise UserError("no inputs given; pass audio files, folders or a manifest")
    if all(entry.problem for entry in recordings):  # said before the model loads
        first, more = recordings[0], len(recordings) - 1
        raise UserError(
            f"{first.path}: {first.problem}"
            + (f" (and {more} more)" if more else "")
            + "; pass audio files, folders of audio or a manifest"
        )
    backend = load_backend(
        model,
        language=language,
        task=task,
        beam_size=beam_size,
        decoding=decoding,
        word_timestamps=word_timestamps,
        assistant=assistant,
    )
    if output_dir is not None:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    show_bar = progress and progress_bars_wanted()
    bar = tqdm(recordings, desc="transcribe", unit="file", disable=not show_bar)
    for entry in bar:
        transcript = Transcript(source=entry.path, name=entry.name)
        if entry.problem:
            transcript.error = entry.problem
        else:
            try:
                # Read and decoded a part at a time: memory does not grow with the length.
                pieces = audio_pieces(entry.path, PIECE_SECONDS, start=entry.start, end=entry.end)
                transcript.text, transcript.segments = transcribe_in_pieces(
                    backend.transcribe, pieces, progress=_progress_of(bar, entry.name)
                )
            except AudioError as exc:  # the line names the path already
                transcript.error = exc.reason
            except UserError as exc:
                transcript.error = str(exc)
        if transcript.error:
            bar.write(f"skipped {entry.path}: {transcript.error}", file=sys.stderr)
        elif output_dir is not None:
            target = output_dir / f"{entry.name}.{format}"
            target.write_text(render(transcript, format), encoding="utf-8")
        results.append(transcript)
    return results


def _progress_of(bar, name: str):
    """The progress line's account of a long recording: how much of it is decoded (the bar's
    one line, on a terminal only, as every bar of whisper-train)."""

    def progress(seconds: float) -> None:
        minutes, rest = divmod(int(seconds), 60)
        bar.set_postfix_str(f"{name}: {minutes}:{rest:02d} decoded", refresh=True)

    return progress
