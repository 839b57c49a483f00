"""Exports for whisper.cpp (ggml), openai-whisper, faster-whisper and transformers, each run
by its own runtime, and read back into whisper-train.

The real tiny.en is exported to every format and each runtime's transcripts of synthesised
speech are held to the export check's threshold against the source; random tiny models shaped
like large-v3 (128 mel bins) and turbo (4 decoder layers, 128 mel bins) export to every format
and load and decode in every runtime; float32 round trips through ggml and model.pt are
bit-exact; damaged files as --model give one line and exit 2.
"""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny_models import EOT, SOT, english_generation_config, english_tokenizer, tiny_whisper_config
from transformers import (
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
)

from whisper_train.deploy.export import save_export
from whisper_train.deploy.parity import check_clips, check_export, score_source
from whisper_train.formats import ggml
from whisper_train.formats import openai as openai_whisper


def _shaped_like(*, encoder_layers: int, decoder_layers: int, seed: int = 0):
    """A random English Whisper with 128 mel bins and a 30 s encoder, in the runtimes' fixed
    shape (MLP 4 x d_model, output projection tied)."""
    config = tiny_whisper_config(
        vocab_size=51864,
        end_of_text_id=EOT,
        start_of_transcript_id=SOT,
        d_model=64,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
    )
    config.num_mel_bins = 128
    config.encoder_ffn_dim = config.decoder_ffn_dim = 256
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = english_generation_config()
    processor = WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128), tokenizer=english_tokenizer()
    )
    return model, processor


SHAPES = {
    "large-v3": {"encoder_layers": 2, "decoder_layers": 2},
    "turbo": {"encoder_layers": 2, "decoder_layers": 4},
}


BACKENDS = {
    "ggml": "WhisperCppBackend",
    "openai": "OpenAIWhisperBackend",
}


@pytest.fixture(scope="module")
def tiny_en():
    from whisper_train.models import load_model

    return load_model("tiny.en")


@pytest.fixture(scope="module")
def check_set():
    return check_clips(None, n_clips=4)


@pytest.fixture(scope="module")
def source_side(tiny_en, check_set):
    model, processor = tiny_en
    return score_source(model, processor, check_set, None)


@pytest.mark.speech
@pytest.mark.parametrize(
    ("format", "quantization"),
    [
        ("ct2", "float32"),
        ("ct2", "float16"),
        ("ct2", "int8"),
        ("ggml", "float16"),
        ("openai", "float16"),
        ("hf", "float32"),
    ],
)
@pytest.mark.long
def test_real_tiny_en_passes_the_check_in_each_runtime(
    tiny_en, check_set, source_side, format, quantization, tmp_path
):
    model, processor = tiny_en
    audio = [clip[1] for clip in check_set]
    save_export(model, processor, tmp_path, format=format, quantization=quantization)
    check = check_export(source_side, format, tmp_path, quantization)
    assert check.tokens > 30  # the comparison is over real transcripts, not empty strings
    assert check.passed, check.summary()
    assert check.export_wer <= 0.1, "tiny.en understands these espeak-ng sentences"

    if format == "openai":  # tiny.en's alignment heads (word timestamps) ride along
        import whisper

        checkpoint = torch.load(tmp_path / openai_whisper.OPENAI_MODEL_FILE, weights_only=True)
        loaded = whisper.load_model(str(tmp_path / openai_whisper.OPENAI_MODEL_FILE), device="cpu")
        loaded.set_alignment_heads(checkpoint["alignment_heads"])
        heads = loaded.alignment_heads.to_dense().nonzero().tolist()
        assert heads == sorted(model.generation_config.alignment_heads)
    if format not in ("ggml", "openai"):
        return  # test_transcribe.py covers the transformers and faster-whisper backends
    # `transcribe` runs the export in the same runtime, with that runtime's own fallback.
    from whisper_train.evaluation.evaluate import score
    from whisper_train.transcription.transcribe import load_backend

    backend = load_backend(str(tmp_path))
    assert type(backend).__name__ == BACKENDS[format]
    text, segments = backend.transcribe(audio[0])
    assert segments and score([check_set[0][2]], [text]).wer <= 0.1, text


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_random_models_shaped_like_large_v3_and_turbo_load_in_every_runtime(shape, tmp_path):
    import whisper
    from faster_whisper import WhisperModel
    from pywhispercpp.model import Model

    from whisper_train.models import load_model

    model, processor = _shaped_like(**SHAPES[shape])
    audio = np.zeros(16000, dtype=np.float32)
    for format in ("hf", "ct2", "ggml", "openai"):
        quantization = "float32" if format in ("hf", "ct2") else "float16"
        save_export(model, processor, tmp_path / format, format=format, quantization=quantization)

    fw = WhisperModel(str(tmp_path / "ct2"), device="cpu")
    assert (
        fw.feature_extractor.mel_filters.shape[0] == 128
    )  # from preprocessor_config.json, not the default 80
    segments, _ = fw.transcribe(audio, without_timestamps=True, max_new_tokens=4, beam_size=1)
    list(segments)

    cpp = Model(str(tmp_path / "ggml" / ggml.GGML_MODEL_FILE), redirect_whispercpp_logs_to=None)
    cpp.transcribe(audio, language="en", max_tokens=4, no_timestamps=True, single_segment=True)
    del cpp

    ow = whisper.load_model(
        str(tmp_path / "openai" / openai_whisper.OPENAI_MODEL_FILE), device="cpu"
    )
    assert (ow.dims.n_mels, ow.dims.n_text_layer) == (128, SHAPES[shape]["decoder_layers"])
    mel = whisper.log_mel_spectrogram(whisper.pad_or_trim(torch.from_numpy(audio)), n_mels=128)
    whisper.decode(ow, mel, whisper.DecodingOptions(language="en", fp16=False, sample_len=4))

    for format in ("hf", "ggml", "openai"):
        back, back_processor = load_model(str(tmp_path / format))
        assert back.config.num_mel_bins == 128
        assert back.config.decoder_layers == SHAPES[shape]["decoder_layers"]
        assert back_processor.feature_extractor.feature_size == 128


@pytest.mark.parametrize("format", ["ggml", "openai"])
def test_float32_round_trips_are_bit_exact(format, tmp_path):
    from whisper_train.models import load_model

    model, processor = _shaped_like(**SHAPES["turbo"])
    save_export(model, processor, tmp_path, format=format, quantization="float32")
    back, _ = load_model(str(tmp_path))
    source, returned = model.state_dict(), back.state_dict()
    assert source.keys() == returned.keys()
    different = [name for name in source if not torch.equal(source[name], returned[name])]
    assert not different
    assert back.config.max_target_positions == 448


def test_ggml_header_holds_the_decoder_positions_and_the_mel_bins(tmp_path):
    """whisper.cpp's text context is max_target_positions (448), never generation's max_length."""
    model, processor = _shaped_like(**SHAPES["large-v3"])
    model.generation_config.max_length = 225
    path = ggml.save_ggml(model, processor, tmp_path)
    header = struct.unpack("<I11i", path.read_bytes()[:48])
    assert header[0] == ggml.MAGIC
    n_vocab, n_audio_ctx, _, _, _, n_text_ctx, _, _, _, n_mels, ftype = header[1:]
    assert (n_vocab, n_audio_ctx, n_text_ctx, n_mels, ftype) == (51864, 1500, 448, 128, 1)


@pytest.mark.parametrize("format", ["ggml", "openai"])
@pytest.mark.long
def test_damaged_model_files_as_model_give_one_line_and_exit_2(format, tmp_path):
    model, processor = _shaped_like(**SHAPES["large-v3"])
    save_export(model, processor, tmp_path, format=format, quantization="float16")
    name = ggml.GGML_MODEL_FILE if format == "ggml" else openai_whisper.OPENAI_MODEL_FILE
    data = (tmp_path / name).read_bytes()
    (tmp_path / name).write_bytes(data[: len(data) // 2])  # truncated
    garbage = tmp_path / "garbage" / name
    garbage.parent.mkdir()
    garbage.write_bytes(b"\x00" * 4096)
    for target in (tmp_path / name, garbage):
        result = subprocess.run(
            [sys.executable, "-m", "whisper_train", "export", "--model", str(target)]
            + ["--output", str(tmp_path / "out"), "--no-check"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 2, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and str(target) in errors[0], result.stderr
        assert "Traceback" not in result.stderr


def _first_tensor_header(path) -> int:
    """The byte offset of the first tensor header of a ggml-model.bin (after the vocabulary)."""
    reader = ggml._Reader(path)
    reader.ints(1 + 11, "i")
    n_mel, n_fft = reader.ints(2)
    reader.take(4 * n_mel * n_fft)
    for _ in range(reader.ints(1)[0]):
        reader.take(reader.ints(1, "I")[0])
    return reader.offset


@pytest.mark.parametrize("field", ["mel filter rows", "tensor name length"])
def test_a_negative_length_in_a_ggml_file_is_one_line_not_a_reader_running_backwards(
    field, tmp_path
):
    from whisper_train.errors import UserError

    model, processor = _shaped_like(**SHAPES["large-v3"])
    save_export(model, processor, tmp_path, format="ggml", quantization="float16")
    path = tmp_path / ggml.GGML_MODEL_FILE
    data = bytearray(path.read_bytes())
    if field == "mel filter rows":  # after the magic and the 11 hyper-parameters
        struct.pack_into("<i", data, 4 + 4 * 11, -1)
    else:
        # Made to step back over this header and its dims: a reader that accepts it reads the
        # same bytes again, or whatever lies behind them.
        header = _first_tensor_header(path)
        n_dims = struct.unpack_from("<i", data, header)[0]
        struct.pack_into("<i", data, header + 4, -(12 + 4 * n_dims))
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"is negative \(-\d+\): the file is damaged"):
        ggml.read_ggml(path)


class _RunsCode:
    """Pickles as a call of os.system: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_model_pt_with_a_pickled_object_that_runs_code_is_refused_in_one_line(tmp_path):
    model, processor = _shaped_like(**SHAPES["large-v3"])
    save_export(model, processor, tmp_path, format="openai", quantization="float16")
    path = tmp_path / openai_whisper.OPENAI_MODEL_FILE
    checkpoint = torch.load(path, weights_only=True)
    marker = tmp_path / "the-pickle-ran"
    torch.save({**checkpoint, "extra": _RunsCode(marker)}, path)
    result = subprocess.run(
        [sys.executable, "-m", "whisper_train", "export", "--model", str(tmp_path)]
        + ["--output", str(tmp_path / "out"), "--no-check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert str(path) in line and "Weights only load failed" in line
    assert "Traceback" not in result.stderr
    assert not marker.exists()


MODEL_PT_DAMAGES = {
    "a dim that is not a number": (lambda c: c["dims"].update(n_mels="80x"), "not a whole number"),
    "heads that do not divide the width": (
        lambda c: c["dims"].update(n_audio_head=7),
        "do not describe a Whisper model",
    ),
    "weights that are a list": (
        lambda c: c.update(model_state_dict=list(c["model_state_dict"].values())),
        "not a mapping of names to tensors",
    ),
}


@pytest.mark.parametrize("damage", list(MODEL_PT_DAMAGES))
def test_a_model_pt_with_wrong_contents_is_one_line(damage, tmp_path):
    from whisper_train.errors import UserError
    from whisper_train.models import load_model

    model, processor = _shaped_like(**SHAPES["large-v3"])
    save_export(model, processor, tmp_path, format="openai", quantization="float16")
    path = tmp_path / openai_whisper.OPENAI_MODEL_FILE
    checkpoint = torch.load(path, weights_only=True)
    change, says = MODEL_PT_DAMAGES[damage]
    change(checkpoint)
    torch.save(checkpoint, path)
    with pytest.raises(UserError, match=says) as caught:
        load_model(str(tmp_path))
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_export_folders_load_with_the_hub_unreachable(tmp_path, monkeypatch):
    """Each folder carries what its runtime needs: no download is even tried."""
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network disabled in this test")

    model, processor = _shaped_like(**SHAPES["large-v3"])
    for format in ("hf", "ct2", "ggml", "openai"):
        quantization = "float32" if format in ("hf", "ct2") else "float16"
        save_export(model, processor, tmp_path / format, format=format, quantization=quantization)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from faster_whisper import WhisperModel

    from whisper_train.models import load_model

    assert (tmp_path / "ct2" / "tokenizer.json").is_file()
    assert (
        WhisperModel(str(tmp_path / "ct2"), device="cpu").feature_extractor.mel_filters.shape[0]
        == 128
    )
    for format in ("hf", "ct2", "ggml", "openai"):
        back, _ = load_model(str(tmp_path / format))
        assert back.config.num_mel_bins == 128
    # The runtimes themselves: openai-whisper's tokenizer (tiktoken files inside the package)
    # and mel filters, whisper.cpp's everything-in-one-file.
    import whisper
    from pywhispercpp.model import Model

    ow = whisper.load_model(
        str(tmp_path / "openai" / openai_whisper.OPENAI_MODEL_FILE), device="cpu"
    )
    audio = torch.zeros(16000)
    mel = whisper.log_mel_spectrogram(whisper.pad_or_trim(audio), n_mels=128)
    whisper.decode(ow, mel, whisper.DecodingOptions(language="en", fp16=False, sample_len=2))
    cpp = Model(str(tmp_path / "ggml" / ggml.GGML_MODEL_FILE), redirect_whispercpp_logs_to=None)
    cpp.transcribe(audio.numpy(), language="en", max_tokens=2, single_segment=True)
    del cpp


@pytest.mark.parametrize(("format", "module", "extra"), [("ggml", "pywhispercpp", "whispercpp")])
def test_missing_client_is_one_line_naming_the_extra_and_no_check_still_exports(
    format, module, extra, tmp_path, monkeypatch
):
    from whisper_train.deploy.export import export_model
    from whisper_train.errors import UserError
    from whisper_train.formats.hf import save_model_folder

    model, processor = _shaped_like(**SHAPES["large-v3"])
    save_model_folder(model, processor, tmp_path / "source")
    monkeypatch.setitem(sys.modules, module, None)  # `import pywhispercpp` raises ImportError
    with pytest.raises(UserError, match=rf"whisper-train\[{extra}\].*--no-check") as error:
        export_model(str(tmp_path / "source"), format=format, output=tmp_path / "checked")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "checked").exists()  # refused before any work
    result = export_model(
        str(tmp_path / "source"), format=format, output=tmp_path / "unchecked", check=False
    )
    assert result.parity is None and (tmp_path / "unchecked" / ggml.GGML_MODEL_FILE).is_file()


def test_missing_openai_whisper_names_its_extra(monkeypatch):
    from whisper_train.formats.registry import export_format
    from whisper_train.formats.runtimes import MissingRuntimeError

    monkeypatch.setitem(sys.modules, "whisper", None)
    with pytest.raises(MissingRuntimeError, match=r"whisper-train\[openai\]"):
        export_format("openai").require_client()


def test_a_float32_ggml_export_needs_no_check_because_whisper_cpp_aborts_on_it(tmp_path):
    from whisper_train.deploy.export import export_model
    from whisper_train.errors import UserError
    from whisper_train.formats.hf import save_model_folder

    model, processor = _shaped_like(**SHAPES["large-v3"])
    save_model_folder(model, processor, tmp_path / "source")
    with pytest.raises(UserError, match="--no-check"):
        export_model(
            str(tmp_path / "source"), format="ggml", quantization="float32", output=tmp_path / "a"
        )
    export_model(
        str(tmp_path / "source"),
        format="ggml",
        quantization="float32",
        output=tmp_path / "b",
        check=False,
    )
    assert (
        struct.unpack("<I11i", (tmp_path / "b" / ggml.GGML_MODEL_FILE).read_bytes()[:48])[-1] == 0
    )


# -- the export check on deliberately broken exports -----------------------------------------
#
# A random model with weights drawn at std 0.1 (not the 0.02 of initialisation) is confident
# enough that a wrong tensor moves its log-probabilities (a 0.02 model is nearly uniform), yet
# tame enough for whisper.cpp's float16 arithmetic: measured 0.015 nats mean |Δ log p| intact
# (allowed 0.02), 1.2 with one transposed 64 x 64 weight.


def _confident(seed: int = 0):
    model, processor = _shaped_like(**SHAPES["large-v3"])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() >= 2 and "embed_positions" not in name:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    model.generation_config.max_length = 12  # greedy writes ~10 tokens of nonsense: enough
    return model, processor


@pytest.fixture(scope="module")
def confident_source():
    model, processor = _confident()
    return model, processor, score_source(model, processor, check_clips(None, n_clips=2), None)


def _transposed(model, processor, output):  # a converter that wrote [in, out] as [out, in]
    weight = model.model.encoder.layers[0].self_attn.out_proj.weight
    with torch.no_grad():
        weight.copy_(weight.T.clone())


def _cross_k_v_swapped(model, processor, output):  # a fused k|v split the wrong way round
    with torch.no_grad():
        for layer in model.model.decoder.layers:
            k = layer.encoder_attn.k_proj.weight.clone()
            layer.encoder_attn.k_proj.weight.copy_(layer.encoder_attn.v_proj.weight)
            layer.encoder_attn.v_proj.weight.copy_(k)


def _ggml_vocabulary_shifted(model, processor, output):  # token i spelled as token i + 1
    path = output / ggml.GGML_MODEL_FILE
    data = path.read_bytes()
    start = 4 + 11 * 4 + 8 + 4 * model.config.num_mel_bins * ggml.N_FFT_BINS
    (count,) = struct.unpack("<i", data[start : start + 4])
    offset, tokens = start + 4, []
    for _ in range(count):
        (length,) = struct.unpack("<I", data[offset : offset + 4])
        tokens.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    body = b"".join(struct.pack("<I", len(t)) + t for t in tokens[1:] + tokens[:1])
    path.write_bytes(data[: start + 4] + body + data[offset:])


def _ggml_text_context_225(model, processor, output):  # generation's max_length (#2730)
    path = output / ggml.GGML_MODEL_FILE
    data = bytearray(path.read_bytes())
    data[4 + 5 * 4 : 4 + 6 * 4] = struct.pack("<i", 225)  # n_text_ctx, the 6th header int
    path.write_bytes(bytes(data))


def _ct2_tokenizer_shifted(model, processor, output):
    import json

    path = output / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    tokenizer["model"]["vocab"] = {token: (i + 1) % len(vocab) for token, i in vocab.items()}
    path.write_text(json.dumps(tokenizer), encoding="utf-8")


def _ct2_80_mel_bins(model, processor, output):  # a preprocessor_config.json for another model
    import json

    path = output / "preprocessor_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["feature_size"] = 80
    path.write_text(json.dumps(config), encoding="utf-8")


@pytest.mark.speech
@pytest.mark.parametrize(
    ("format", "quantization", "breakage", "finding"),
    [
        ("ct2", "float32", None, None),
        ("ct2", "int8", None, None),
        ("ct2", "float16", _transposed, "deviation"),
        ("ct2", "int8", _cross_k_v_swapped, "deviation"),
        ("ct2", "float16", _ct2_tokenizer_shifted, "spelling"),
        ("ct2", "float16", _ct2_80_mel_bins, "runtime"),
        ("ggml", "float16", None, None),
        ("ggml", "float16", _transposed, "deviation"),
        ("ggml", "float16", _cross_k_v_swapped, "deviation"),
        ("ggml", "float16", _ggml_vocabulary_shifted, "spelling"),
        ("ggml", "float16", _ggml_text_context_225, "runtime"),
        ("openai", "float16", None, None),
        ("openai", "float16", _transposed, "deviation"),
        ("openai", "float16", _cross_k_v_swapped, "deviation"),
    ],
    ids=lambda value: getattr(value, "__name__", value),
)
@pytest.mark.long
def test_the_check_passes_intact_exports_and_fails_broken_ones(
    confident_source, format, quantization, breakage, finding, tmp_path
):
    import copy

    model, processor, source = confident_source
    exported = copy.deepcopy(model)
    if breakage in (_transposed, _cross_k_v_swapped):
        breakage(exported, processor, tmp_path)
    save_export(exported, processor, tmp_path, format=format, quantization=quantization)
    if breakage not in (None, _transposed, _cross_k_v_swapped):
        breakage(model, processor, tmp_path)

    check = check_export(source, format, tmp_path, quantization, greedy=False)

    if finding is None:
        assert check.passed, check.summary()
        return
    assert not check.passed
    if finding == "runtime":
        assert check.runtime_error, check.summary()
    elif finding == "spelling":
        assert check.misspelled and check.deviation <= check.tolerance, check.summary()
    else:
        assert check.deviation > 2 * check.tolerance, check.summary()
