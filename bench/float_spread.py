"""How far float32 training losses move on another CPU, and how far a recipe change moves them.

The tests compare losses of runs that should be the same run (a stored reference, N processes
vs one, cached vs recomputed encoder outputs) with one tolerance, `SAME_RUN_LOSS_ATOL` in
tests/conftest.py. This script is where that number comes from: it repeats the tests' reference
run (the seeded tiny model, 3 steps on tone clips) under other kernel paths of this machine,
standing in for other CPUs (ATen's generic kernels instead of AVX2/AVX-512, MKL and oneDNN held
to SSE4, one thread instead of two), and under small recipe changes that a test must catch.

    .venv/bin/python bench/float_spread.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

KERNEL_PATHS = {
    "this CPU, 2 threads": {"OMP_NUM_THREADS": "2"},
    "this CPU, 1 thread": {"OMP_NUM_THREADS": "1"},
    "generic kernels, SSE4 BLAS": {
        "OMP_NUM_THREADS": "1",
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
}
RECIPE_CHANGES = {
    "learning rate +10%": {"learning_rate": 1.1e-3},
    "batch size 3 (other clips a step)": {"batch_size": 3},
    "seed 1 (other order)": {"seed": 1},
}


def losses(workdir: Path, **overrides) -> list[float]:
    """The reference run of tests/conftest.py's tiny_run_config, with overrides."""
    from conftest import write_tone_dataset
    from tiny_models import make_tiny_whisper

    from whisper_train.config import RunConfig
    from whisper_train.training.train import train

    model_dir, data = workdir / "model", workdir / "tones"
    if not model_dir.exists():
        model, processor = make_tiny_whisper()
        model.save_pretrained(model_dir)
        processor.save_pretrained(model_dir)
        write_tone_dataset(data)
    config = RunConfig()
    config.update(
        {
            "data": str(data),
            "model": str(model_dir),
            "output_dir": str(workdir / f"run-{len(list(workdir.glob('run-*')))}"),
            "max_steps": 3,
            "batch_size": 4,
            "learning_rate": 1e-3,
            "seed": 0,
            "eval_split": 0.25,
            "only_train": False,  # as test_loss_matches_reference_and_metrics_are_written
            "generation_max_length": 8,
            **overrides,
        }
    )
    result = train(config)
    rows = (result.output_dir / "metrics.jsonl").read_text().splitlines()
    return [row["loss"] for row in map(json.loads, rows) if "loss" in row]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":  # one run in a fresh process
        print("LOSSES", json.dumps(losses(Path(sys.argv[2]))))
        return
    curves: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in KERNEL_PATHS.items():
            done = subprocess.run(
                [sys.executable, __file__, "--child", tmp],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                check=True,
            )
            line = next(x for x in done.stdout.splitlines() if x.startswith("LOSSES"))
            curves[name] = json.loads(line.removeprefix("LOSSES "))
        for name, overrides in RECIPE_CHANGES.items():
            curves[name] = losses(Path(tmp), **overrides)
    reference = curves["this CPU, 2 threads"]
    print("| run | losses after steps 1-3 | max abs difference from the first row |")
    print("|---|---|---|")
    for name, curve in curves.items():
        worst = max(abs(a - b) for a, b in zip(curve, reference, strict=True))
        print(f"| {name} | {', '.join(f'{x:.6f}' for x in curve)} | {worst:.1e} |")


if __name__ == "__main__":
    main()
