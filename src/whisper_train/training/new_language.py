"""--new-language CODE: a language token Whisper does not have, added to the model it trains.

    token_id = add_language(model, tokenizer, "eo", init="es")

Whisper names a clip's language with one token after <|startoftranscript|> (<|de|>), and
detects it by comparing the decoder's logits over those tokens at that step. A new language
is one more such token: appended to the tokenizer (after the time tokens, so no id of the
vocabulary moves and every export keeps its special ids), its row added to the token
embedding (which Whisper's output projection shares: the same row is the token's input and
its logit's weights) and initialised from the row of `init`, a language the model knows, so
the first steps start from that language's prefix rather than from noise, and
`generation_config.lang_to_id` maps it, which is what transformers' generate, language
detection (`transcription.languages`) and every later load read as the model's languages.
The token is also suppressed in text (`suppress_tokens`): after the time tokens, generate's
timestamp rules would otherwise read it as a time.

Why `init` is required rather than defaulted: the neighbour a new language should start from
is a linguistic choice (Esperanto from Spanish or Italian, a Bantu language from Swahili) the
tool cannot make, and a wrong default would start every run from a worse prefix without a
word; the mean of all language rows, the one neutral choice, starts the token where no
language is, which the measurement in BENCHMARKS.md did not try.
"""

from __future__ import annotations

import torch
from tokenizers import AddedToken

from whisper_train.data.labels import added_languages, check_new_language, language_code
from whisper_train.errors import UserError


def frozen_encoder_advice(code: str, mode: str, cache_encoder_asked: bool | None) -> str | None:
    """One line for a run that adds `code` with an encoder that does not train (`mode`
    freeze-encoder, or LoRA's adapters kept out of an encoder cached by --cache-encoder, the
    flag's value `cache_encoder_asked`); None otherwise. A new language brings sounds the
    pretrained encoder was never taught to tell apart: on Esperanto, base's held-out WER stayed
    4-7x full fine-tuning's with its encoder frozen (BENCHMARKS.md, "What bounds the new
    language's WER"). The remedy names what else to drop: full mode refuses --cache-encoder."""
    if mode == "freeze-encoder":
        remedy = "--mode full trains it too"
        if cache_encoder_asked:
            remedy += " (without --cache-encoder)"
    elif mode == "lora" and cache_encoder_asked:
        remedy = "drop --cache-encoder to put adapters in it"
    else:
        return None
    return f"--new-language {code} with a frozen encoder: it never learns its sounds; {remedy}"


def add_language(model, tokenizer, code: str, *, init: str) -> int:
    """Add <|code|> to `tokenizer` and `model` (embedding, tied output projection, generation
    config), its row a copy of `init`'s; returns its token id."""
    config = model.generation_config
    multilingual = bool(getattr(config, "is_multilingual", False) and config.lang_to_id)
    code = check_new_language(code, init, multilingual=multilingual)
    if code in added_languages(config):
        raise UserError(
            f"--new-language {code}: this model has <|{code}|> already (an earlier run added "
            f"it); train under it with --language {code}"
        )
    init_code = language_code(init, added_languages(config))
    init_id = config.lang_to_id[f"<|{init_code}|>"]
    token = f"<|{code}|>"
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False)], special_tokens=True)
    token_id = int(tokenizer.convert_tokens_to_ids(token))
    embeddings = model.get_input_embeddings()
    if token_id >= embeddings.weight.shape[0]:
        # mean_resizing off: the row is set below, and the covariance of a 51,865-row table
        # would cost seconds for a row that is overwritten.
        model.resize_token_embeddings(token_id + 1, mean_resizing=False)
        embeddings = model.get_input_embeddings()
    output = model.get_output_embeddings()
    with torch.no_grad():
        embeddings.weight[token_id] = embeddings.weight[init_id]
        if output is not None and output.weight is not embeddings.weight:
            output.weight[token_id] = output.weight[init_id]
    config.lang_to_id = {**config.lang_to_id, token: token_id}
    config.suppress_tokens = sorted({*(config.suppress_tokens or []), token_id})
    return token_id
