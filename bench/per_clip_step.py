"""Per-clip packing's step: the encoder's self-attention span by span (each clip with its own
padding attending among themselves, the default on sdpa) against the block-diagonal bias over
whole windows (what every encoder layer was given before), on the same micro-batches,
alternated round by round in one process.

    .venv/bin/python bench/per_clip_step.py [--mode full|lora] [--rounds 3] [--batches 3]
        [--model tiny.en] [--work-dir DIR]

The model is the real tiny.en (or --model), the data the demo's 192 synthesised training
sentences (made once under WORK/data), `--packing auto` (per-clip) at batch 8 clips (2 windows
of ~4 clips), fp32, no checkpointing. A micro-batch is what a training step runs on it: the
model's forward with the clips routed, the loss, and backward (`memory.loss_terms`), gradients
then dropped; no optimizer. The first micro-batch warms up, untimed. Prints, per path, the
seconds a micro-batch in each round and their median, and the ratio of the medians.

The bias path is reached by telling the router its model attends eagerly (`ClipRouter.eager`):
it then builds the (W, 1, S, S) bias of `count_bias`, which sdpa adds to the scores, as before.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="full", choices=("full", "lora"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=3, help="micro-batches a round")
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()

    import torch

    from whisper_train.config import RunConfig
    from whisper_train.demo import prepare_demo_data
    from whisper_train.memory import clip_attention, loss_terms
    from whisper_train.memory.wrappers import whisper_of
    from whisper_train.training.checkpoints import TrainerState
    from whisper_train.training.recipe import FineTuneRecipe

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="per-clip-step-"))
    data = prepare_demo_data(
        work / "data", train_utterances=192, eval_utterances=8, guard_utterances=8, seed=0
    )
    torch.manual_seed(0)
    config = RunConfig()
    config.update(
        {
            "data": str(data["train"]),
            "model": args.model,
            "mode": args.mode,
            "output_dir": str(work / "run"),
            "overwrite": True,
            "only_train": True,
            "batch_size": 8,
            "max_steps": 1,
            "seed": 0,
        }
    )
    config.validate()
    recipe = FineTuneRecipe(config)
    recipe.setup()
    steps = recipe.data.steps(TrainerState())
    batches = [next(steps)[0] for _ in range(args.batches + 1)]
    model = recipe.model
    model.train()

    def run(batch) -> None:
        loss_terms(model, batch, preserve=None).loss.backward()
        model.zero_grad(set_to_none=True)

    run(batches[0])  # warm-up; installs the router
    router = clip_attention.route_clips(whisper_of(model))
    seconds: dict[str, list[float]] = {"span by span": [], "block-diagonal bias": []}
    for _ in range(args.rounds):
        for path in seconds:
            router.eager = path == "block-diagonal bias"
            start = time.perf_counter()
            for batch in batches[1:]:
                run(batch)
            seconds[path].append((time.perf_counter() - start) / args.batches)
    router.eager = False
    clips = [len(batch["texts"]) for batch in batches[1:]]
    windows = [int(batch["input_features"].shape[0]) for batch in batches[1:]]
    print(
        f"{args.model}, --mode {args.mode}, {torch.get_num_threads()} threads; micro-batches of "
        f"{windows} windows holding {clips} clips"
    )
    print("| encoder self-attention | s a micro-batch, each round | median | vs the bias |")
    print("|---|---|---:|---:|")
    base = statistics.median(seconds["block-diagonal bias"])
    for path, values in seconds.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{value:.2f}" for value in values)
        print(f"| {path} | {rounds} | {median:.2f} | {base / median:.2f}x |")


if __name__ == "__main__":
    main()
