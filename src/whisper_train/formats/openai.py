"""OpenAI's own checkpoint format (`model.pt` of the PyPI package openai-whisper), both ways.

    whisper-train export --model OUTPUT --format openai --output model-openai
    python -c "import whisper; whisper.load_model('model-openai/model.pt')"

`model.pt` is what `whisper.load_model(path)` reads: `torch.load(weights_only=True)` of
`{"dims": {n_mels, n_audio_ctx, ...}, "model_state_dict": {...}}`, loaded strictly into
openai-whisper's `Whisper` module, whose parameter names (`blocks`, `attn.query`, `mlp.0`,
`ln_post` ...) are also the tensor names of whisper.cpp's ggml files (ggml.py uses them).
`dims` is a plain dict of ints so that `weights_only=True` accepts it. When the generation
config knows the model's alignment heads (word timestamps), they ride along as
`alignment_heads`, in the base85 form `model.set_alignment_heads()` takes; `load_model` itself
only sets them for OpenAI's named models.

Beside `model.pt` the export folder keeps the tokenizer, preprocessor and generation config
(openai-whisper does not read them: its tokenizer ships inside the package), so that
`--model model-openai` reads the folder back into transformers for training, evaluation or
another export, exactly (float32 round trips are bit-exact).
"""

from __future__ import annotations

import base64
import gzip
import re
from pathlib import Path

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperForConditionalGeneration,
    WhisperProcessor,
)

from whisper_train.errors import UserError, unpickling_refusal
from whisper_train.formats.ct2 import (
    _feature_extractor,
    _generation_config,
    is_multilingual_vocab,
    load_tokenizer,
)

OPENAI_MODEL_FILE = "model.pt"
DIMS = (
    "n_mels",
    "n_audio_ctx",
    "n_audio_state",
    "n_audio_head",
    "n_audio_layer",
    "n_vocab",
    "n_text_ctx",
    "n_text_state",
    "n_text_head",
    "n_text_layer",
)

# HF name fragment -> openai-whisper name fragment, applied in this order.
_RENAMES = (
    (r"^model\.", ""),
    (r"^encoder\.embed_positions\.weight$", "encoder.positional_embedding"),
    (r"^decoder\.embed_positions\.weight$", "decoder.positional_embedding"),
    (r"^decoder\.embed_tokens\.", "decoder.token_embedding."),
    (r"^encoder\.layer_norm\.", "encoder.ln_post."),
    (r"^decoder\.layer_norm\.", "decoder.ln."),
    (r"\.layers\.", ".blocks."),
    (r"\.self_attn_layer_norm\.", ".attn_ln."),
    (r"\.encoder_attn_layer_norm\.", ".cross_attn_ln."),
    (r"\.final_layer_norm\.", ".mlp_ln."),
    (r"\.self_attn\.", ".attn."),
    (r"\.encoder_attn\.", ".cross_attn."),
    (r"\.q_proj\.", ".query."),
    (r"\.k_proj\.", ".key."),
    (r"\.v_proj\.", ".value."),
    (r"\.out_proj\.", ".out."),
    (r"\.fc1\.", ".mlp.0."),
    (r"\.fc2\.", ".mlp.2."),
)
# Tied to decoder.token_embedding in openai-whisper and whisper.cpp: not stored.
PROJ_OUT = "proj_out.weight"


def openai_name(hf_name: str) -> str:
    """`model.encoder.layers.0.self_attn.q_proj.weight` -> `encoder.blocks.0.attn.query.weight`."""
    name = hf_name
    for pattern, replacement in _RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def dims_of(config) -> dict[str, int]:
    """openai-whisper's ModelDimensions of a WhisperConfig, as a plain dict of ints."""
    return {
        "n_mels": int(config.num_mel_bins),
        "n_audio_ctx": int(config.max_source_positions),
        "n_audio_state": int(config.d_model),
        "n_audio_head": int(config.encoder_attention_heads),
        "n_audio_layer": int(config.encoder_layers),
        "n_vocab": int(config.vocab_size),
        # The decoder's positions, 448 for every OpenAI model (not generation's max_length).
        "n_text_ctx": int(config.max_target_positions),
        "n_text_state": int(config.d_model),
        "n_text_head": int(config.decoder_attention_heads),
        "n_text_layer": int(config.decoder_layers),
    }


def check_representable(model, format_name: str) -> None:
    """openai-whisper and whisper.cpp fix the MLP at 4 x d_model and tie the output projection
    to the token embedding; a model outside that shape cannot be written for them."""
    config = model.config
    for side in ("encoder", "decoder"):
        ffn = getattr(config, f"{side}_ffn_dim")
        if ffn != 4 * config.d_model:
            raise UserError(
                f"--format {format_name}: the {side}'s MLP has {ffn} units but that runtime "
                f"requires 4 x d_model = {4 * config.d_model}; export this model as hf or ct2"
            )
    proj = model.state_dict().get(PROJ_OUT)
    embed = model.model.decoder.embed_tokens.weight
    if proj is not None and not torch.equal(proj, embed):
        raise UserError(
            f"--format {format_name}: the output projection is not tied to the token embedding "
            "(that runtime ties them); export this model as hf or ct2"
        )


def openai_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The HF model's weights under openai-whisper's names, in `dtype`, on the CPU."""
    return {
        openai_name(name): tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in model.state_dict().items()
        if name != PROJ_OUT
    }


def hf_names(config) -> dict[str, str]:
    """openai-whisper name -> HF name for a WhisperForConditionalGeneration of `config`."""
    with torch.device("meta"):
        skeleton = WhisperForConditionalGeneration(config)
    return {openai_name(name): name for name in skeleton.state_dict() if name != PROJ_OUT}


def _dump_heads(heads, n_layers: int, n_heads: int) -> bytes:
    """Alignment heads ([[layer, head], ...]) as the base85 text of a gzipped bool array
    (n_text_layer x n_text_head): openai-whisper's `_ALIGNMENT_HEADS` form."""
    mask = np.zeros((n_layers, n_heads), dtype=bool)
    for layer, head in heads:
        mask[layer, head] = True
    return base64.b85encode(gzip.compress(mask.tobytes()))


def save_openai(model, processor, output: Path, *, quantization: str = "float16") -> Path:
    """Write `output/model.pt` (+ tokenizer, preprocessor, generation config) from an HF model,
    its weights in `quantization` (float16 or float32)."""
    check_representable(model, "openai")
    output.mkdir(parents=True, exist_ok=True)
    dims = dims_of(model.config)
    dtype = torch.float16 if quantization == "float16" else torch.float32
    checkpoint: dict = {"dims": dims, "model_state_dict": openai_state_dict(model, dtype)}
    heads = getattr(model.generation_config, "alignment_heads", None)
    if heads:
        checkpoint["alignment_heads"] = _dump_heads(
            heads, dims["n_text_layer"], dims["n_text_head"]
        )
    torch.save(checkpoint, output / OPENAI_MODEL_FILE)
    save_side_files(model, processor, output)
    return output / OPENAI_MODEL_FILE


def save_side_files(model, processor, output: Path) -> None:
    """Tokenizer, preprocessor_config.json and generation_config.json beside a runtime's file:
    what reading it back into transformers needs (no config.json: the folder is not an HF model)."""
    processor.save_pretrained(str(output))
    processor.feature_extractor.save_pretrained(str(output))
    model.generation_config.save_pretrained(str(output))
    stray = output / "config.json"  # some transformers versions write one with the processor
    if stray.is_file() and '"model_type": "whisper"' not in stray.read_text(encoding="utf-8"):
        stray.unlink()


def load_openai(path: str | Path, *, attn_implementation: str = "sdpa"):
    """`model.pt` (or its folder) -> (WhisperForConditionalGeneration in float32, processor)."""
    model_file, dims, weights = read_openai_checkpoint(path)
    return model_from_openai_weights(model_file, dims, weights, attn_implementation)


def check_openai(path: str | Path) -> None:
    """Refuse, in one line naming the file, a `model.pt` that `load_openai` would refuse for its
    contents (a pickled object, a cut-off file, missing dims): asked before openai-whisper,
    whose `torch.load` would unpickle anything, is handed the file."""
    read_openai_checkpoint(path)


def read_openai_checkpoint(path: str | Path) -> tuple[Path, dict[str, int], dict]:
    """(the model file, its dims, its weights by openai-whisper name), read without unpickling
    anything but tensors and plain containers."""
    model_file = Path(path)
    if model_file.is_dir():
        model_file = model_file / OPENAI_MODEL_FILE
    try:
        checkpoint = torch.load(model_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, not a torch file at all
        refused = unpickling_refusal(exc)
        cause = str(exc).split(".")[0][:100] + (f": {refused}" if refused else "")
        raise UserError(
            f"--model {model_file}: not a readable openai-whisper checkpoint "
            f"({type(exc).__name__}: {cause}); re-export it or check the download"
        ) from None
    if not isinstance(checkpoint, dict) or not {"dims", "model_state_dict"} <= set(checkpoint):
        raise UserError(
            f"--model {model_file}: a torch file but not an openai-whisper checkpoint (it needs "
            "'dims' and 'model_state_dict')"
        )
    dims, weights = checkpoint["dims"], checkpoint["model_state_dict"]
    missing = [key for key in DIMS if not isinstance(dims, dict) or key not in dims]
    if missing:
        raise UserError(f"--model {model_file}: 'dims' lacks {', '.join(missing)}")
    wrong = [key for key in DIMS if isinstance(dims[key], bool) or not isinstance(dims[key], int)]
    if wrong:
        raise UserError(
            f"--model {model_file}: 'dims' has {wrong[0]} {dims[wrong[0]]!r}, not a whole "
            "number; re-export it or check the download"
        )
    if not isinstance(weights, dict) or not all(
        isinstance(name, str) and isinstance(tensor, torch.Tensor)
        for name, tensor in weights.items()
    ):
        raise UserError(
            f"--model {model_file}: 'model_state_dict' is not a mapping of names to tensors; "
            "re-export it or check the download"
        )
    return model_file, {key: dims[key] for key in DIMS}, weights


def model_from_openai_weights(
    source: Path, dims: dict[str, int], weights: dict, attn_implementation: str = "sdpa"
):
    """An HF Whisper model from openai-named tensors and dims; the processor and generation
    config come from the files beside `source` (what whisper-train's exports write)."""
    processor, generation_config = side_files(source.parent, dims["n_vocab"], dims["n_mels"])
    tokenizer = processor.tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = WhisperConfig(
        vocab_size=dims["n_vocab"],
        num_mel_bins=dims["n_mels"],
        d_model=dims["n_audio_state"],
        encoder_layers=dims["n_audio_layer"],
        decoder_layers=dims["n_text_layer"],
        encoder_attention_heads=dims["n_audio_head"],
        decoder_attention_heads=dims["n_text_head"],
        encoder_ffn_dim=4 * dims["n_audio_state"],
        decoder_ffn_dim=4 * dims["n_text_state"],
        max_source_positions=dims["n_audio_ctx"],
        max_target_positions=dims["n_text_ctx"],
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=tokenizer.convert_tokens_to_ids("<|startoftranscript|>"),
        suppress_tokens=list(generation_config.suppress_tokens or []),
        begin_suppress_tokens=list(generation_config.begin_suppress_tokens or []),
        tie_word_embeddings=True,
    )
    try:
        names = hf_names(config)
    except ValueError as exc:  # e.g. a width the head count does not divide
        raise UserError(
            f"--model {source}: its dimensions {dims} do not describe a Whisper model "
            f"({str(exc).strip()[:120]}); the file is damaged"
        ) from None
    unknown = sorted(set(weights) - set(names))
    absent = sorted(set(names) - set(weights))
    if unknown or absent:
        raise UserError(
            f"--model {source}: the weights do not match their dims "
            f"({'unexpected ' + unknown[0] if unknown else 'missing ' + absent[0]}); the file is "
            "not a Whisper model or is damaged"
        )
    state = {}
    for name, tensor in weights.items():
        state[names[name]] = tensor.to(torch.float32, copy=True).contiguous()
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:
        raise UserError(
            f"--model {source}: a tensor's shape does not match the dims "
            f"({str(exc).splitlines()[-1].strip()[:160]}); the file is damaged"
        ) from None
    model.tie_weights()
    model.config._attn_implementation = attn_implementation
    model.generation_config = generation_config
    return model.eval(), processor


def side_files(folder: Path, vocab_size: int, n_mels: int):
    """(processor, generation config) from the tokenizer and configs beside a runtime file."""
    tokenizer = load_tokenizer(folder, vocab_size)  # one line naming tokenizer.json if absent
    if (folder / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(str(folder))
    else:
        generation_config = _generation_config(
            tokenizer, {}, multilingual=is_multilingual_vocab(vocab_size)
        )
    processor = WhisperProcessor(
        feature_extractor=_feature_extractor(folder, n_mels), tokenizer=tokenizer
    )
    return processor, generation_config
