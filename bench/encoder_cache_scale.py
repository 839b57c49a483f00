"""Freeze-encoder time to step 1 against corpus size: the encoder cache's cost before training.

    .venv/bin/python bench/encoder_cache_scale.py [--rows 1000,100000] [--clips 300]
        [--source SRC ...] [--timeout 600]

Data as `bench/data_scale.py` writes it (its functions, imported): a JSONL manifest of N rows,
each a hard link of its own to one of --clips short tone WAVs, so every row is a distinct path
(a distinct clip to the cache). Model: the random tiny Whisper of tests/tiny_models.py.

Per N and --source, one fresh subprocess per run (the package imported anew), with
`--mode freeze-encoder --batch-size 8 --only-train` and the user cache (`WHISPER_TRAIN_CACHE`)
in a folder of its own:
  cold  an empty encoder cache: `FineTuneRecipe.setup()`, then the loop until the first
        optimizer step returns. Reported: seconds to step 1, of which setup, clips encoded by
        then, files in the cache, peak RSS.
  warm  the same again on the cache the cold run left (a later run).
Before the encoder cache became lazy, setup encoded every clip (seconds ~ N x per-clip cost);
give the old sources with --source (`git archive <rev> src | tar -x -C /tmp/old`) to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from data_scale import write_clips, write_manifest, write_model  # noqa: E402


def time_to_step1_worker(manifest: str, model: str, output_dir: str) -> dict:
    """In this process: setup, then train until the first optimizer step returns."""
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    from transformers.models.whisper import modeling_whisper

    from whisper_train.config import RunConfig
    from whisper_train.training.recipe import FineTuneRecipe

    encoded = []
    forward = modeling_whisper.WhisperEncoder.forward

    def counting(self, input_features, *args, **kwargs):
        encoded.append(int(input_features.shape[0]))
        return forward(self, input_features, *args, **kwargs)

    modeling_whisper.WhisperEncoder.forward = counting
    config = RunConfig()
    config.update(
        {
            "data": manifest,
            "model": model,
            "output_dir": output_dir,
            "mode": "freeze-encoder",
            "batch_size": 8,
            "only_train": True,
            "max_steps": 1,
        }
    )
    start = time.perf_counter()
    recipe = FineTuneRecipe(config.validate())
    recipe.setup()
    setup_seconds = time.perf_counter() - start
    recipe.model.train()
    step = None
    for micro_batches in recipe.data.steps(recipe.state):
        step = recipe._train_step(micro_batches)
        if step is not None:
            break
    seconds = time.perf_counter() - start
    cache_root = Path(os.environ["WHISPER_TRAIN_CACHE"]) / "encoder"
    return {
        "seconds": seconds,
        "setup": setup_seconds,
        "encoded": sum(encoded),
        "files": sum(1 for _ in cache_root.rglob("*.safetensors")),
        "loss": None if step is None else step.loss,
    }


def run_worker(source: Path, args: list[str], cache: Path, timeout: float) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]),
        "WHISPER_TRAIN_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [sys.executable, __file__, "--worker", *args]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over {timeout:g} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:120]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def freeze_encoder_time_to_step1(
    rows: int,
    *,
    workdir: Path,
    model: Path,
    clips: list[Path],
    source: Path = REPO / "src",
    timeout: float = 600,
) -> dict[str, dict]:
    """{"cold": ..., "warm": ...}: seconds to the first optimizer step at `rows` rows, on an
    empty encoder cache and then on the one that run left."""
    data = workdir / f"data-{rows}"
    manifest = data / "manifest.jsonl"
    if not manifest.exists():
        write_manifest(data, clips, rows, distinct=False)
    cache = Path(tempfile.mkdtemp(dir=workdir, prefix="cache-"))
    results = {}
    for run in ("cold", "warm"):
        output_dir = Path(tempfile.mkdtemp(dir=workdir, prefix=f"out-{run}-"))
        args = [str(manifest), str(model), str(output_dir)]
        results[run] = run_worker(source, args, cache, timeout)
        if "error" in results[run]:
            break  # a warm run needs what the cold one left
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000,100000", help="Comma-separated row counts.")
    parser.add_argument("--clips", type=int, default=300, help="Distinct WAV files linked to.")
    parser.add_argument("--source", action="append", help="src folders to compare.")
    parser.add_argument("--timeout", type=float, default=600, help="Seconds per run.")
    parser.add_argument("--workdir", default=None, help="Keep data here (default: a temp dir).")
    args = parser.parse_args()
    sources = [Path(s).resolve() for s in args.source or [REPO / "src"]]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="encoder-cache-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = workdir / "tiny-whisper"
    if not model.exists():
        write_model(model)
    clips = write_clips(workdir / "clips", args.clips)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {workdir}")
    print("| rows | source | run | to step 1 (s) | setup (s) | clips encoded | cache files | RSS |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        for source in sources:
            results = freeze_encoder_time_to_step1(
                rows, workdir=workdir, model=model, clips=clips, source=source, timeout=args.timeout
            )
            for run, r in results.items():
                if "error" in r:
                    print(f"| {rows} | {source} | {run} | {r['error']} | | | | |")
                    continue
                print(
                    f"| {rows} | {source} | {run} | {r['seconds']:.1f} | {r['setup']:.1f} | "
                    f"{r['encoded']} | {r['files']} | {r['peak_rss_mb']:.0f} MB |",
                    flush=True,
                )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        result = time_to_step1_worker(*sys.argv[2:])
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
    else:
        main()
