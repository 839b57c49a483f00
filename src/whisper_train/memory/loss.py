"""The training loss without the full-vocabulary logits, and the base-preservation term.

Whisper's own loss computes logits for every decoder position (batch x T x 51,866) and keeps
their log-softmax until backward: the largest tensor a decoder step holds. `training_loss`
computes the same mean cross-entropy from logits at label positions only, `LOSS_CHUNK_TOKENS`
at a time, and recomputes each chunk in backward when checkpointing is on.

With a `BasePreservation` (`--preserve-base WEIGHT`) it adds WEIGHT x KL(p_base || p_trained):
the divergence of the trained model's next-token distribution from the frozen starting model's
on the same batch, at the same label positions, under the same memory discipline (distil-whisper's
teacher term, the starting model as teacher). It keeps what the model knew while it fits.

Distillation (`--teacher`) is the same term against another model (`BasePreservation.from_teacher`:
a frozen teacher, any decoder depth), at a temperature T: CE_WEIGHT x cross-entropy + WEIGHT x
T^2 x KL(p_teacher^T || p_student^T), both distributions softened by T (distil-whisper's loss).
Where the trained model's encoder is frozen and equal to the teacher's (a student made from it),
the teacher runs its decoder on the encoder outputs the trained model's own forward made: one
encoder pass a micro-batch for both.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from whisper_train.data.collate import IGNORE_INDEX
from whisper_train.errors import UserError
from whisper_train.memory.checkpointing import checkpointing_on, recomputed_decoder_layers
from whisper_train.memory.clip_attention import clip_route, clips_routed, route_clips
from whisper_train.memory.cross_attention import folded_cross_attention
from whisper_train.memory.sharding import gathered_weight
from whisper_train.memory.wrappers import is_peft_model, unwrapped, whisper_of

# Label tokens whose logits exist at once. 51,866 logits a token: 256 tokens are 53 MB in fp32,
# where a batch of 16 x 448-token labels would be 1.5 GB, kept until backward. Read at call
# time, so a test can patch it here (`whisper_train.memory.loss.LOSS_CHUNK_TOKENS`).
LOSS_CHUNK_TOKENS = 256


class LossTerms(NamedTuple):
    """One step's loss and its parts, each a mean over label tokens.

    `loss` is what to backpropagate: `cross_entropy + weight * divergence`. Without
    preservation (none, or weight 0) `divergence` is None and `loss` is `cross_entropy`, the
    same tensor `training_loss` has always returned.
    """

    loss: torch.Tensor
    cross_entropy: torch.Tensor
    divergence: torch.Tensor | None


@dataclass(eq=False)
class BasePreservation:
    """`--preserve-base WEIGHT`: the frozen starting model the loss compares against, and WEIGHT.

    `reference` is a frozen copy of the starting Whisper model, or None where the starting model
    is the trained model itself with its LoRA adapters disabled (peft's `disable_adapter()`).
    Build it with `from_model`; the loss reads `reference` only when `weight` is not 0.
    """

    weight: float
    reference: nn.Module | None = None
    # Whether `reference` shares the trained model's (frozen) encoder instead of copying it.
    shares_encoder: bool = False
    # The autocast dtype the trained model's forward runs in (accelerate wraps the forward of
    # the model it prepares, not this copy's): the copy runs in it too, or the teacher would
    # differ from an untrained student by 16-bit rounding alone. None: no autocast of its own.
    autocast_dtype: torch.dtype | None = None
    # Distillation's: the KL term's temperature (scaled by its square) and the cross-entropy's
    # weight; 1 and 1 keep --preserve-base's loss, CE + WEIGHT x KL.
    temperature: float = 1.0
    cross_entropy_weight: float = 1.0

    @classmethod
    def from_model(
        cls, model: nn.Module, weight: float, *, autocast_dtype: torch.dtype | None = None
    ) -> BasePreservation:
        """The starting model of `model`, as it is now, kept for the whole run.

        Call it on the model `memory.prepare_model` returned, before any weights are restored
        from a checkpoint or trained: what it sees is the base the run preserves.
        `autocast_dtype` is the mixed-precision compute dtype (bf16/fp16) the trained forward
        runs in, None for fp32; LoRA's base runs through the trained model's own forward and
        needs none.

        Memory: LoRA (a peft model) costs nothing; the base is the same weights with the adapters
        disabled for the reference forward. Full fine-tuning costs one more copy of the model's
        weights, in their dtype (no gradients, no optimiser state); with a frozen encoder, a copy
        of the decoder only: the encoder is frozen, so the copy shares it. `extra_bytes` says how
        much. The copy is made where the model is now and follows it on first use (to its device
        and dtype). Weight 0 copies nothing, and the loss is then exactly the plain loss.
        """
        if not math.isfinite(weight) or weight < 0:
            raise UserError(f"--preserve-base {weight}: expected a weight >= 0")
        model = unwrapped(model)
        if weight == 0 or is_peft_model(model):
            return cls(float(weight))  # LoRA: the wrapped forward's autocast applies as it is
        whisper = whisper_of(model)
        if "forward" in vars(whisper):
            # accelerate's mixed-precision forward, set on the instance by accelerator.prepare:
            # a copy would call the original's (and accelerate refuses to be copied anyway).
            raise ValueError(
                "BasePreservation.from_model: build it before accelerator.prepare, on the model "
                "memory.prepare_model returned"
            )
        encoder = whisper.model.encoder
        # A frozen encoder is the starting one, now and at every step: the copy shares it (the
        # deep copy takes it from the memo as it is) and copies the decoder and head only.
        shares_encoder = not any(p.requires_grad for p in encoder.parameters())
        reference = copy.deepcopy(whisper, {id(encoder): encoder} if shares_encoder else {})
        shared = set(encoder.modules()) if shares_encoder else set()
        for module in reference.modules():
            if module in shared:
                continue  # the trained model's own: its modes and flags stay the trainer's
            module.training = False  # eval: no dropout, layerdrop or SpecAugment
            # Never recomputed: its forward runs under no_grad, with nothing saved for backward.
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = False
        reference.requires_grad_(False)  # a no-op on the shared encoder: frozen already
        reference._whisper_train_checkpointing = "off"
        reference.config.use_cache = False
        return cls(float(weight), reference, shares_encoder, autocast_dtype)

    @classmethod
    def from_teacher(
        cls,
        model: nn.Module,
        teacher: nn.Module,
        *,
        weight: float,
        temperature: float,
        cross_entropy_weight: float,
        autocast_dtype: torch.dtype | None = None,
    ) -> BasePreservation:
        """Distillation's term: `teacher` (a Whisper model with the trained model's vocabulary,
        any decoder depth), frozen and in eval mode for the whole run, no gradient, never
        recomputed. Where the trained model's encoder is frozen and holds the teacher's very
        weights (a student made from it, `student.student_from_teacher`), the teacher takes that
        encoder instead of its own (its copy is freed) and its decoder reads the encoder
        outputs of the trained model's forward (`loss_terms`). Call it on the model
        `memory.prepare_model` returned, before `accelerator.prepare`."""
        whisper = whisper_of(unwrapped(model))
        encoder = whisper.model.encoder
        config = whisper.config
        # An encoder pass with SpecAugment, dropout or layerdrop is not the teacher's clean one.
        clean = not (config.apply_spec_augment or config.dropout or config.encoder_layerdrop)
        frozen = not any(p.requires_grad for p in encoder.parameters())
        shares_encoder = clean and frozen and _same_weights(encoder, teacher.model.encoder)
        if shares_encoder:
            teacher.model.encoder = encoder
        shared = set(encoder.modules()) if shares_encoder else set()
        for module in teacher.modules():
            if module in shared:
                continue  # the trained model's own: its modes and flags stay the trainer's
            module.training = False
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = False
        teacher.requires_grad_(False)
        teacher._whisper_train_checkpointing = "off"
        teacher.config.use_cache = False
        return cls(
            float(weight),
            teacher,
            shares_encoder,
            autocast_dtype,
            float(temperature),
            float(cross_entropy_weight),
        )

    @property
    def extra_bytes(self) -> int:
        """Bytes of weights the reference holds beyond the trained model's (0 for LoRA)."""
        if self.reference is None:
            return 0
        shared = set()
        if self.shares_encoder:
            shared = {id(p) for p in self.reference.model.encoder.parameters()}
        return sum(
            p.numel() * p.element_size() for p in self.reference.parameters() if id(p) not in shared
        )


def training_loss(
    model: nn.Module, batch: dict, *, preserve: BasePreservation | None = None
) -> torch.Tensor:
    """Teacher-forced cross-entropy, the mean over label tokens, without full-vocabulary logits;
    plus `preserve.weight` x the mean KL(p_base || p_trained) when `preserve` is given.

    `batch` holds `decoder_input_ids` (batch, T), `labels` (batch, T; -100 where there is no
    loss) and either `input_features` (batch, n_mels, frames) or `encoder_hidden_states`
    (batch, positions, d_model: cached encoder outputs). The model's own forward runs (through
    any DDP, compile or peft wrapper, so gradients synchronise) with its output projection left
    out; the logits are then computed only where a label is, not for the prompt prefix or
    padding, `LOSS_CHUNK_TOKENS` at a time. With checkpointing on, each chunk's logits are
    recomputed in backward instead of kept: the log-softmax of every label token is the largest
    tensor a decoder keeps otherwise. Returns a scalar. `loss_terms` gives the parts too.
    """
    return loss_terms(model, batch, preserve=preserve).loss


def loss_terms(
    model: nn.Module, batch: dict, *, preserve: BasePreservation | None = None
) -> LossTerms:
    """`training_loss` with its parts: (loss, cross-entropy, divergence or None).

    The divergence is KL(p_base || p_trained) summed over the vocabulary and averaged over label
    tokens: the starting model is the teacher. Its side runs first, under no_grad and in eval
    mode (no dropout or SpecAugment: the base's prediction for the clean input, and no random
    draws, so the trained forward draws what it draws without preservation); only its decoder
    hidden states at label positions are kept, and its logits exist one chunk at a time, like
    the trained model's, recomputed with them in backward under checkpointing.
    """
    whisper = whisper_of(unwrapped(model))
    inputs = {"decoder_input_ids": batch["decoder_input_ids"]}
    if "encoder_hidden_states" in batch:
        hidden = batch["encoder_hidden_states"].to(whisper.proj_out.weight.dtype)
        # Cached outputs of the frozen encoder: the starting model's encoder is that same one.
        inputs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
    else:
        inputs["input_features"] = batch["input_features"]
    preserving = preserve is not None and preserve.weight != 0
    if type(whisper.proj_out) is not nn.Linear:
        # Adapters on the output head (peft wraps it): only the model knows its logits.
        if preserving:
            return _full_vocabulary_terms(model, inputs, batch, preserve)
        with clips_routed(whisper, batch):
            loss = model(**inputs, labels=batch["labels"]).loss
        return _cross_entropy_only(loss, preserve)
    base_states = base_weight = None
    # The teacher on the trained model's encoder outputs (after its forward), or on its own
    # encoder pass (first, so its activations are gone before the trained forward saves any).
    shared_pass = preserving and _shares_encoder_pass(preserve, whisper)
    if preserving and not shared_pass:
        base_states, base_whisper = _base_forward(model, preserve, inputs, batch, deferred=True)
        base_weight = gathered_weight(base_whisper.proj_out.weight, model)
    # On cached encoder outputs, the cross-attention in its cheaper order (`cross_attention`).
    folded = folded_cross_attention(
        whisper,
        enabled="encoder_outputs" in inputs,
        recomputed=recomputed_decoder_layers(whisper) if torch.is_grad_enabled() else (),
    )
    # A packed per-clip micro-batch: each clip's decoder pass on its own encoder positions.
    kept = _EncoderOutput()
    kept_encoded = _encoder_output_kept(whisper, kept, enabled=shared_pass)
    with _projection_deferred(whisper), folded, clips_routed(whisper, batch), kept_encoded:
        decoder_states = model(**inputs).logits  # (batch, T, d_model): hidden states here
    if shared_pass:
        encoded = kept.value if kept.value is not None else inputs["encoder_outputs"][0]
        base_states, base_whisper = _teacher_on_encoded(model, preserve, inputs, encoded, batch)
        base_weight = gathered_weight(base_whisper.proj_out.weight, model)
    labels = batch["labels"].to(decoder_states.device)
    keep = labels != IGNORE_INDEX
    states, targets = decoder_states[keep], labels[keep]  # (n, d_model), (n,)
    if len(targets) == 0:  # nothing to learn; a zero that still reaches every parameter
        zero = decoder_states.sum() * 0.0
        return LossTerms(zero, zero, zero.detach() if preserving else None)
    recompute = torch.is_grad_enabled() and checkpointing_on(whisper)
    # Under --fsdp the projection is the root unit's; gathered here if a forward left it sharded
    # (`sharding.gathered_weight`: a no-op for a plain tensor, as without --fsdp).
    weight = gathered_weight(whisper.proj_out.weight, model)
    # Summed in float32 at least (16-bit logits under autocast); a float64 model stays float64.
    total = states.new_zeros((), dtype=torch.promote_types(states.dtype, torch.float32))
    if not preserving:  # the plain loss, exactly as before preservation existed
        for start in range(0, len(targets), LOSS_CHUNK_TOKENS):
            chunk = slice(start, start + LOSS_CHUNK_TOKENS)
            if recompute:
                total = total + torch.utils.checkpoint.checkpoint(
                    _summed_cross_entropy,
                    states[chunk],
                    weight,
                    targets[chunk],
                    use_reentrant=False,
                )
            else:
                total = total + _summed_cross_entropy(states[chunk], weight, targets[chunk])
        return _cross_entropy_only(total / len(targets), preserve)
    # (n, d_model), as the trained states: accelerate hands those back in float32.
    base_states = base_states[keep.to(base_states.device)].to(states.device, states.dtype)
    divergence, temperature = total, preserve.temperature
    for start in range(0, len(targets), LOSS_CHUNK_TOKENS):
        chunk = slice(start, start + LOSS_CHUNK_TOKENS)
        parts = (
            states[chunk],
            weight,
            targets[chunk],
            base_states[chunk],
            base_weight,
            temperature,
        )
        if recompute:
            # The base's chunk logits are recomputed from its (n, d_model) states too: passed in
            # as an input instead, each chunk's (chunk, vocab) would be kept for backward.
            summed = torch.utils.checkpoint.checkpoint(
                _summed_cross_entropy_and_divergence, *parts, use_reentrant=False
            )
        else:
            summed = _summed_cross_entropy_and_divergence(*parts)
        total, divergence = total + summed[0], divergence + summed[1]
    cross_entropy, divergence = total / len(targets), divergence / len(targets)
    return _combined(cross_entropy, divergence, preserve)


def _combined(
    cross_entropy: torch.Tensor, divergence: torch.Tensor, preserve: BasePreservation
) -> LossTerms:
    """CE_WEIGHT x cross-entropy + WEIGHT x T^2 x divergence: T^2 keeps the divergence's
    gradients at the scale of T = 1's as T softens both distributions (Hinton et al. 2015)."""
    scaled = preserve.weight * preserve.temperature**2
    if preserve.cross_entropy_weight == 1:  # --preserve-base: exactly CE + WEIGHT x KL
        return LossTerms(cross_entropy + scaled * divergence, cross_entropy, divergence)
    loss = preserve.cross_entropy_weight * cross_entropy + scaled * divergence
    return LossTerms(loss, cross_entropy, divergence)


def _cross_entropy_only(
    cross_entropy: torch.Tensor, preserve: BasePreservation | None
) -> LossTerms:
    """The loss without a divergence: the cross-entropy, weighted by a teacher's CE weight
    where its KL weight is 0."""
    if preserve is None or preserve.cross_entropy_weight == 1:
        return LossTerms(cross_entropy, cross_entropy, None)
    return LossTerms(preserve.cross_entropy_weight * cross_entropy, cross_entropy, None)


def _summed_cross_entropy(
    states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Summed cross-entropy of (n, d_model) states against (n,) targets through (vocab, d_model)
    `weight`; the (n, vocab) logits exist only inside this call."""
    logits = torch.nn.functional.linear(states, weight)  # half precision under autocast
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def _summed_cross_entropy_and_divergence(
    states: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    base_states: torch.Tensor,
    base_weight: torch.Tensor,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, summed KL(p_base || p_trained) at `temperature`) of n label
    tokens, from the trained and the base model's (n, d_model) decoder states and output
    projections; every (n, vocab) tensor exists only inside this call. Only the trained side
    has a gradient."""
    logits = _float32_at_least(torch.nn.functional.linear(states, weight))
    log_probs = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        base_logits = _float32_at_least(torch.nn.functional.linear(base_states, base_weight))
    cross_entropy = torch.nn.functional.nll_loss(log_probs, targets, reduction="sum")
    if temperature != 1:
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
    base_log_probs = torch.log_softmax(base_logits / temperature, dim=-1)
    return cross_entropy, _summed_divergence(log_probs, base_log_probs)


def _float32_at_least(logits: torch.Tensor) -> torch.Tensor:
    """16-bit logits (autocast) in float32; a float64 model's stay float64."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _summed_divergence(log_probs: torch.Tensor, base_log_probs: torch.Tensor) -> torch.Tensor:
    """sum over tokens and vocabulary of p_base * (log p_base - log p_trained). Log-softmax of
    finite logits is finite, so exp(target) * (target - input) never meets 0 * inf."""
    return torch.nn.functional.kl_div(log_probs, base_log_probs, reduction="sum", log_target=True)


def _base_forward(
    model: nn.Module, preserve: BasePreservation, inputs: dict, batch: dict, *, deferred: bool
) -> tuple[torch.Tensor, nn.Module]:
    """The starting model's (or teacher's) `logits` output for `inputs` (its decoder hidden
    states when `deferred`), computed without a graph, and the Whisper model it came from. A
    packed per-clip `batch` is routed through the reference's own encoder and decoder as
    through the trained model's."""
    with torch.no_grad():
        if preserve.reference is None:  # LoRA: the same weights, adapters off
            peft_model = unwrapped(model)
            if not is_peft_model(peft_model):
                raise ValueError("BasePreservation without a reference needs a peft model")
            whisper = whisper_of(peft_model)
            projection = _projection_deferred(whisper) if deferred else contextlib.nullcontext()
            with peft_model.disable_adapter(), _evaluating(peft_model), projection:
                return peft_model(**inputs).logits, whisper
        reference, whisper = preserve.reference, whisper_of(unwrapped(model))
        if "encoder_outputs" in inputs and not preserve.shares_encoder:
            # Cached outputs are the trained model's encoder's, not this reference's.
            raise ValueError("a reference with an encoder of its own needs the batch's audio")
        target = whisper.proj_out.weight
        if (reference.proj_out.weight.device, reference.proj_out.weight.dtype) != (
            target.device,
            target.dtype,
        ):
            # Built before the model moved (accelerator.prepare) or was cast: follow it, once.
            reference.to(device=target.device, dtype=target.dtype)
        projection = _projection_deferred(reference) if deferred else contextlib.nullcontext()
        autocast = contextlib.nullcontext()
        if preserve.autocast_dtype is not None:
            autocast = torch.autocast(target.device.type, dtype=preserve.autocast_dtype)
        with _evaluating(reference), projection, autocast, clips_routed(reference, batch):
            return reference(**inputs).logits, reference


def _shares_encoder_pass(preserve: BasePreservation, whisper: nn.Module) -> bool:
    """Whether the reference may read the trained model's encoder outputs: it shares that
    (frozen) encoder, and the trained forward's encoder pass is the clean one the reference's
    own would be (no SpecAugment, dropout or layerdrop in it)."""
    if preserve.reference is None or not preserve.shares_encoder:
        return False
    config = whisper.config
    randomised = config.apply_spec_augment or config.dropout or config.encoder_layerdrop
    return not (whisper.training and randomised)


class _EncoderOutput:
    """The encoder outputs one forward made (None: the forward ran no encoder)."""

    value: torch.Tensor | None = None


@contextlib.contextmanager
def _encoder_output_kept(whisper: nn.Module, kept: _EncoderOutput, *, enabled: bool):
    """Inside, the encoder's output of the model's forward is kept in `kept.value` (as the
    decoder reads it: a per-clip micro-batch's gathered clips, `clip_attention`, whose hook
    runs first)."""
    if not enabled:
        yield
        return

    def keep(module, args, output):
        kept.value = output[0]

    handle = whisper.model.encoder.register_forward_hook(keep)
    try:
        yield
    finally:
        handle.remove()


def _teacher_on_encoded(
    model: nn.Module,
    preserve: BasePreservation,
    inputs: dict,
    encoded: torch.Tensor,
    batch: dict,
) -> tuple[torch.Tensor, nn.Module]:
    """The reference's decoder hidden states at every position, its decoder run on `encoded`
    (the encoder outputs the trained model's forward made, of the encoder both share), without
    a graph; a per-clip micro-batch's clips cross-attend to their own positions as the trained
    decoder's do (the trained model's router's mask, `clip_attention`)."""
    shared = {"decoder_input_ids": inputs["decoder_input_ids"]}
    shared["encoder_outputs"] = BaseModelOutput(last_hidden_state=encoded)
    whisper = whisper_of(unwrapped(model))
    masked = contextlib.nullcontext()
    if clip_route(batch) is not None:
        masked = _cross_attention_masked(preserve.reference, route_clips(whisper))
    with masked:
        return _base_forward(model, preserve, shared, {}, deferred=True)


@contextlib.contextmanager
def _cross_attention_masked(reference: nn.Module, router) -> Iterator[None]:
    """Inside, `reference`'s decoder layers mask their cross-attention to the keys the trained
    model's last routed forward gathered, as that model's own layers do."""
    handles = [
        layer.encoder_attn.register_forward_pre_hook(router.cross_attention_hook, with_kwargs=True)
        for layer in reference.model.decoder.layers
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _same_weights(module: nn.Module, other: nn.Module) -> bool:
    """Whether two modules hold equal tensors under the same names."""
    mine, theirs = module.state_dict(), other.state_dict()
    return mine.keys() == theirs.keys() and all(
        mine[name].shape == theirs[name].shape
        and mine[name].dtype == theirs[name].dtype
        and torch.equal(mine[name], theirs[name].to(mine[name].device))
        for name in mine
    )


def _full_vocabulary_terms(
    model: nn.Module, inputs: dict, batch: dict, preserve: BasePreservation
) -> LossTerms:
    """Both sides' full logits, for LoRA on the output head, where the plain loss already takes
    the model's full-vocabulary loss: the base's (batch, T, vocab) exists without a graph."""
    labels, temperature = batch["labels"], preserve.temperature
    base_logits, _ = _base_forward(model, preserve, inputs, batch, deferred=False)
    with clips_routed(whisper_of(unwrapped(model)), batch):
        output = model(**inputs, labels=labels)
    keep = labels.to(output.logits.device) != IGNORE_INDEX
    log_probs = (_float32_at_least(output.logits[keep]) / temperature).log_softmax(dim=-1)
    base_logits = _float32_at_least(base_logits[keep.to(base_logits.device)]) / temperature
    base_log_probs = base_logits.log_softmax(-1)
    divergence = _summed_divergence(log_probs, base_log_probs.to(log_probs.device))
    divergence = divergence / max(int(keep.sum()), 1)
    return _combined(output.loss, divergence, preserve)


@contextlib.contextmanager
def _evaluating(module: nn.Module) -> Iterator[None]:
    """Inside, every submodule of `module` is in eval mode; after, each is back in its own mode
    (set one by one: `train()` would make them all alike)."""
    modes = [(m, m.training) for m in module.modules()]
    for m, _ in modes:
        m.training = False
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _projection_deferred(whisper: nn.Module) -> Iterator[None]:
    """Inside, the model's `logits` output is the decoder's hidden states: the output projection
    (`proj_out`, tied to the token embedding) passes its input through. Only this instance's
    forward is shadowed: weights, state dict and tying are untouched."""
    projection = whisper.proj_out
    projection.forward = _pass_through
    try:
        yield
    finally:
        del projection.forward


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


__all__ = ["LOSS_CHUNK_TOKENS", "BasePreservation", "LossTerms", "loss_terms", "training_loss"]
