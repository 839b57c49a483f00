"""CTranslate2 round trips: HF Whisper -> save_ct2 -> load_ct2_whisper gives the same model back.

Every weight of the source model is perturbed first: a fresh model has zero biases and unit
layer norms, which the converter stores once and aliases, so a mix-up between them (or a
swapped q/k/v slice) would otherwise go unnoticed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ctranslate2
import numpy as np
import pytest
import torch
from tiny_models import EOT, NO_TIMESTAMPS, SOT, make_tiny_whisper, tiny_en_dir
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizerFast,
)
from transformers.models.whisper.tokenization_whisper import LANGUAGES

from whisper_train.errors import UserError
from whisper_train.formats.ct2 import is_ct2_model_dir, load_ct2_whisper, read_ct2_variables
from whisper_train.formats.ct2_convert import save_ct2

# float16 keeps 11 significant bits: rounding moves a value by at most half a unit in the last
# place, 2**-11 relative; below the normal range (6.1e-5) the step is 2**-24 absolute.
FP16_RTOL = 2.0**-11
FP16_ATOL = 2.0**-24


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Give every weight (biases, layer norms, sinusoids included) distinct random values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.add_(0.02 * noise)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float() for name, tensor in model.state_dict().items()}


def _logits(model, features: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_features=features, decoder_input_ids=decoder_ids).logits


@pytest.fixture(scope="module")
def english_round_trip(tmp_path_factory) -> tuple[WhisperForConditionalGeneration, Path]:
    """(perturbed tiny English model, its float16 CTranslate2 folder)."""
    root = tmp_path_factory.mktemp("ct2-english")
    model, processor = make_tiny_whisper()
    _perturb(model, seed=1)
    model.save_pretrained(root / "hf")
    processor.save_pretrained(root / "hf")
    save_ct2(root / "hf", root / "ct2", quantization="float16")
    return model, root / "ct2"


def test_float16_round_trip_gives_every_tensor_back(english_round_trip):
    source, ct2_dir = english_round_trip
    loaded, _ = load_ct2_whisper(ct2_dir)

    source_state, loaded_state = _state(source), _state(loaded)
    assert loaded_state.keys() == source_state.keys()
    for name, expected in source_state.items():
        torch.testing.assert_close(
            loaded_state[name], expected, rtol=FP16_RTOL, atol=FP16_ATOL, msg=name
        )
    # The encoder's positions are the stored encodings, exactly (no recomputed sinusoids).
    stored = read_ct2_variables(ct2_dir)["encoder/position_encodings/encodings"]
    assert torch.equal(loaded.model.encoder.embed_positions.weight, stored.float())
    assert loaded.proj_out.weight.data_ptr() == loaded.model.decoder.embed_tokens.weight.data_ptr()


def test_float16_round_trip_gives_the_same_logits(english_round_trip):
    source, ct2_dir = english_round_trip
    loaded, _ = load_ct2_whisper(ct2_dir)
    # The reference is the source with its weights rounded to float16 as the converter does,
    # so only a wrong mapping (not rounding) can move the logits; 1e-4 is float32 summation noise.
    reference = make_tiny_whisper()[0]
    reference.load_state_dict({k: v.half().float() for k, v in source.state_dict().items()})
    features = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(0))
    decoder_ids = torch.tensor([[SOT, NO_TIMESTAMPS, 464, 2068, 7586, 21831]])

    torch.testing.assert_close(
        _logits(loaded, features, decoder_ids),
        _logits(reference, features, decoder_ids),
        rtol=1e-4,
        atol=1e-4,
    )


def test_half_precision_load_gives_independent_parameters(english_round_trip):
    _, ct2_dir = english_round_trip
    loaded, _ = load_ct2_whisper(ct2_dir, dtype=torch.float16)
    parameters = dict(loaded.named_parameters())  # the tied proj_out is listed once
    assert {p.dtype for p in parameters.values()} == {torch.float16}
    # Stored aliases and the q/k/v slices of one fused weight must not share memory.
    storages = {p.untyped_storage().data_ptr() for p in parameters.values()}
    assert len(storages) == len(parameters)


def test_loaded_processor_and_generation_settings_match_the_english_model(english_round_trip):
    _, ct2_dir = english_round_trip
    # faster-whisper reads these two beside model.bin; save_ct2 must provide them.
    assert (ct2_dir / "tokenizer.json").is_file()
    assert json.loads((ct2_dir / "preprocessor_config.json").read_text())["feature_size"] == 80

    model, processor = load_ct2_whisper(ct2_dir)
    tokenizer = processor.tokenizer
    assert len(tokenizer) == model.config.vocab_size == 51864
    # Timestamp tokens follow <|notimestamps|> and decode back to their text.
    assert tokenizer.convert_tokens_to_ids(["<|0.00|>", "<|30.00|>"]) == [50363, 51863]
    assert tokenizer.decode([50363 + 50], decode_with_timestamps=True) == "<|1.00|>"
    assert processor.feature_extractor.feature_size == 80
    generation = model.generation_config
    assert (generation.decoder_start_token_id, generation.eos_token_id) == (SOT, EOT)
    assert generation.no_timestamps_token_id == NO_TIMESTAMPS
    assert generation.is_multilingual is False
    assert generation.begin_suppress_tokens == [220, EOT]


def test_int8_weights_are_dequantised_within_one_quantisation_step(tmp_path):
    source, processor = make_tiny_whisper(seed=3)
    _perturb(source, seed=3)
    source.save_pretrained(tmp_path / "hf")
    processor.save_pretrained(tmp_path / "hf")
    save_ct2(tmp_path / "hf", tmp_path / "ct2", quantization="int8")
    loaded, _ = load_ct2_whisper(tmp_path / "ct2")

    weight = source.model.decoder.layers[0].fc1.weight.detach()
    restored = loaded.model.decoder.layers[0].fc1.weight.detach()
    # int8 rounds each row to multiples of max|row| / 127: error at most half of that.
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((restored - weight).abs() <= 0.5 * step + 1e-6).all()
    assert not torch.equal(restored, weight)  # it really was quantised


def _multilingual_tokenizer_file(path: Path, n_languages: int) -> Path:
    """tiny.en's tokenizer.json reshaped like a multilingual Whisper tokenizer.

    Multilingual Whisper has one more text token than GPT-2 (<|endoftext|> is 50257, not
    50256), <|nospeech|> instead of <|nocaptions|>, and 99 (large-v3: 100) language tokens.
    The text tokens stay English, which is all these tests need.
    """
    data = json.loads((tiny_en_dir() / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    del vocab["<|endoftext|>"]
    vocab["<|filler|>"] = 50256
    specials = [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *[f"<|{code}|>" for code in list(LANGUAGES)[:n_languages]],
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
    ]
    template = data["added_tokens"][0]
    data["added_tokens"] = [
        {**template, "id": 50257 + i, "content": token} for i, token in enumerate(specials)
    ]
    ids = {token["content"]: token["id"] for token in data["added_tokens"]}
    for name, entry in data["post_processor"]["special_tokens"].items():
        entry["ids"] = [ids[name]]
    path.write_text(json.dumps(data))
    return path


def test_multilingual_large_v3_shape_round_trips_with_languages(tmp_path):
    # large-v3's shape: 128 mel bins, 100 languages, vocabulary 51866.
    tokenizer = WhisperTokenizerFast(
        tokenizer_file=str(_multilingual_tokenizer_file(tmp_path / "tok.json", 100)),
        pad_token="<|endoftext|>",
    )
    sot, eot = 50258, 50257
    config = WhisperConfig(
        vocab_size=51866,
        num_mel_bins=128,
        d_model=64,
        encoder_layers=1,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=96,
        decoder_ffn_dim=160,
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
    )
    torch.manual_seed(0)
    source = WhisperForConditionalGeneration(config)
    _perturb(source, seed=5)
    # No lang_to_id: save_ct2 must still write the language ids faster-whisper detects with.
    source.generation_config = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eot, pad_token_id=eot, alignment_heads=[[1, 0]]
    )
    processor = WhisperProcessor(WhisperFeatureExtractor(feature_size=128), tokenizer)
    source.save_pretrained(tmp_path / "hf")
    processor.save_pretrained(tmp_path / "hf")

    save_ct2(tmp_path / "hf", tmp_path / "ct2", quantization="float16")
    ct2_config = json.loads((tmp_path / "ct2" / "config.json").read_text())
    assert ct2_config["lang_ids"] == list(range(50259, 50359))
    loaded, loaded_processor = load_ct2_whisper(tmp_path / "ct2")

    assert loaded.config.num_mel_bins == loaded_processor.feature_extractor.feature_size == 128
    assert (loaded.config.encoder_ffn_dim, loaded.config.decoder_ffn_dim) == (96, 160)
    assert loaded.config.decoder_attention_heads == 2
    source_state, loaded_state = _state(source), _state(loaded)
    assert loaded_state.keys() == source_state.keys()
    for name, expected in source_state.items():
        torch.testing.assert_close(
            loaded_state[name], expected, rtol=FP16_RTOL, atol=FP16_ATOL, msg=name
        )
    generation = loaded.generation_config
    assert generation.is_multilingual is True
    assert generation.lang_to_id["<|en|>"] == 50259
    assert generation.lang_to_id["<|yue|>"] == 50358
    assert generation.task_to_id == {"transcribe": 50360, "translate": 50359}
    assert generation.no_timestamps_token_id == 50364
    assert loaded_processor.tokenizer.convert_tokens_to_ids("<|0.00|>") == 50365
    assert generation.alignment_heads == [[1, 0]]
    # No language (each clip's is detected) but a task: without it, transformers' detection
    # leaves <|transcribe|> out of the prompt and a multilingual model loops.
    assert getattr(generation, "language", None) is None and generation.task == "transcribe"
    with torch.no_grad():
        prompted = loaded.generate(
            torch.zeros(1, 128, 3000), max_length=8, return_dict_in_generate=True
        ).sequences[0, :4]
    assert prompted[0] == sot and 50259 <= prompted[1] <= 50358  # a detected language
    assert prompted[2:].tolist() == [50360, 50364]  # <|transcribe|> <|notimestamps|>

    # CTranslate2 itself runs the folder from a multilingual prompt (SOT, <|en|>, transcribe).
    ct2_model = ctranslate2.models.Whisper(str(tmp_path / "ct2"), device="cpu")
    assert ct2_model.n_mels == 128
    features = ctranslate2.StorageView.from_array(np.zeros((1, 128, 3000), dtype=np.float32))
    prompt = [sot, 50259, 50360, 50364]
    assert len(ct2_model.generate(features, [prompt], max_length=8)[0].sequences_ids[0]) > 0


def test_the_real_tiny_en_folder_is_recognised_and_read():
    assert is_ct2_model_dir(tiny_en_dir())
    model, processor = load_ct2_whisper(tiny_en_dir())
    config = model.config
    assert (config.d_model, config.encoder_layers, config.decoder_layers) == (384, 4, 4)
    assert (config.encoder_attention_heads, config.encoder_ffn_dim) == (6, 1536)
    assert len(processor.tokenizer) == config.vocab_size == 51864
    assert len(model.generation_config.suppress_tokens) == 90


def test_a_folder_that_is_not_ctranslate2_gives_a_user_error(tiny_whisper_dir, tmp_path):
    assert not is_ct2_model_dir(tiny_whisper_dir)
    with pytest.raises(UserError, match="not a CTranslate2 model folder"):
        load_ct2_whisper(tiny_whisper_dir)
    with pytest.raises(UserError, match="not a CTranslate2 model folder"):
        load_ct2_whisper(tmp_path / "missing")


def test_a_truncated_model_file_gives_a_user_error(english_round_trip, tmp_path):
    _, ct2_dir = english_round_trip
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (broken / name).write_bytes((ct2_dir / name).read_bytes())
    data = (ct2_dir / "model.bin").read_bytes()
    (broken / "model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated"):
        load_ct2_whisper(broken)


def test_a_folder_without_tokenizer_gives_a_user_error(english_round_trip, tmp_path):
    _, ct2_dir = english_round_trip
    for name in ("config.json", "model.bin"):
        (tmp_path / name).symlink_to(ct2_dir / name)
    with pytest.raises(UserError, match=r"no tokenizer\.json"):
        load_ct2_whisper(tmp_path)


def test_save_ct2_refuses_bad_inputs(tiny_whisper_dir, tmp_path):
    with pytest.raises(UserError, match="unknown quantization"):
        save_ct2(tiny_whisper_dir, tmp_path / "out", quantization="int3")
    with pytest.raises(UserError, match="no config.json"):
        save_ct2(tmp_path, tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("user data")
    with pytest.raises(UserError, match="not empty"):
        save_ct2(tiny_whisper_dir, tmp_path / "full")


# -- crafted or damaged model.bin: one line, checked against the file's size before reading --


def _ct2_string(text: str) -> bytes:
    encoded = text.encode() + b"\0"
    return struct.pack("<H", len(encoded)) + encoded


def _crafted_folder(folder: Path, *, version: int, shape: tuple[int, ...], n_bytes: int) -> Path:
    """A CTranslate2 folder whose model.bin holds one float32 variable with the given shape and
    byte count, followed by that many bytes of data only when the count is small."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_bytes((tiny_en_dir() / "tokenizer.json").read_bytes())
    body = struct.pack("<I", version) + _ct2_string("WhisperSpec") + struct.pack("<I", 1)
    body += struct.pack("<I", 1) + _ct2_string("encoder/conv1/weight")
    body += struct.pack(f"<B{len(shape)}I", len(shape), *shape) + struct.pack("<B", 0)
    body += struct.pack("<I", n_bytes) + bytes(min(n_bytes, 64))
    (folder / "model.bin").write_bytes(body + struct.pack("<I", 0))
    return folder


CRAFTED = {
    # 2^16 x 2^16 x 2^16 float32: 1 PiB asked for, nothing stored
    "dims asking for a petabyte": ((2**16, 2**16, 2**16), 0, "needs 1125899906842624 bytes"),
    # shape and count agree (4 GiB - 4), the file holds 64 bytes of it
    "a byte count past the end": ((2**30 - 1,), 2**32 - 4, "is truncated"),
    "another format version": ((4,), 16, "format version 7"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_model_bin_is_one_line_and_allocates_nothing(case, tmp_path):
    from whisper_train.models import load_model

    shape, n_bytes, says = CRAFTED[case]
    version = 7 if "version" in case else 6
    folder = _crafted_folder(tmp_path / "ct2", version=version, shape=shape, n_bytes=n_bytes)
    with pytest.raises(UserError) as caught:
        load_model(str(folder))
    message = str(caught.value)
    assert str(folder / "model.bin") in message and says in message
    assert "\n" not in message
