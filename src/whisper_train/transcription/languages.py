"""Languages on a multilingual Whisper, as openai-whisper handles them: each clip's language
detected from the decoder's step on <|startoftranscript|> (`detect_languages`, over the
model's `lang_to_id`, so a language a run added with --new-language is among them), the one
each clip is decoded in (`chosen_languages`), generate's spelling of it (`language_argument`),
and the no-speech probability read from that same step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from whisper_train.data.labels import added_languages, generate_language, language_code


def batch_size(inputs: dict) -> int:
    """Rows of a batch of generate inputs (`input_features` or `encoder_outputs`)."""
    if "encoder_outputs" in inputs:
        return int(inputs["encoder_outputs"].last_hidden_state.shape[0])
    return int(inputs["input_features"].shape[0])


def is_multilingual_generation(model) -> bool:
    """Whether generate takes a language (and task) token: a multilingual checkpoint."""
    config = model.generation_config
    return bool(getattr(config, "is_multilingual", False)) and bool(
        getattr(config, "lang_to_id", None)
    )


def sot_logits(model, inputs: dict) -> torch.Tensor:
    """(batch, vocab) logits of the decoder's step on <|startoftranscript|> alone, on each row's
    encoder output: what language detection and the no-speech probability both read."""
    config = model.generation_config
    if "encoder_outputs" in inputs:
        hidden = inputs["encoder_outputs"].last_hidden_state
        batch, device = {"encoder_outputs": inputs["encoder_outputs"]}, hidden.device
    else:
        batch, device = (
            {"input_features": inputs["input_features"]},
            inputs["input_features"].device,
        )
    start = torch.full(
        (batch_size(inputs), 1), config.decoder_start_token_id, dtype=torch.long, device=device
    )
    with torch.no_grad():
        return model(**batch, decoder_input_ids=start, use_cache=False).logits[:, -1]


def no_speech_probabilities(model, logits: torch.Tensor) -> list[float]:
    """Each row's probability of <|nospeech|> from `sot_logits`: the softmax over the whole
    vocabulary, as openai-whisper's `probs_at_sot` (the token before <|notimestamps|>)."""
    token = model.generation_config.no_timestamps_token_id - 1
    return torch.softmax(logits.float(), dim=-1)[:, token].tolist()


def detect_languages(
    model, inputs: dict, logits: torch.Tensor | None = None
) -> list[tuple[str, float]]:
    """(language code, probability) of each row of `inputs`, as openai-whisper detects it: the
    decoder's distribution over the language tokens after <|startoftranscript|>, on the
    window's encoder output (`logits`: that step's, when already computed). Multilingual only."""
    config = model.generation_config
    codes = {token_id: token.strip("<|>") for token, token_id in config.lang_to_id.items()}
    language_ids = sorted(codes)
    logits = sot_logits(model, inputs) if logits is None else logits
    probabilities = torch.softmax(logits[:, language_ids].float(), dim=-1)
    best, index = probabilities.max(dim=-1)
    return [
        (codes[language_ids[i]], float(p))
        for i, p in zip(index.tolist(), best.tolist(), strict=True)
    ]


def chosen_languages(
    model, detected: list[tuple[str, float]], languages: Sequence[str | None] | None
) -> list[str]:
    """The language each row is decoded in: its given one, else (None) the detected one.
    `languages` None: the model's generation config decides (its language, else detection)."""
    if languages is None:
        forced = getattr(model.generation_config, "language", None)
        languages = [forced] * len(detected)
    if len(languages) != len(detected):
        raise ValueError(f"{len(languages)} languages for a batch of {len(detected)}")
    added = added_languages(model.generation_config)
    return [
        language_code(given, added) if given is not None else code
        for given, (code, _) in zip(languages, detected, strict=True)
    ]


def language_argument(codes: list[str]) -> str | list[str]:
    """generate's `language`: one for a batch in one language, else one per row; an added
    language as its token (`generate_language`)."""
    spelled = [generate_language(code) for code in codes]
    return spelled[0] if len(set(spelled)) == 1 else spelled
