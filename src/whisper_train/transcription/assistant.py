"""Speculative decoding (`--assistant MODEL`): a smaller Whisper drafts, the model verifies.

transformers' assisted generation (`generate(..., assistant_model=...)`): the assistant
proposes up to `num_assistant_tokens` tokens greedily, the main model scores all of them in one
forward pass and keeps the longest prefix it agrees with, plus its own next token. With greedy
decoding every kept token is the main model's own argmax, so the text is the main model's
greedy text; only the number of main-model passes changes (one per accepted run of drafts
instead of one per token). A draft the model rejects costs the assistant's time for nothing, so
the gain depends on how often the two agree: a student distilled from the model agrees often,
an untrained one seldom.

What transformers (4.56 to 5.x) takes, and what this module does about it:
  * one clip a call (`_assisted_decoding` refuses batch > 1): the callers decode row by row;
  * greedy or sampling only (with beam search the assistant is ignored, with a warning): the
    commands refuse --beam-size > 1 with --assistant;
  * the same vocabulary (another needs `tokenizer`/`assistant_tokenizer`, universal assisted
    decoding, whose drafts are re-tokenised): refused here, in one line (`make_assistant`);
  * the assistant's encoder: an encoder-decoder assistant runs its own encoder on the input
    features. A student made from the model (`student_from_teacher`, distil-whisper's recipe,
    encoder frozen) has the model's encoder, bit for bit: running it again is wasted, so such
    an assistant drafts as a decoder alone (`WhisperForCausalLM`, distil-whisper's
    `AutoModelForCausalLM` usage) on the model's own encoder outputs.
  * transformers' Whisper `generate` drops `begin_suppress_tokens` when an assistant is given
    (its comment: "the model should be able to return eos token"); `begin_suppression` puts
    the suppression back as a logits processor, so the first token is chosen as without one.
    Not for an assistant with its own encoder: it drafts through Whisper's `generate`, which
    moves every shared processor's first position to its own (`set_begin_index`), so the
    processor would forbid <|endoftext|> wherever a draft starts. Such a pair may differ from
    the model alone where the model's first token would be a space or <|endoftext|>.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import WhisperForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensAtBeginLogitsProcessor,
)

from whisper_train.errors import UserError

# The generation-config fields that name special tokens: where two models' differ, the same
# token id means another thing to each, and the model would verify drafts it cannot read.
SPECIAL_TOKEN_FIELDS = (
    "decoder_start_token_id",
    "eos_token_id",
    "pad_token_id",
    "no_timestamps_token_id",
    "lang_to_id",
    "task_to_id",
)


@dataclass(frozen=True)
class Assistant:
    """The drafter `generate` is handed (`assistant_model`), and how it was made."""

    spec: str  # as the user named it (--assistant)
    model: torch.nn.Module  # a WhisperForCausalLM on the main model's encoder, or a whole Whisper
    shares_encoder: bool  # True: drafts on the main model's encoder outputs


def check_same_tokens(
    model,
    processor,
    other,
    other_processor,
    *,
    named: str,
    against: str = "--model's",
    remedy: str = "pick an assistant with the model's tokenizer, e.g. a student made from it",
) -> None:
    """One line, naming `named` (`--assistant SPEC`, `--student SPEC`), where `other` does not
    read and write `model`'s tokens (vocabulary size, special-token ids, the tokenizer's ids) or
    hear its audio (mel bins): an assistant's drafts, or a student's distributions, would mean
    other words to it. `against` names `model` in the line; `remedy` ends it."""
    vocab, other_vocab = model.config.vocab_size, other.config.vocab_size
    if vocab != other_vocab:
        raise UserError(
            f"{named}: its vocabulary has {other_vocab} tokens and {against} {vocab} "
            f"(English-only and multilingual Whisper models differ); {remedy}"
        )
    for name in SPECIAL_TOKEN_FIELDS:
        mine = getattr(model.generation_config, name, None)
        theirs = getattr(other.generation_config, name, None)
        if mine != theirs and mine is not None and theirs is not None:
            shown = name if not isinstance(mine, dict) else f"{name} ({len(theirs)} vs {len(mine)})"
            raise UserError(
                f"{named}: its special tokens differ from {against} ({shown}); {remedy}"
            )
    if processor.tokenizer.get_vocab() != other_processor.tokenizer.get_vocab():
        raise UserError(f"{named}: its tokenizer maps tokens to other ids than {against}; {remedy}")
    mels, other_mels = model.config.num_mel_bins, other.config.num_mel_bins
    if mels != other_mels:
        raise UserError(
            f"{named}: it reads {other_mels} mel bins and {against} {mels} (large-v3 and turbo "
            f"read 128); {remedy}"
        )


def same_encoder(model, assistant) -> bool:
    """Whether `assistant`'s encoder is `model`'s, weight for weight (a student made from it)."""
    mine = model.model.encoder.state_dict()
    theirs = assistant.model.encoder.state_dict()
    return mine.keys() == theirs.keys() and all(
        mine[name].shape == theirs[name].shape
        and torch.equal(mine[name], theirs[name].to(mine[name]))
        for name in mine
    )


def decoder_drafter(assistant) -> WhisperForCausalLM:
    """`assistant`'s decoder and output projection as a `WhisperForCausalLM`, which drafts on
    the encoder outputs the main model's `generate` hands it (no encoder of its own)."""
    config = copy.deepcopy(assistant.config)
    parameter = next(assistant.parameters())
    with torch.device(parameter.device):
        drafter = WhisperForCausalLM(config).to(parameter.dtype)
    state = {
        name: tensor
        for name, tensor in assistant.state_dict().items()
        if name.startswith("model.decoder.") or name == "proj_out.weight"
    }
    drafter.load_state_dict(state, strict=True)
    drafter.config._attn_implementation = assistant.config._attn_implementation
    return drafter.eval()


def make_assistant(model, processor, assistant, assistant_processor, spec: str) -> Assistant:
    """The drafter for `model` (the one that verifies) made of `assistant` (loaded as any
    --model is); UserError where the two do not share tokens (`check_same_tokens`)."""
    check_same_tokens(model, processor, assistant, assistant_processor, named=f"--assistant {spec}")
    weight = next(p for p in model.parameters() if p.is_floating_point())
    assistant = assistant.to(weight.device, weight.dtype).eval()
    shares = same_encoder(model, assistant)
    drafter = decoder_drafter(assistant) if shares else assistant
    config = copy.deepcopy(assistant.generation_config)
    # The drafts' lengths come from the candidate generator (max_new_tokens); a length of the
    # checkpoint's own would make transformers warn at every draft.
    config.max_length = None
    config.min_length = None
    drafter.generation_config = config
    return Assistant(spec=spec, model=drafter, shares_encoder=shares)


def begin_suppression(model) -> LogitsProcessorList:
    """The model's `begin_suppress_tokens` at the first generated position, which transformers'
    Whisper `generate` leaves out when an assistant drafts; empty when the model suppresses
    nothing there. Whisper's `generate` sets the position (`set_begin_index`) to its decoder
    prompt's length, as for its own processor."""
    tokens = getattr(model.generation_config, "begin_suppress_tokens", None)
    if not tokens:
        return LogitsProcessorList()
    device = next(model.parameters()).device
    return LogitsProcessorList(
        [SuppressTokensAtBeginLogitsProcessor(list(tokens), 1, device=device)]
    )


def assisted(assistant: Assistant | None, model, batch: dict, given: dict) -> dict:
    """generate's extra arguments for one greedy call on `batch` (its inputs): none without an
    assistant. An assistant with its own encoder reads the input features, taken from `given`
    (the rows' inputs as the caller got them) where `batch` holds encoder outputs alone."""
    if assistant is None:
        return {}
    extra = {"assistant_model": assistant.model}
    if assistant.shares_encoder:  # see the module docstring
        extra["logits_processor"] = begin_suppression(model)
    if not assistant.shares_encoder and "input_features" not in batch:
        features = given.get("input_features")
        if features is None:
            raise UserError(
                f"--assistant {assistant.spec}: its encoder is not --model's, so it needs the "
                "audio's features, and these clips come as cached encoder outputs"
            )
        extra["input_features"] = features
    return extra


def refuse_unassistable(assistant: str | None, *, beam_size: int, word_timestamps: bool) -> None:
    """One line for what transformers' assisted generation cannot do beside `--assistant`."""
    if assistant is None:
        return
    if beam_size > 1:
        raise UserError(
            f"--assistant {assistant} with --beam-size {beam_size}: speculative decoding "
            "verifies greedy decoding only (transformers ignores the assistant in beam search); "
            "drop --beam-size or --assistant"
        )
    if word_timestamps:
        raise UserError(
            f"--assistant {assistant} with --word-timestamps: transformers' assisted generation "
            "does not return the cross-attention word times are read from; drop one of them"
        )
