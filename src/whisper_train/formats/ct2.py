"""Read and write CTranslate2 (faster-whisper) Whisper models.

Reading: `load_ct2_whisper(folder)` parses `model.bin` itself (CTranslate2 binary format
version 6, spec `WhisperSpec`) and rebuilds a Hugging Face `WhisperForConditionalGeneration`,
so a faster-whisper folder can be fine-tuned without the model hub. Writing is `ct2_convert`'s.

`model.bin` layout (little-endian): u32 version; string spec name; u32 spec revision; u32 number
of variables, then per variable: string name, u8 rank, u32 dims[rank], u8 dtype id, u32 byte
count, raw bytes; then u32 number of aliases and (alias, target) string pairs. A string is a u16
length that counts a trailing NUL, then the bytes and the NUL. The converter stores identical
tensors once and points the others at it through aliases (all zero biases of a fresh model
become one tensor), so aliases must be resolved before anything is looked up by name.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import BinaryIO

import torch
from tokenizers import AddedToken
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
    WhisperProcessor,
    WhisperTokenizerFast,
)

from whisper_train.data.labels import MAX_DECODER_TOKENS, N_TIME_TOKENS, TIME_PRECISION
from whisper_train.errors import UserError

CT2_MODEL_FILE = "model.bin"
MODEL_CONFIG = "config.json"
TOKENIZER_FILE = "tokenizer.json"
# faster-whisper reads the log-mel settings (n_mels, chunk length) from this file.
PREPROCESSOR_FILE = "preprocessor_config.json"

SUPPORTED_BINARY_VERSION = 6
WHISPER_SPEC = "WhisperSpec"
_DTYPES = {
    0: torch.float32,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.float16,
    5: torch.bfloat16,
}
# CTranslate2's activation enum: 3 is exact GELU, the only one Whisper uses.
_GELU = 3
QUANTIZATIONS = (
    "float32",
    "float16",
    "bfloat16",
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
)

# Multilingual checkpoints have 51865 (or, from large-v3, 51866) tokens; English-only 51864.
MULTILINGUAL_MIN_VOCAB = 51865
# The vocabulary CTranslate2's converter writes beside model.bin (one token a line, or a list).
VOCABULARY_FILES = ("vocabulary.json", "vocabulary.txt")
# What every Whisper model.bin holds (`load_ct2_whisper` reads its shape and heads from them).
_REQUIRED_VARIABLES = (
    "encoder/conv1/weight",
    "encoder/num_heads",
    "decoder/num_heads",
    "decoder/activation",
    "decoder/embeddings/weight",
)
# Timestamps may start at most 1.0 s (50 steps of 20 ms) into the window, as in openai/whisper.
MAX_INITIAL_TIMESTAMP_INDEX = 50


def is_multilingual_vocab(vocab_size: int) -> bool:
    """What a vocabulary's size says where nothing declares it (English-only: 51864 tokens)."""
    return vocab_size >= MULTILINGUAL_MIN_VOCAB


def is_ct2_model_dir(path: str | Path) -> bool:
    """True when `path` is a folder holding a CTranslate2 model (`model.bin` + `config.json`)."""
    path = Path(path)
    return (path / CT2_MODEL_FILE).is_file() and (path / MODEL_CONFIG).is_file()


def vocabulary_size(model_dir: str | Path) -> int | None:
    """Tokens in the folder's vocabulary file (the model's vocabulary size: its embedding rows),
    without reading model.bin; None when the folder has no vocabulary file."""
    for name in VOCABULARY_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            if name.endswith(".json"):
                return len(json.loads(text))
            return len(text.rstrip("\n").split("\n"))
    return None


# --------------------------------------------------------------------------------------------
# Reading model.bin


class _BinaryReader:
    """Reads the little-endian primitives of `model.bin` from a file, in order.

    Every length the file states is checked against the bytes the file still holds before
    anything is read or allocated: a damaged or crafted count (a u32 asking for 4 GiB, dims
    whose product is a petabyte) is one line, never a MemoryError.
    """

    def __init__(self, stream: BinaryIO, path: Path):
        self.stream = stream
        self.path = path
        self.size = path.stat().st_size

    def damaged(self, what: str) -> UserError:
        return UserError(
            f"{self.path} is damaged ({what}, at byte {self.stream.tell()} of {self.size}): "
            "download or convert the model again"
        )

    def _unpack(self, fmt: str) -> int:
        return struct.unpack(fmt, self.raw(struct.calcsize(fmt)))[0]

    def u8(self) -> int:
        return self._unpack("<B")

    def u16(self) -> int:
        return self._unpack("<H")

    def u32(self) -> int:
        return self._unpack("<I")

    def string(self) -> str:
        length = self.u16()  # counts the trailing NUL
        try:
            return self.raw(length)[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.damaged("a name that is not UTF-8") from None

    def raw(self, n_bytes: int) -> bytearray:
        if n_bytes > self.size - self.stream.tell():
            raise UserError(
                f"{self.path} is truncated ({self.size} bytes; byte {self.stream.tell()} "
                f"announces {n_bytes} more): download or convert the model again"
            )
        # A fresh bytearray is writable, so torch.frombuffer can wrap it without a copy.
        return bytearray(self.stream.read(n_bytes))

    def skip(self, n_bytes: int) -> None:
        """Step over `n_bytes` that are there (checked as `raw` checks), reading none."""
        if n_bytes > self.size - self.stream.tell():
            self.raw(n_bytes)  # its one line: truncated
        self.stream.seek(n_bytes, 1)


def read_ct2_variables(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every variable of `model_dir/model.bin` by name, aliases resolved, in its stored dtype.

    Scalars (e.g. `encoder/num_heads`) are 0-d tensors. int8 weights come back as int8 with
    their `<name>_scale` beside them; `dequantize` turns them into floats.
    """
    variables = _read_model_bin(Path(model_dir), keep=True)
    return {name: tensor for name, tensor in variables.items() if tensor is not None}


def check_ct2_folder(model_dir: str | Path) -> None:
    """Refuse, in one line naming the file, a CTranslate2 folder that `read_ct2_variables` or
    `load_ct2_whisper` would refuse for its files' form, without reading the weights (every
    header of model.bin walked, the data stepped over): what `transcribe` asks before
    faster-whisper, which trusts the file's counts, is handed the folder."""
    model_dir = Path(model_dir)
    names = _read_model_bin(model_dir, keep=False)
    missing = [name for name in _REQUIRED_VARIABLES if name not in names]
    if missing:
        raise UserError(
            f"{model_dir / CT2_MODEL_FILE} has no {missing[0]}: this is not a Whisper model "
            "from ctranslate2; download or convert the model again"
        )
    _read_config(model_dir / MODEL_CONFIG)
    tokenizer_file = model_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        # faster-whisper would fetch openai/whisper-tiny's tokenizer from the hub instead.
        raise UserError(
            f"--model {model_dir}: a CTranslate2 folder needs its {TOKENIZER_FILE} beside "
            f"{CT2_MODEL_FILE} (`whisper-train export --format ct2` writes one)"
        )
    try:
        json.loads(tokenizer_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(
            f"{tokenizer_file} is not JSON: copy the tokenizer.json of the original Whisper "
            "model into it"
        ) from None


def weight_dtypes(model_dir: str | Path) -> set[torch.dtype]:
    """The dtypes model.bin stores its weights and biases in (headers read, data skipped)."""
    variables = _read_model_bin(Path(model_dir), keep=False)
    return {t.dtype for name, t in variables.items() if name.endswith(("weight", "bias"))}


def _read_model_bin(model_dir: Path, *, keep: bool) -> dict[str, torch.Tensor | None]:
    """model.bin's variables by name, aliases resolved; when not `keep`ing the data, an empty
    tensor of each one's dtype (then only the headers are read, and every count checked
    against the file)."""
    path = model_dir / CT2_MODEL_FILE
    if not is_ct2_model_dir(model_dir):
        raise UserError(
            f"{model_dir} is not a CTranslate2 model folder (needs {CT2_MODEL_FILE} and "
            f"{MODEL_CONFIG}): pass a faster-whisper/CTranslate2 model folder"
        )
    variables: dict[str, torch.Tensor | None] = {}
    with path.open("rb") as stream:
        reader = _BinaryReader(stream, path)
        version = reader.u32()
        if version != SUPPORTED_BINARY_VERSION:
            raise UserError(
                f"{path} has CTranslate2 format version {version}, this reader knows version "
                f"{SUPPORTED_BINARY_VERSION}: convert the model again with ctranslate2>=4"
            )
        spec_name = reader.string()
        if spec_name != WHISPER_SPEC:
            raise UserError(f"{path} holds a CTranslate2 {spec_name}, not a Whisper model")
        reader.u32()  # spec revision: nothing in the Whisper layout depends on it
        for _ in range(reader.u32()):
            name = reader.string()
            shape = [reader.u32() for _ in range(reader.u8())]
            dtype_id = reader.u8()
            if dtype_id not in _DTYPES:
                raise UserError(f"{path}: variable {name} has unknown dtype id {dtype_id}")
            dtype = _DTYPES[dtype_id]
            n_bytes = reader.u32()
            # Python integers: a crafted shape cannot overflow, and nothing is allocated for it.
            needed = math.prod(shape) * dtype.itemsize
            if n_bytes != needed:
                raise reader.damaged(
                    f"variable {name} of shape {shape} needs {needed} bytes but stores {n_bytes}"
                )
            if not keep:
                reader.skip(n_bytes)
                variables[name] = torch.empty(0, dtype=dtype)
                continue
            data = reader.raw(n_bytes)
            if data:
                tensor = torch.frombuffer(data, dtype=dtype).reshape(shape)
            else:  # a zero-sized shape
                tensor = torch.empty(shape, dtype=dtype)
            variables[name] = tensor
        for _ in range(reader.u32()):
            alias, target = reader.string(), reader.string()
            if target not in variables:
                raise reader.damaged(f"alias {alias} names no variable ({target})")
            variables[alias] = variables[target]
            # An alias of a quantised weight shares its scale too.
            if f"{target}_scale" in variables:
                variables[f"{alias}_scale"] = variables[f"{target}_scale"]
    return variables


def dequantize(variables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Floating-point copies of the weights, int8 ones rescaled; `*_scale` entries dropped.

    CTranslate2 quantises a weight row by row: `q = round(w * scale)` with
    `scale = 127 / max|w_row|`, so `w ≈ q / scale`. Shapes are unchanged.
    """
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in variables.items():
        if name.endswith("_scale") and name[: -len("_scale")] in variables:
            continue
        if tensor.dtype == torch.int8 and tensor.dim() > 0:
            scale = variables.get(f"{name}_scale")
            if scale is None:
                raise UserError(f"int8 weight {name} has no {name}_scale: the model is damaged")
            row_scale = scale.float().reshape(-1, *([1] * (tensor.dim() - 1)))
            tensor = tensor.float() / row_scale
        elif tensor.dtype == torch.int16 and tensor.dim() > 0:
            raise UserError(
                f"{name} is int16-quantised, which this reader does not undo: convert the "
                f"original model with --quantization float16 (or int8) instead"
            )
        weights[name] = tensor
    return weights


# --------------------------------------------------------------------------------------------
# CTranslate2 names -> Hugging Face names


def _count_layers(weights: dict[str, torch.Tensor], stack: str) -> int:
    pattern = re.compile(rf"^{stack}/layer_(\d+)/")
    indices = {int(match.group(1)) for name in weights if (match := pattern.match(name))}
    if indices != set(range(len(indices))):
        raise UserError(f"{stack} layers {sorted(indices)} are not numbered 0..N-1")
    return len(indices)


def _scalar(weights: dict[str, torch.Tensor], name: str) -> int:
    if name not in weights or weights[name].numel() != 1:
        raise UserError(f"model.bin has no {name}: this is not a Whisper model from ctranslate2")
    return int(weights[name].item())


def _hf_state_dict(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and split CTranslate2 Whisper weights into HF `WhisperForConditionalGeneration` keys.

    Self-attention q, k and v are fused along dim 0 ([3d, d] and [3d]); cross-attention keeps q
    apart and fuses k and v ([2d, d]). Whisper's k projections have no bias, so their slot in a
    fused bias (zeros, written by the converter) is dropped.
    """
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise UserError(
                f"model.bin has no {name}: it is damaged or not a Whisper model from ctranslate2"
            )
        used.add(name)
        return weights[name]

    def linear(hf: str, ct2: str, *, bias: bool = True) -> None:
        state[f"{hf}.weight"] = take(f"{ct2}/weight")
        if bias:
            state[f"{hf}.bias"] = take(f"{ct2}/bias")

    def layer_norm(hf: str, ct2: str) -> None:
        state[f"{hf}.weight"] = take(f"{ct2}/gamma")
        state[f"{hf}.bias"] = take(f"{ct2}/beta")

    def fused(hf_prefix: str, ct2: str, parts: tuple[str, ...]) -> None:
        for part, weight in zip(parts, take(f"{ct2}/weight").chunk(len(parts), dim=0), strict=True):
            state[f"{hf_prefix}.{part}_proj.weight"] = weight
        for part, bias in zip(parts, take(f"{ct2}/bias").chunk(len(parts), dim=0), strict=True):
            if part != "k":
                state[f"{hf_prefix}.{part}_proj.bias"] = bias

    def common_layer(hf: str, ct2: str) -> None:
        fused(f"{hf}.self_attn", f"{ct2}/self_attention/linear_0", ("q", "k", "v"))
        linear(f"{hf}.self_attn.out_proj", f"{ct2}/self_attention/linear_1")
        layer_norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
        linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
        linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
        layer_norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")

    linear("model.encoder.conv1", "encoder/conv1")
    linear("model.encoder.conv2", "encoder/conv2")
    state["model.encoder.embed_positions.weight"] = take("encoder/position_encodings/encodings")
    layer_norm("model.encoder.layer_norm", "encoder/layer_norm")
    for i in range(_count_layers(weights, "encoder")):
        common_layer(f"model.encoder.layers.{i}", f"encoder/layer_{i}")

    state["model.decoder.embed_tokens.weight"] = take("decoder/embeddings/weight")
    state["model.decoder.embed_positions.weight"] = take("decoder/position_encodings/encodings")
    layer_norm("model.decoder.layer_norm", "decoder/layer_norm")
    for i in range(_count_layers(weights, "decoder")):
        hf, ct2 = f"model.decoder.layers.{i}", f"decoder/layer_{i}"
        common_layer(hf, ct2)
        linear(f"{hf}.encoder_attn.q_proj", f"{ct2}/attention/linear_0")
        fused(f"{hf}.encoder_attn", f"{ct2}/attention/linear_1", ("k", "v"))
        linear(f"{hf}.encoder_attn.out_proj", f"{ct2}/attention/linear_2")
        layer_norm(f"{hf}.encoder_attn_layer_norm", f"{ct2}/attention/layer_norm")
    # The output projection is the token embedding (an alias in model.bin, tied in HF).
    state["proj_out.weight"] = take("decoder/projection/weight")

    unmapped = sorted(name for name, t in weights.items() if t.dim() > 0 and name not in used)
    if unmapped:
        raise UserError(
            f"model.bin has weights this reader does not know ({', '.join(unmapped[:3])}, ...): "
            f"it is not a standard Whisper model"
        )
    return state


# --------------------------------------------------------------------------------------------
# Tokenizer, feature extractor and generation settings


def _timestamp_tokens() -> list[str]:
    # Whisper timestamps: <|0.00|> .. <|30.00|> in 20 ms steps, right after <|notimestamps|>.
    return [f"<|{i * TIME_PRECISION:.2f}|>" for i in range(N_TIME_TOKENS)]


def load_tokenizer(model_dir: Path, vocab_size: int) -> WhisperTokenizerFast:
    """The folder's tokenizer.json, with timestamp tokens appended when it lacks them.

    OpenAI's tokenizer.json (as faster-whisper ships it) stops at <|notimestamps|>, while the
    model's vocabulary continues with 1501 timestamp tokens; without them HF could neither
    decode nor encode timestamps and ids would not cover the embedding. They are added as
    non-special tokens because transformers finds the first timestamp id as "last special id + 1".
    """
    tokenizer_file = model_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise UserError(
            f"{model_dir} has no {TOKENIZER_FILE}: copy the tokenizer.json of the original "
            f"Whisper model into it"
        )
    try:
        tokenizer = WhisperTokenizerFast(
            tokenizer_file=str(tokenizer_file), pad_token="<|endoftext|>"
        )
    except Exception as exc:  # the tokenizers library raises a bare Exception on a bad file
        raise UserError(
            f"{tokenizer_file} cannot be read ({type(exc).__name__}: "
            f"{str(exc).strip()[:120]}); copy the tokenizer.json of the original Whisper model "
            "into it"
        ) from None
    # A bare tokenizer.json marks <|...|> tokens special but does not register them as the
    # tokenizer's special tokens (the hub's tokenizer_config.json does). Without that,
    # transformers takes <|endoftext|> + 1 as the first timestamp and decodes times wrongly.
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                token.content
                for _, token in sorted(tokenizer.added_tokens_decoder.items())
                if token.special
            ]
        }
    )
    if len(tokenizer) < vocab_size and tokenizer.convert_tokens_to_ids("<|0.00|>") in (
        None,
        tokenizer.unk_token_id,
    ):
        tokenizer.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t in _timestamp_tokens()]
        )
    if len(tokenizer) != vocab_size:
        raise UserError(
            f"{tokenizer_file} has {len(tokenizer)} tokens but the model's vocabulary has "
            f"{vocab_size}: use the tokenizer.json that belongs to this model"
        )
    return tokenizer


def language_token_ids(tokenizer: WhisperTokenizerFast) -> list[int]:
    """Ids of the language tokens (<|en|>, <|zh|>, ...), which sit between SOT and <|translate|>."""
    sot = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    translate = tokenizer.convert_tokens_to_ids("<|translate|>")
    return list(range(sot + 1, translate))


def _generation_config(
    tokenizer: WhisperTokenizerFast, ct2_config: dict, *, multilingual: bool
) -> GenerationConfig:
    """Decoding settings HF's Whisper `generate` needs, from the tokenizer and config.json."""
    ids = tokenizer.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    settings: dict = {
        "decoder_start_token_id": ids("<|startoftranscript|>"),
        "eos_token_id": eot,
        "pad_token_id": eot,
        "bos_token_id": eot,
        "no_timestamps_token_id": ids("<|notimestamps|>"),
        "prev_sot_token_id": ids("<|startofprev|>"),
        "is_multilingual": multilingual,
        "max_length": MAX_DECODER_TOKENS,
        "max_initial_timestamp_index": MAX_INITIAL_TIMESTAMP_INDEX,
        # The converter writes null for lists the source generation config lacked.
        "suppress_tokens": list(ct2_config.get("suppress_ids") or []),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin") or []),
        "alignment_heads": [list(head) for head in ct2_config.get("alignment_heads") or []],
    }
    if multilingual:
        settings["lang_to_id"] = {
            tokenizer.convert_ids_to_tokens(i): i for i in language_token_ids(tokenizer)
        }
        settings["task_to_id"] = {
            "transcribe": ids("<|transcribe|>"),
            "translate": ids("<|translate|>"),
        }
        # No language: generate detects each clip's. But a task: with neither, transformers
        # detects the language and then leaves <|transcribe|> out of the prompt (the hub's
        # configs carry it in forced_decoder_ids), and a multilingual model loops.
        settings["task"] = "transcribe"
    return GenerationConfig(**settings)


def _feature_extractor(model_dir: Path, n_mels: int) -> WhisperFeatureExtractor:
    """The folder's preprocessor_config.json when present, else Whisper's defaults for n_mels."""
    preprocessor_file = model_dir / PREPROCESSOR_FILE
    if not preprocessor_file.is_file():
        return WhisperFeatureExtractor(feature_size=n_mels)
    extractor = WhisperFeatureExtractor.from_json_file(str(preprocessor_file))
    if extractor.feature_size != n_mels:
        raise UserError(
            f"{preprocessor_file} says {extractor.feature_size} mel bins but the model takes "
            f"{n_mels}: delete the file or use the one that belongs to this model"
        )
    return extractor


# --------------------------------------------------------------------------------------------
# Public entry points


def load_ct2_whisper(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> tuple[WhisperForConditionalGeneration, WhisperProcessor]:
    """A CTranslate2 Whisper folder as an HF model (eval mode, nothing frozen) and processor.

    Dimensions come from tensor shapes: conv1 is [d_model, n_mels, 3], the token embedding
    [vocab, d_model], fc1 [ffn, d_model], the position encodings [1500, d] and [448, d]; head
    counts from the stored scalars. int8 weights are dequantised; every weight ends in `dtype`.
    """
    model_dir = Path(path)
    variables = read_ct2_variables(model_dir)
    ct2_config = _read_config(model_dir / MODEL_CONFIG)
    try:
        return _whisper_from_variables(model_dir, variables, ct2_config, dtype, attn_implementation)
    except (RuntimeError, ValueError, IndexError) as exc:
        # Tensors that read well but do not fit together (a fused weight that does not split
        # in 3, a conv1 of rank 2, a scale per row of another length): damaged, not ours.
        text = str(exc).strip().splitlines()
        raise UserError(
            f"{model_dir / CT2_MODEL_FILE}: its tensors do not form a Whisper model "
            f"({type(exc).__name__}: {(text[0] if text else '')[:160]}); download or convert "
            "the model again"
        ) from None


def _read_config(config_file: Path) -> dict:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        config = None
    if not isinstance(config, dict):
        raise UserError(f"{config_file} is not a JSON object: download or convert the model again")
    return config


def _whisper_from_variables(model_dir, variables, ct2_config, dtype, attn_implementation):
    weights = dequantize(variables)

    # Only the decoder records its activation; the encoder shares it.
    activation = _scalar(weights, "decoder/activation")
    if activation != _GELU:
        raise UserError(f"{model_dir}: activation id {activation} is not GELU, so not Whisper")
    state = _hf_state_dict(weights)
    d_model, n_mels, _ = state["model.encoder.conv1.weight"].shape
    vocab_size = state["model.decoder.embed_tokens.weight"].shape[0]
    multilingual = vocab_size >= MULTILINGUAL_MIN_VOCAB
    tokenizer = load_tokenizer(model_dir, vocab_size)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    sot = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    generation_config = _generation_config(tokenizer, ct2_config, multilingual=multilingual)

    config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=n_mels,
        d_model=d_model,
        encoder_layers=_count_layers(weights, "encoder"),
        decoder_layers=_count_layers(weights, "decoder"),
        encoder_attention_heads=_scalar(weights, "encoder/num_heads"),
        decoder_attention_heads=_scalar(weights, "decoder/num_heads"),
        encoder_ffn_dim=state["model.encoder.layers.0.fc1.weight"].shape[0],
        decoder_ffn_dim=state["model.decoder.layers.0.fc1.weight"].shape[0],
        max_source_positions=state["model.encoder.embed_positions.weight"].shape[0],
        max_target_positions=state["model.decoder.embed_positions.weight"].shape[0],
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=sot,
        suppress_tokens=generation_config.suppress_tokens,
        begin_suppress_tokens=generation_config.begin_suppress_tokens,
        tie_word_embeddings=True,
    )
    # Build on the meta device (no random init, which takes long for large models), then
    # adopt the read tensors; tie_weights re-points proj_out at the token embedding.
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    # Copies, even when the dtype already matches: aliased variables and the q/k/v slices of a
    # fused weight share memory, and parameters sharing memory would train as one.
    state = {name: tensor.to(dtype, copy=True).contiguous() for name, tensor in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.config._attn_implementation = attn_implementation
    model.generation_config = generation_config
    processor = WhisperProcessor(
        feature_extractor=_feature_extractor(model_dir, n_mels), tokenizer=tokenizer
    )
    return model.eval(), processor
