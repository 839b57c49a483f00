"""whisper.cpp's model file (`ggml-model.bin`), written and read by whisper-train itself.

    whisper-train export --model OUTPUT --format ggml --output model-ggml   # f16
    whisper-train export --model OUTPUT --format ggml --quantization float32 --output ...

The layout is the one `whisper_model_load` in whisper.cpp's src/whisper.cpp reads (all
little-endian):
  1. u32 magic 0x67676d6c ("ggml");
  2. 11 int32 hyper-parameters: n_vocab, n_audio_ctx, n_audio_state, n_audio_head,
     n_audio_layer, n_text_ctx, n_text_state, n_text_head, n_text_layer, n_mels, ftype
     (0 all float32, 1 float16 matrices). n_text_ctx is the decoder's position table
     (`max_target_positions`, 448), not generation's max_length: the converter trap behind
     whisper.cpp #2730;
  3. the mel filter bank: int32 n_mel, int32 n_fft (201), n_mel x 201 float32. whisper.cpp
     computes log-mels itself with it, so it is the model's own feature extractor's bank (80 or
     128 bins: large-v3 and turbo have 128);
  4. the vocabulary: int32 count, then per token u32 length + its bytes. Only the text tokens
     (ids below <|endoftext|>) are written: the loader names the special, language and
     timestamp tokens itself from n_vocab (multilingual when n_vocab >= 51865);
  5. the tensors, until the end of the file: int32 n_dims, int32 name length, int32 type
     (0 f32, 1 f16), the dims innermost first (numpy's shape reversed), the name, the data.
     Names are openai-whisper's (openai_whisper.openai_name). The loader checks each tensor's
     shape and byte size against the type it expects: matrices and the convolutions' kernels in
     the file's ftype; vectors, both positional tables and the convolution biases (stored as
     n x 1) in float32. proj_out is not stored (tied to the token embedding).
whisper.cpp fixes the MLP at 4 x d_model and d_text == d_audio (openai_whisper.check_representable).

Beside the file, the export folder keeps the tokenizer, preprocessor and generation config, so
that `--model model-ggml` (or the .bin itself) reads back into transformers; whisper.cpp needs
only the .bin. Reading a float32 file back is bit-exact; a float16 one is float16-exact.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import torch

from whisper_train.audio import N_FFT
from whisper_train.errors import UserError
from whisper_train.formats.openai import (
    DIMS,
    check_representable,
    dims_of,
    model_from_openai_weights,
    openai_state_dict,
    save_side_files,
)

GGML_MODEL_FILE = "ggml-model.bin"
MAGIC = 0x67676D6C
N_FFT_BINS = N_FFT // 2 + 1  # 201 frequency bins of each STFT frame
# The order of the hyper-parameters in the file.
HPARAMS = (
    "n_vocab",
    "n_audio_ctx",
    "n_audio_state",
    "n_audio_head",
    "n_audio_layer",
    "n_text_ctx",
    "n_text_state",
    "n_text_head",
    "n_text_layer",
    "n_mels",
)
FTYPE_F32, FTYPE_F16 = 0, 1
TYPE_F32, TYPE_F16 = 0, 1
QUANTIZATION_FTYPE = {"float32": FTYPE_F32, "float16": FTYPE_F16}
_ALWAYS_F32 = {
    "encoder.positional_embedding",
    "decoder.positional_embedding",
    "encoder.conv1.bias",
    "encoder.conv2.bias",
}
_CONV_BIASES = ("encoder.conv1.bias", "encoder.conv2.bias")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: token character -> the byte it stands for."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def token_bytes(tokenizer, eot: int) -> list[bytes]:
    """The raw bytes of every text token (ids 0 .. eot-1), as whisper.cpp's vocabulary holds them."""
    decoder = _byte_decoder()
    tokens = tokenizer.convert_ids_to_tokens(list(range(eot)))
    return [bytes(decoder[char] for char in token) for token in tokens]


def save_ggml(model, processor, output: Path, *, quantization: str = "float16") -> Path:
    """Write `output/ggml-model.bin` (+ the side files) from an HF Whisper model."""
    if quantization not in QUANTIZATION_FTYPE:
        raise UserError(
            f"--quantization {quantization}: --format ggml writes float16 (default) or float32"
        )
    check_representable(model, "ggml")
    ftype = QUANTIZATION_FTYPE[quantization]
    matrix_dtype = np.float16 if ftype == FTYPE_F16 else np.float32
    dims = dims_of(model.config)
    extractor = processor.feature_extractor
    filters = np.asarray(extractor.mel_filters, dtype=np.float32).T  # (n_mels, 201)
    if filters.shape != (dims["n_mels"], N_FFT_BINS):
        raise UserError(
            f"the feature extractor's mel filters are {filters.shape}, but the model takes "
            f"{dims['n_mels']} mel bins x {N_FFT_BINS}: fix preprocessor_config.json"
        )
    eot = processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    output.mkdir(parents=True, exist_ok=True)
    path = output / GGML_MODEL_FILE
    with open(path, "wb") as out:
        out.write(struct.pack("<I", MAGIC))
        out.write(struct.pack("<11i", *(dims[key] for key in HPARAMS), ftype))
        out.write(struct.pack("<2i", *filters.shape))
        out.write(np.ascontiguousarray(filters, dtype="<f4").tobytes())
        vocabulary = token_bytes(processor.tokenizer, eot)
        out.write(struct.pack("<i", len(vocabulary)))
        for token in vocabulary:
            out.write(struct.pack("<I", len(token)))
            out.write(token)
        for name, tensor in openai_state_dict(model, torch.float32).items():
            data = tensor.numpy()
            if name in _CONV_BIASES:
                data = data.reshape(-1, 1)
            if data.ndim < 2 or name in _ALWAYS_F32:
                data, tensor_type = data.astype("<f4"), TYPE_F32
            else:
                data = data.astype(np.dtype(matrix_dtype).newbyteorder("<"))
                tensor_type = TYPE_F32 if ftype == FTYPE_F32 else TYPE_F16
            encoded = name.encode("utf-8")
            out.write(struct.pack("<3i", data.ndim, len(encoded), tensor_type))
            out.write(struct.pack(f"<{data.ndim}i", *reversed(data.shape)))
            out.write(encoded)
            out.write(np.ascontiguousarray(data).tobytes())
    save_side_files(model, processor, output)
    return path


class _Reader:
    def __init__(self, path: Path):
        self.path = path
        self.data = path.read_bytes()
        self.offset = 0

    def take(self, n: int) -> bytes:
        if n < 0:  # a negative count (signed in the file) would move the reader backwards
            raise UserError(
                f"--model {self.path}: a length at byte {self.offset} is negative ({n}): the "
                "file is damaged; re-export or download it again"
            )
        if self.offset + n > len(self.data):
            raise UserError(
                f"--model {self.path}: the file ends early (at byte {len(self.data)}): it is "
                "truncated; re-export or download it again"
            )
        chunk = self.data[self.offset : self.offset + n]
        self.offset += n
        return chunk

    def ints(self, n: int, code: str = "i") -> tuple[int, ...]:
        return struct.unpack(f"<{n}{code}", self.take(4 * n))

    @property
    def done(self) -> bool:
        return self.offset >= len(self.data)


def read_ggml(path: str | Path) -> tuple[dict[str, int], np.ndarray, dict[str, torch.Tensor]]:
    """(hyper-parameters, mel filters, tensors by openai-whisper name) of a ggml-model.bin."""
    reader = _Reader(Path(path))
    (magic,) = reader.ints(1, "I")
    if magic != MAGIC:
        raise UserError(
            f"--model {path}: not a whisper.cpp model file (magic {magic:#x}, expected "
            f"{MAGIC:#x} 'ggml'); pass a ggml-model.bin that whisper.cpp loads"
        )
    values = reader.ints(len(HPARAMS) + 1)
    hparams = dict(zip(HPARAMS, values[:-1], strict=True))
    ftype = values[-1] % 1000  # GGML_QNT_VERSION_FACTOR
    if ftype not in (FTYPE_F32, FTYPE_F16) or min(hparams.values()) <= 0:
        raise UserError(
            f"--model {path}: ftype {ftype} or the hyper-parameters {hparams} are not a float32 "
            "or float16 Whisper model (quantised ggml files cannot be read back: export float16)"
        )
    n_mel, n_fft = reader.ints(2)
    filters = np.frombuffer(reader.take(4 * n_mel * n_fft), dtype="<f4").reshape(n_mel, n_fft)
    (n_tokens,) = reader.ints(1)
    for _ in range(n_tokens):
        (length,) = reader.ints(1, "I")
        reader.take(length)
    tensors: dict[str, torch.Tensor] = {}
    while not reader.done:
        n_dims, name_length, tensor_type = reader.ints(3)
        if not 0 < n_dims <= 4 or tensor_type not in (TYPE_F32, TYPE_F16) or name_length > 256:
            raise UserError(
                f"--model {path}: a tensor header at byte {reader.offset - 12} is not valid "
                f"(dims {n_dims}, type {tensor_type}): the file is damaged or quantised"
            )
        shape = tuple(reversed(reader.ints(n_dims)))
        name = reader.take(name_length).decode("utf-8", errors="replace")
        dtype = np.dtype("<f4") if tensor_type == TYPE_F32 else np.dtype("<f2")
        count = math.prod(shape)  # Python integers: a crafted shape cannot overflow
        array = np.frombuffer(reader.take(count * dtype.itemsize), dtype=dtype).reshape(shape)
        if name in _CONV_BIASES:
            array = array.reshape(-1)
        tensors[name] = torch.from_numpy(array.copy())
    return hparams, filters, tensors


def load_ggml(path: str | Path, *, attn_implementation: str = "sdpa"):
    """`ggml-model.bin` (or its folder) -> (WhisperForConditionalGeneration in float32, processor)."""
    model_file, hparams, tensors = _read_ggml_model(path)
    dims = {key: hparams[key] for key in DIMS}
    return model_from_openai_weights(model_file, dims, tensors, attn_implementation)


def check_ggml(path: str | Path) -> None:
    """Refuse, in one line naming the file, a ggml-model.bin that `load_ggml` would refuse for
    its form: asked before whisper.cpp, which aborts the whole process on a damaged file, is
    handed it."""
    _read_ggml_model(path)


def _read_ggml_model(path: str | Path) -> tuple[Path, dict[str, int], dict[str, torch.Tensor]]:
    model_file = Path(path)
    if model_file.is_dir():
        model_file = model_file / GGML_MODEL_FILE
    if not (is_ggml_file(model_file) or model_file.name.startswith("ggml")):
        raise UserError(
            f"--model {model_file}: not a whisper.cpp model file (it does not start with 'ggml'); "
            "pass a ggml-model.bin, or the folder of a CTranslate2 model.bin"
        )
    hparams, _, tensors = read_ggml(model_file)
    if hparams["n_audio_state"] != hparams["n_text_state"]:
        raise UserError(f"--model {model_file}: audio and text widths differ; not Whisper")
    return model_file, hparams, tensors


def is_ggml_file(path: Path) -> bool:
    """Whether `path` starts with whisper.cpp's magic number."""
    try:
        with open(path, "rb") as file:
            head = file.read(4)
    except OSError:
        return False
    return len(head) == 4 and struct.unpack("<I", head)[0] == MAGIC
