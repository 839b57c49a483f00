"""Text where nobody speaks, before and after the no-speech test: tiny.en on the built-in
non-speech set, decoded by whisper-train's own decoding (transformers) and by faster-whisper,
with --no-speech-threshold off and at its default 0.6; and, as the price on speech, WER on
real recordings (../shared/realspeech, when present) with the test off and on.

    PYTHONPATH=src .venv/bin/python bench/nonspeech.py [--speech-clips 20] [--realspeech DIR]

With --fine-tunes DIR: the base (tiny.en), the demo's default fine-tune, and the demo's
fine-tune with --nonspeech builtin, its clips labelled each way (`labels.NOSPEECH_FORM`,
`labels.EMPTY_FORM`), all on the built-in non-speech set (whose samples --nonspeech builtin
never trains on) in both decoders at their defaults, with the demo's held-out WER and real
speech's beside it:

    PYTHONPATH=src .venv/bin/python bench/nonspeech.py --fine-tunes /tmp/ns-bench [--seed 1] [--share 0.2] \
        [--model base]

With --score MODEL ...: each model (a folder, tiny.en or base) on a larger non-speech set, the
built-in one and --draws - 1 other draws of its noise (a finer measure than its 19 clips):

    PYTHONPATH=src .venv/bin/python bench/nonspeech.py --score base /tmp/ns/run1/final --draws 4

or, with --set DIR, on real recordings where nobody speaks instead: every audio file under DIR
cut into 30 s clips (a last piece under 5 s dropped). Music, for one: Debian's
asterisk-moh-opsound-wav holds five instrumental pieces (18 minutes, 8 kHz, CC BY-SA 3.0),

    apt-get download asterisk-moh-opsound-wav && dpkg-deb -x asterisk-moh-opsound-wav_*.deb /tmp/moh
    PYTHONPATH=src .venv/bin/python bench/nonspeech.py --score tiny.en /tmp/ns/run4/final \
        --set /tmp/moh/usr/share/asterisk/moh
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import soundfile
from common import REALSPEECH  # noqa: E402  (bench/ is this script's folder: on sys.path)

from whisper_train.audio import AUDIO_SUFFIXES, SAMPLE_RATE, load_audio
from whisper_train.data.examples import Example
from whisper_train.data.labels import BOTH_FORM, EMPTY_FORM, NONSPEECH_LABEL, NOSPEECH_FORM
from whisper_train.data.layouts import load_examples
from whisper_train.data.nonspeech import builtin_clips, load_nonspeech, write_builtin_set
from whisper_train.demo import demo_config, prepare_demo_data
from whisper_train.deploy.export import export_model
from whisper_train.evaluation.evaluate import evaluate_examples
from whisper_train.evaluation.nonspeech import evaluate_nonspeech_examples, score_nonspeech
from whisper_train.models import load_model, resolve_alias
from whisper_train.training.train import train
from whisper_train.transcription.backends import CTranslate2Backend
from whisper_train.transcription.decoding import DecodingOptions

SETTINGS = {"off": DecodingOptions(no_speech_threshold=None), "0.6": DecodingOptions()}


def _real_speech(folder: Path, clips: int) -> list[Example]:
    manifest = folder / "manifest.jsonl"
    if not manifest.exists():
        return []
    rows = [json.loads(line) for line in manifest.read_text().splitlines()[:clips]]
    return [Example(audio=str(folder / row["audio"]), text=row["text"]) for row in rows]


def _measure(spec: str, nonspeech: list, held_out: list, speech: list, work: Path) -> dict:
    """One model's figures: non-speech words/min in both decoders (their defaults), the mean
    no-speech probability there, and WER (and clips emptied as silence) on `held_out` and
    `speech` where given."""
    model, processor = load_model(spec)
    report = evaluate_nonspeech_examples(model, processor, nonspeech)
    probabilities = [d.no_speech_prob for d in report.decoded if d.no_speech_prob is not None]
    figures = {
        "model": spec,
        "transformers_wpm": report.scores.words_per_minute,
        "transformers_with_text": report.scores.clips_with_text,
        "no_speech_prob": sum(probabilities) / max(1, len(probabilities)),
        "texts": report.texts,
    }
    for name, examples in (("held_out", held_out), ("real", speech)):
        if examples:
            scored = evaluate_examples(model, processor, examples)
            figures[f"{name}_wer"] = scored.wer
            figures[f"{name}_emptied"] = sum(d.no_speech for d in scored.decoded)
    if spec in ("tiny.en", "base"):  # shipped as CTranslate2 models: the runtime's own files
        ct2 = Path(resolve_alias(spec))
    else:
        ct2 = work / "ct2"
        export_model(spec, format="ct2", output=ct2, check=False, overwrite=True)
    backend = CTranslate2Backend(ct2, decoding=DecodingOptions())
    clips = [load_audio(e.audio) for e in nonspeech]
    texts = [backend.transcribe(audio, timestamps=False)[0] for audio in clips]
    scores = score_nonspeech(texts, [len(a) / 16_000 for a in clips])
    figures["faster_whisper_wpm"] = scores.words_per_minute
    figures["faster_whisper_with_text"] = scores.clips_with_text
    figures["faster_whisper_texts"] = texts
    return figures


def fine_tunes(
    root: Path,
    speech: list[Example],
    only: list[int] | None = None,
    seed: int = 0,
    share: float | None = None,
    model: str = "tiny.en",
) -> None:
    """The base, the demo's fine-tune, and the demo's fine-tune with --nonspeech builtin
    (each label form), measured alike; a table at the end. `seed`: the demo's (its data
    synthesised and its run seeded with it); `share`: --nonspeech-share (None: its default);
    `model`: the model fine-tuned (tiny.en, or the multilingual base)."""
    data_dirs = prepare_demo_data(
        root / "data", train_utterances=192, eval_utterances=40, guard_utterances=40, seed=seed
    )
    held_out = load_examples(data_dirs["held-out"])  # scored by each run, at step 0 and last
    nonspeech = load_nonspeech("builtin")
    runs = {
        "demo fine-tune (--nonspeech none)": ("none", None),
        "+ --nonspeech builtin (<|nospeech|>)": ("builtin", NOSPEECH_FORM),
        "+ --nonspeech builtin (empty transcript)": ("builtin", EMPTY_FORM),
        f"{model} (no fine-tuning)": ("base", None),
        "+ --nonspeech builtin (<|nospeech|> and empty)": ("builtin", BOTH_FORM),
    }
    rows, base_wer = [], None
    for index, (label, (source, form)) in enumerate(runs.items()):
        if only is not None and index not in only:
            continue
        started = time.perf_counter()
        if source == "base":  # its held-out WER: step 0 of the runs above
            figures = _measure(model, nonspeech, [], speech, root / "base")
            figures["held_out_wer"] = base_wer
        else:
            os.environ[NONSPEECH_LABEL] = form or NOSPEECH_FORM
            config = demo_config(
                data_dirs, root / f"run{index}", model=model, nonspeech=source, seed=seed
            )
            if model != "tiny.en":  # a multilingual model is told the demo's language
                config.update({"language": "en"})
            if share is not None and source != "none":
                config.update({"nonspeech_share": share})
            if only is not None:  # the runs alone: held-out scored once, at the end (no guard)
                config.update({"eval_data": [f"held-out={data_dirs['held-out']}"], "guard": None})
            result = train(config)
            # Held-out WER as the run scored it (decoded as `evaluate` decodes), before and after.
            base_wer = result.wer_at(0, "held-out")
            figures = _measure(str(result.final_dir), nonspeech, [], speech, root / f"run{index}")
            figures["held_out_wer"] = result.wer_at(result.final_step, "held-out")
            figures["final_reason"] = result.final_reason
        figures.update(label=label, seconds=time.perf_counter() - started)
        print(json.dumps(figures), flush=True)
        rows.append(figures)
    minutes = sum(len(load_audio(e.audio)) for e in nonspeech) / 16_000 / 60
    print(
        f"\nbuilt-in non-speech set: {len(nonspeech)} clips, {minutes:.2f} min; held-out: "
        f"{len(held_out)} demo clips; real: {len(speech)} clips of ../shared/realspeech"
    )
    print(
        "| model | words/min, whisper-train | words/min, faster-whisper | mean no-speech "
        "prob. | held-out WER | real-speech WER | real clips emptied as silence |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        real = f"{100 * r['real_wer']:.2f}%" if "real_wer" in r else "-"
        print(
            f"| {r['label']} | {r['transformers_wpm']:.1f} | {r['faster_whisper_wpm']:.1f} | "
            f"{r['no_speech_prob']:.2f} | {100 * r['held_out_wer']:.2f}% | {real} | "
            f"{r.get('real_emptied', '-')} |"
        )


def drawn_set(folder: Path, draws: int) -> list[Example]:
    """The built-in set and `draws - 1` other draws of its clips that chance shapes (noise,
    dither, clicks: the rest sound the same every draw), as WAV files in `folder`."""
    write_builtin_set(folder)
    first = builtin_clips()
    for draw in range(1, draws):
        for name, samples in builtin_clips(draw=draw).items():
            if not (samples == first[name]).all():
                soundfile.write(folder / f"draw{draw}-{name}.wav", samples, SAMPLE_RATE, "PCM_16")
    return load_nonspeech(folder)


def cut_set(source: Path, folder: Path, seconds: float = 30.0) -> list[Example]:
    """Every audio file under `source` cut into clips of `seconds` at 16 kHz, written to
    `folder` as WAV files (a last piece under 5 s dropped)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = sorted(p for p in source.rglob("*") if p.suffix.lower() in AUDIO_SUFFIXES)
    step = round(seconds * SAMPLE_RATE)
    for path in files:
        samples = load_audio(str(path))
        for index, start in enumerate(range(0, len(samples), step)):
            piece = samples[start : start + step]
            if len(piece) >= 5 * SAMPLE_RATE:
                name = f"{path.stem}-{index:02d}.wav"
                soundfile.write(folder / name, piece, SAMPLE_RATE, "PCM_16")
    return load_nonspeech(folder)


def score_models(models: list[str], draws: int, work: Path, recorded: Path | None = None) -> None:
    """Each model (a folder, tiny.en or base) on the larger non-speech set, or on the
    recordings under `recorded` cut into 30 s clips, in both decoders at their defaults: a
    finer measure than the 19 clips (a word there is 0.8 a minute)."""
    if recorded is not None:
        nonspeech = cut_set(recorded, work / "recorded")
    else:
        nonspeech = drawn_set(work / "nonspeech", draws)
    minutes = sum(len(load_audio(e.audio)) for e in nonspeech) / SAMPLE_RATE / 60
    rows = []
    for index, spec in enumerate(models):
        figures = _measure(spec, nonspeech, [], [], work / f"model{index}")
        print(json.dumps(figures), flush=True)
        rows.append(figures)
    kind = f"recordings under {recorded}" if recorded else f"{draws} draws"
    print(f"\nnon-speech: {len(nonspeech)} clips, {minutes:.2f} min ({kind})")
    print(
        "| model | words/min, whisper-train | clips with text | words/min, faster-whisper | "
        "clips with text |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['transformers_wpm']:.2f} | {r['transformers_with_text']} | "
            f"{r['faster_whisper_wpm']:.2f} | {r['faster_whisper_with_text']} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speech-clips", type=int, default=20, help="0: no real speech")
    parser.add_argument("--realspeech", type=Path, default=REALSPEECH)
    parser.add_argument("--fine-tunes", type=Path, default=None, metavar="DIR")
    parser.add_argument("--seed", type=int, default=0, help="the demo's, with --fine-tunes")
    parser.add_argument("--share", type=float, default=None, help="--nonspeech-share")
    parser.add_argument("--model", default="tiny.en", help="with --fine-tunes: tiny.en or base")
    parser.add_argument(
        "--only",
        type=lambda v: [int(i) for i in v.split(",")],
        default=None,
        help="these runs alone (0 default fine-tune, 1 and 2 --nonspeech, 3 base), each "
        "scored on held-out once, at its end",
    )
    parser.add_argument(
        "--score", nargs="+", default=None, metavar="MODEL", help="only score these models"
    )
    parser.add_argument("--draws", type=int, default=4, help="with --score: draws of the set")
    parser.add_argument(
        "--set", type=Path, default=None, metavar="DIR", help="with --score: recordings to score"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/ns-score"), help="with --score")
    args = parser.parse_args()
    if args.score:
        score_models(args.score, args.draws, args.work, args.set)
        return
    if args.fine_tunes is not None:
        speech = _real_speech(args.realspeech, args.speech_clips)
        fine_tunes(args.fine_tunes, speech, args.only, args.seed, args.share, args.model)
        return
    examples = load_nonspeech("builtin")
    model, processor = load_model("tiny.en")
    rows = []
    for label, options in SETTINGS.items():
        started = time.perf_counter()
        report = evaluate_nonspeech_examples(model, processor, examples, decoding=options)
        rows.append(("transformers", label, report.scores, time.perf_counter() - started))
        print(json.dumps({"decoder": "transformers", "no_speech": label, "texts": report.texts}))
    for label, options in SETTINGS.items():
        started = time.perf_counter()
        backend = CTranslate2Backend(Path(resolve_alias("tiny.en")), decoding=options)
        clips = [load_audio(e.audio) for e in examples]
        texts = [backend.transcribe(audio, timestamps=False)[0] for audio in clips]
        scores = score_nonspeech(texts, [len(a) / 16_000 for a in clips])
        rows.append(("faster-whisper", label, scores, time.perf_counter() - started))
        print(json.dumps({"decoder": "faster-whisper", "no_speech": label, "texts": texts}))
    minutes = rows[0][2].seconds / 60
    print(f"\nbuilt-in non-speech set: {rows[0][2].clips} clips, {minutes:.2f} min (tiny.en)")
    print("| decoder | --no-speech-threshold | words/min | clips with text | seconds |")
    print("|---|---|---|---|---|")
    for decoder, label, s, seconds in rows:
        print(
            f"| {decoder} | {label} | {s.words_per_minute:.1f} | {s.clips_with_text} of "
            f"{s.clips} | {seconds:.0f} |"
        )
    manifest = args.realspeech / "manifest.jsonl"
    if not manifest.exists():
        return
    lines = manifest.read_text().splitlines()[: args.speech_clips]
    speech = []
    for line in lines:
        row = json.loads(line)
        speech.append(Example(audio=str(args.realspeech / row["audio"]), text=row["text"]))
    print(f"\nreal speech ({len(speech)} clips of ../shared/realspeech), transformers decoding")
    print("| --no-speech-threshold | WER | utterances emptied as silence |")
    print("|---|---|---|")
    for label, options in SETTINGS.items():
        report = evaluate_examples(model, processor, speech, decoding=options)
        emptied = sum(d.no_speech for d in report.decoded)
        print(f"| {label} | {100 * report.wer:.2f}% | {emptied} |")


if __name__ == "__main__":
    main()
