"""Transcripts from `model.generate` for batches of features, with the language and task set
per set (`transcription.decoding` owns the fallbacks); what every evaluation scores."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from transformers.modeling_outputs import BaseModelOutput

from whisper_train.data.features import LogMel, content_frames
from whisper_train.transcription.assistant import Assistant
from whisper_train.transcription.decoding import Decoded, DecodingOptions, generate_decoded
from whisper_train.transcription.languages import batch_size

log = logging.getLogger(__name__)


# -- generation -----------------------------------------------------------------------------


def _first_parameter(model) -> torch.Tensor:
    return next(p for p in model.parameters() if p.is_floating_point())


@torch.inference_mode()
def _generate_batch(
    model,
    processor,
    batch: dict,
    *,
    max_length: int,
    num_beams: int,
    decoding: DecodingOptions | None = None,
    assistant: Assistant | None = None,
) -> list[Decoded]:
    weight = _first_parameter(model)
    frames = batch.get("content_frames")  # for the no-speech test's second look
    if "input_features" in batch:
        inputs = {"input_features": batch["input_features"].to(weight.device, weight.dtype)}
    elif "audio" in batch:
        # A collator without a LogMel hands over waveforms: compute features where the model is.
        features = LogMel(processor.feature_extractor, device=weight.device)(batch["audio"])
        inputs = {"input_features": features.to(weight.dtype)}
        frames = content_frames(batch["audio"])
    else:
        # A batch from the encoder cache: the encoder already ran, skip it.
        hidden = batch["encoder_hidden_states"].to(weight.device, weight.dtype)
        inputs = {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden)}
    languages = batch.get("languages")
    # transformers' assisted generation takes one clip a call: an assistant decodes row by row.
    groups = [[row] for row in range(batch_size(inputs))] if assistant else [None]
    return [
        item
        for rows in groups
        for item in generate_decoded(
            model,
            inputs if rows is None else _rows(inputs, rows),
            processor.tokenizer,
            max_length=max_length,
            num_beams=num_beams,
            options=decoding,
            languages=languages if rows is None or languages is None else _pick(languages, rows),
            content_frames=frames if rows is None or frames is None else _pick(frames, rows),
            assistant=assistant,
        )
    ]


def _pick(values, rows: list[int]) -> list:
    return [values[row] for row in rows]


def _rows(inputs: dict, rows: list[int]) -> dict:
    """The generate inputs (`input_features` or `encoder_outputs`) of some rows of a batch."""
    if "encoder_outputs" in inputs:
        hidden = inputs["encoder_outputs"].last_hidden_state[rows]
        return {"encoder_outputs": BaseModelOutput(last_hidden_state=hidden)}
    return {"input_features": inputs["input_features"][rows]}


def generate_texts(
    model,
    processor,
    batches: Iterable[dict],
    *,
    max_length: int = 225,
    num_beams: int = 1,
    decoding: DecodingOptions | None = None,
    details: list[Decoded] | None = None,
    assistant: Assistant | None = None,
) -> list[str]:
    """Transcribe each batch with `model.generate` and return the texts, in batch order.

    `batches` are dicts from `SpeechCollator`: `input_features` (batch, n_mels, 3000) with
    `content_frames` (each row's frames of audio, for the no-speech test's second look),
    `encoder_hidden_states` (batch, 1500, d_model) from an encoder cache, or `audio` (a list of
    16 kHz waveforms), and optionally `languages`: each row's language on a multilingual model
    (a code, or None: detect it). Without `languages`, language and task come from
    `model.generation_config` (no language there: each clip's is detected). Works for
    peft-wrapped models. The model is put in eval mode
    (dropout off) and its training mode is restored afterwards.

    `decoding`: the temperature fallback (whisper_train.transcription.decoding); None is the
    default one (greedy or beam search, then 0.2 ... 1.0 for outputs that loop or are
    unlikely), `NO_FALLBACK` one plain generate call. `details`, when given, receives one `Decoded` per
    text (temperature, mean log-prob, compression ratio, whether it needed the fallback).
    `assistant` (`transcription.assistant`): speculative decoding, one clip a call, the same
    texts as without it.
    """
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        for batch in batches:
            if not batch.get("size", 1):
                continue  # every clip of this batch was skipped by the collator
            decoded = _generate_batch(
                model,
                processor,
                batch,
                max_length=max_length,
                num_beams=num_beams,
                decoding=decoding,
                assistant=assistant,
            )
            texts.extend(item.text for item in decoded)
            if details is not None:
                details.extend(decoded)
    finally:
        model.train(was_training)
    return texts
