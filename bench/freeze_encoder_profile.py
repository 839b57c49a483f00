"""Where a freeze-encoder step with cached encoder outputs spends its time (issue: "profile the
3.8x").

    OMP_NUM_THREADS=1 .venv/bin/python bench/freeze_encoder_profile.py [--batch-size 8]
        [--label-tokens 30] [--steps 4] [--rounds 3] [--dims tiny|base|small]

A cached epoch runs only the decoder: the features and the encoder are skipped (the dataset
hands the cached encoder output instead of decoding the clip, `features.SpeechDataset`). What
is left is the step whisper-train runs (`memory.prepare_model(mode="freeze-encoder")`,
`memory.training_loss` on `encoder_hidden_states`, backward, `memory.build_optimizer`, step),
here on random weights of a real model's dimensions (same cost as the real weights) and
random cached outputs of the encoder's 1500 positions. torch.profiler's operator times are
grouped by what the operator works on:

  over 1500 encoder positions  an input has the 1500 positions: the decoder's cross-attention
                               key/value projections of the cached outputs (and their weight
                               gradients), its scores and weighted sums over 1500 keys
  vocabulary logits            an input has the vocabulary's width: the chunked loss's logits,
                               the tied embedding's gradient
  optimizer step               timed apart (its operators work on the same shapes)
  rest                         the decoder's own layers on the label tokens, and the rest

Each step runs twice, alternating: with the decoder's cross-attention in the folded order
whisper-train uses on cached outputs (`memory.cross_attention`) and in the layer's own order
(the keys and values of all 1500 positions projected first). One process, one thread, CPU
time; a warm-up step is not counted. Profiling adds a little to
every operator; the forward and backward's CPU seconds are those of the profiled run, shared
out by the operators' self times.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

DIMS = {  # (d_model, heads, decoder layers, ffn, vocabulary) of OpenAI's checkpoints
    "tiny": (384, 6, 4, 1536, 51864),
    "base": (512, 8, 6, 2048, 51865),
    "small": (768, 12, 12, 3072, 51865),
}


def build(dims: str):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from whisper_train.memory import prepare_model

    d_model, heads, layers, ffn, vocab = DIMS[dims]
    config = WhisperConfig(
        vocab_size=vocab,
        d_model=d_model,
        encoder_layers=1,  # never run: the encoder's outputs are cached
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_source_positions=1500,
        max_target_positions=448,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model = prepare_model(model, mode="freeze-encoder", checkpointing="off")
    model.train()
    return model, config


def category(event, vocab: int, positions: tuple[int, ...]) -> str:
    shapes = [tuple(shape) for shape in (event.input_shapes or []) if shape]
    if any(vocab in shape for shape in shapes):
        return "vocabulary logits"
    if any(n in shape for shape in shapes for n in positions):
        return "over 1500 encoder positions"
    return "rest"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", choices=sorted(DIMS), default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--label-tokens", type=int, default=30)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from whisper_train.memory import build_optimizer, training_loss

    torch.set_num_threads(1)
    model, config = build(args.dims)
    optimizer = build_optimizer(model, lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    tokens = args.label_tokens + 3  # a 3-token prompt prefix the loss skips
    ids = torch.randint(0, config.vocab_size - 1, (args.batch_size, tokens), generator=generator)
    labels = ids[:, 1:].clone()
    labels[:, :2] = -100
    batch = {
        "encoder_hidden_states": torch.randn(
            args.batch_size, 1500, config.d_model, generator=generator
        ),
        "decoder_input_ids": ids[:, :-1],
        "labels": labels,
    }

    def forward_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        training_loss(model, batch).backward()

    forward_backward()  # warm-up
    optimizer.step()
    # The optimizer's operators work on the same shapes as the layers' (the tied embedding is
    # vocabulary-wide), so it is timed apart from the profiled forward and backward.
    optimizer_seconds = timed_steps(optimizer, args.steps)
    # torch's AdamW without its fused kernel (the per-tensor loop `--optim adamw` used before),
    # on the same gradients: what the fused kernel saves.
    trained = [p for p in model.parameters() if p.requires_grad]
    unfused = torch.optim.AdamW(
        [
            {"params": [p for p in trained if p.ndim >= 2]},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-5,
    )
    unfused.step()
    unfused_seconds = timed_steps(unfused, args.steps)
    orders = {"folded": True, "own order": False}  # the cross-attention's, see below
    tables = {}
    for _ in range(args.rounds):  # alternating, so both orders meet the same machine load
        for order, folding in orders.items():
            with cross_attention_order(folding):
                spent = profiled_step(forward_backward, args, config.vocab_size)
            spent["optimizer step"] = optimizer_seconds
            tables.setdefault(order, []).append(spent)
    medians = {
        order: {name: statistics.median(run[name] for run in runs) for name in runs[0]}
        for order, runs in tables.items()
    }
    totals = {order: sum(parts.values()) for order, parts in medians.items()}
    print(
        f"{args.dims} dims, batch {args.batch_size}, {args.label_tokens} label tokens, "
        f"{args.steps} steps x {args.rounds} rounds a column (medians)\n"
    )
    print("| part of the step | own order: CPU s | share | folded: CPU s | share |")
    print("|---|---:|---:|---:|---:|")
    own, folded = medians["own order"], medians["folded"]
    for name in sorted(own, key=lambda n: -own[n]):
        print(
            f"| {name} | {own[name]:.3f} | {100 * own[name] / totals['own order']:.0f}% "
            f"| {folded[name]:.3f} | {100 * folded[name] / totals['folded']:.0f}% |"
        )
    print(
        f"| **step** | **{totals['own order']:.3f}** | | **{totals['folded']:.3f}** | "
        f"({totals['own order'] / totals['folded']:.2f}x) |"
    )
    fused = getattr(optimizer, "defaults", {}).get("fused")
    print(
        f"\noptimizer step: {optimizer_seconds:.3f} CPU s (`--optim adamw`, fused kernel: "
        f"{bool(fused)}); torch's AdamW without it: {unfused_seconds:.3f} s "
        f"({unfused_seconds / optimizer_seconds:.1f}x)"
    )


def timed_steps(optimizer, steps: int) -> float:
    """CPU seconds of one optimizer step, the mean of `steps` (gradients left as they are)."""
    start = time.process_time()
    for _ in range(steps):
        optimizer.step()
    return (time.process_time() - start) / steps


@contextlib.contextmanager
def cross_attention_order(folding: bool):
    """The loss's cross-attention in the folded order (whisper-train's) or the layer's own."""
    from whisper_train.memory import loss

    real = loss.folded_cross_attention
    if not folding:
        loss.folded_cross_attention = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        loss.folded_cross_attention = real


def profiled_step(forward_backward, args, vocab: int) -> dict[str, float]:
    """CPU seconds of one forward and backward, shared out by operator self times."""
    from torch.profiler import ProfilerActivity, profile

    forward_backward()  # warm-up in this order
    start = time.process_time()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            forward_backward()
    seconds = (time.process_time() - start) / args.steps
    # Self CPU time of each operator (no double counting of nested ones), by what it works on.
    spent = {"over 1500 encoder positions": 0.0, "vocabulary logits": 0.0, "rest": 0.0}
    positions = (1500, 1500 * args.batch_size)  # the projections see (batch x 1500, d)
    for event in prof.key_averages(group_by_input_shape=True):
        spent[category(event, vocab, positions)] += event.self_cpu_time_total
    profiled = sum(spent.values())
    return {name: seconds * part / profiled for name, part in spent.items()}


if __name__ == "__main__":
    main()
