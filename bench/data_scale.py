"""Start-up cost against corpus size: time and memory before step 1, and check-data's time.

    .venv/bin/python bench/data_scale.py [--rows 1000,10000,100000,200000,1000000]
        [--clips 300] [--source SRC ...] [--timeout 900] [--freeze-encoder-rows N]

Data: for each N a JSONL manifest of N rows whose audio paths are all distinct (check-data and
`--strict` read one header per distinct path; a run reads the held-out evaluation set's before
step 1 and leaves the training set's to the loader). `--files links` (default): hard links to
--clips short tone WAVs
(1.2 s, 8/16/22.05 kHz, as tests/conftest.py writes them); check-data compares files by
content, so every link is a duplicate and is hashed whole: its worst case. `--files distinct`:
a 16-bit noise file of its own per row, 0.4-1.2 s (sizes mostly shared with a few others, as
in a real corpus). Transcripts are 3 to 12 words drawn from a word list.

Per N, two fresh subprocesses (nothing cached in memory, the package imported anew):
  startup  the recipe's phases before step 1 (`FineTuneRecipe` accelerator, model and labels,
           data, memory, loaders; the optimiser, resume and run log do not grow with N) on a
           random tiny Whisper, with `--gradient-checkpointing auto --max-memory 8GB
           --group-by-length`, so every per-example pass a run can make is made. Reported: the
           seconds of those phases, the process's peak RSS (`ru_maxrss`) by then, and "worker
           MB": the private memory (USS) of the larger of 2 forked DataLoader workers once they
           have read every training example (no audio decoded): the rows each worker copies.
  check    `check_data(manifest)` without a model (headers, duplicates, labels in characters).

The screening cache (`WHISPER_TRAIN_CACHE`) is pointed at an empty folder for every process,
so each startup is a first run. `--source` names one or more `src` folders to import
whisper_train from (default: this checkout's); give the old and the new to compare them side by
side in one run, e.g. `git archive HEAD src | tar -x -C /tmp/head` then
`--source /tmp/head/src src`. `--freeze-encoder-rows N` adds the column "freeze-encoder to step
1" at N rows (the same start-up with `--mode freeze-encoder`: the encoder cache's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]
LINKS_PER_FOLDER = 1000


# -- data -------------------------------------------------------------------------------------
def write_clips(folder: Path, count: int) -> list[Path]:
    import numpy as np
    import soundfile

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    clips = []
    for i in range(count):
        rate = (8000, 16000, 22050)[i % 3]
        t = np.arange(int(rate * 1.2)) / rate
        audio = 0.2 * np.sin(2 * np.pi * (200 + i) * t) + 0.01 * rng.standard_normal(t.size)
        path = folder / f"clip{i:04d}.wav"
        soundfile.write(path, audio.astype(np.float32), rate)
        clips.append(path)
    return clips


def write_distinct(path: Path, index: int) -> None:
    """A clip of its own bytes and a length of 0.4 to 1.2 s, as distinct recordings are."""
    import numpy as np
    import soundfile

    rng = np.random.default_rng(index)
    samples = rng.integers(-3000, 3000, int(rng.integers(6400, 19200)), dtype=np.int16)
    soundfile.write(path, samples, 16000, subtype="PCM_16")


def write_manifest(folder: Path, clips: list[Path], rows: int, distinct: bool) -> Path:
    """`rows` rows, each naming its own file (relative to the manifest): a hard link to a clip,
    or with `distinct` a file of its own content."""
    import random

    rng = random.Random(rows)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "manifest.jsonl"
    with open(manifest, "w", encoding="utf-8") as out:
        for i in range(rows):
            sub = f"links/{i // LINKS_PER_FOLDER:05d}"
            if i % LINKS_PER_FOLDER == 0:
                (folder / sub).mkdir(parents=True, exist_ok=True)
            name = f"{sub}/utt{i:07d}.wav"
            if distinct:
                write_distinct(folder / name, i)
            else:
                os.link(clips[i % len(clips)], folder / name)
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
            out.write(json.dumps({"audio": name, "text": text}) + "\n")
    return manifest


def write_model(folder: Path) -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_tiny_whisper

    model, processor = make_tiny_whisper()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


# -- workers (one subprocess each) ------------------------------------------------------------
def loader_worker_memory(examples, workers: int = 2) -> float:
    """The largest private memory (USS, MB) of `workers` forked DataLoader workers that have
    read every one of `examples` (the training set's container), shuffled, without decoding
    any audio (that would take minutes): what the workers copy of the parent's rows."""
    import psutil
    import torch

    class ExamplesOnly(torch.utils.data.Dataset):
        def __len__(self):
            return len(examples)

        def __getitem__(self, index):
            return examples[index]  # sent back pickled: every field read, as the loader does

    loader = torch.utils.data.DataLoader(
        ExamplesOnly(), batch_size=64, shuffle=True, num_workers=workers, collate_fn=list
    )
    batches = iter(loader)
    for _ in range(len(loader) - 1):  # the workers have read (almost) all; still alive
        next(batches)
    children = psutil.Process().children()
    largest = max(child.memory_full_info().uss for child in children) / 2**20
    for _ in batches:
        pass
    return largest


def startup_worker(manifest: str, model: str, output_dir: str, mode: str) -> dict:
    import torch

    torch.set_num_threads(min(2, torch.get_num_threads()))
    import whisper_train.training.recipe as recipe_module
    import whisper_train.training.setup_phases as setup_phases
    from whisper_train.config import RunConfig
    from whisper_train.training.recipe import FineTuneRecipe

    config = RunConfig()
    config.update(
        {
            "data": manifest,
            "model": model,
            "output_dir": output_dir,
            "gradient_checkpointing": "auto",
            "max_memory": "8GB",
            "group_by_length": True,
            "mode": mode,
            "max_steps": 1,
        }
    )
    recipe = FineTuneRecipe(config)
    phases = {}
    start = time.perf_counter()

    def timed(phase, build):
        def run(*args, **kwargs):
            began = time.perf_counter()
            built = build(*args, **kwargs)
            phases[phase] = time.perf_counter() - began
            return built

        return run

    # The recipe's set-up, each phase timed where `FineTuneRecipe.setup` calls it (an older
    # --source names its phases otherwise: those it has), and "data": reading and screening.
    for phase in (
        "gather_facts",
        "load_model_and_labels",
        "prepare_data",
        "plan_data",
        "resolve_run",
        "setup_accelerator",
        "setup_memory",
        "setup_loaders",
    ):
        if hasattr(recipe_module, phase):
            setattr(recipe_module, phase, timed(phase, getattr(recipe_module, phase)))
    setup_phases.prepare_datasets = timed("data", setup_phases.prepare_datasets)
    recipe.setup()
    seconds = time.perf_counter() - start
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "seconds": seconds,
        "phases": phases,
        "train": len(recipe.datasets.train),
        "peak_rss_mb": peak_rss_mb,  # before the loader workers below
        "worker_mb": loader_worker_memory(recipe.data.dataset.examples),
    }


def check_worker(manifest: str) -> dict:
    from whisper_train.checkdata import check_data

    start = time.perf_counter()
    report = check_data(manifest)
    return {"seconds": time.perf_counter() - start, "problems": len(report.problems)}


def run_worker(source: Path, kind: str, args: list[str], cache: Path, timeout: float) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]),
        "WHISPER_TRAIN_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    command = [sys.executable, __file__, "--worker", kind, *args]
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


def worker_main(kind: str, args: list[str]) -> None:
    result = startup_worker(*args) if kind == "startup" else check_worker(*args)
    result.setdefault("peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(result))


# -- the table ---------------------------------------------------------------------------------
def _cell(result: dict, key: str, fmt: str) -> str:
    return result["error"] if "error" in result else format(result[key], fmt)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1000,10000,100000,200000,1000000")
    parser.add_argument("--clips", type=int, default=300)
    parser.add_argument("--source", nargs="+", default=[str(REPO / "src")])
    parser.add_argument("--timeout", type=float, default=900, help="seconds per subprocess")
    parser.add_argument("--freeze-encoder-rows", type=int, default=0)
    parser.add_argument("--skip-check-data", action="store_true")
    parser.add_argument(
        "--files",
        choices=("links", "distinct"),
        default="links",
        help="links: hard links to --clips files (check-data then finds every file a duplicate "
        "and must hash all of them whole: its worst case); distinct: a file of its own bytes "
        "per row (disk: ~25 KB a row)",
    )
    options = parser.parse_args()
    rows = [int(n) for n in options.rows.split(",")]
    sources = [Path(s).resolve() for s in options.source]

    print("command: " + " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]))
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory(prefix="data-scale-") as tmp:
        root = Path(tmp)
        clips = write_clips(root / "clips", options.clips)
        model = str(write_model(root / "model"))
        print(
            f"data: {options.files}; {options.clips} clips of 1.2 s, "
            f"{clips[0].stat().st_size} B each or less"
        )
        header = (
            f"{'source':<28} {'rows':>8} {'start-up s':>10} {'data s':>8} {'peak RSS MB':>11} "
            f"{'worker MB':>9} {'check-data s':>12}"
        )
        if options.freeze_encoder_rows:
            header += f" {'freeze-enc s':>12}"
        print(header)
        for n in rows:
            manifest = write_manifest(root / f"n{n}", clips, n, options.files == "distinct")
            for source in sources:
                label = str(source)[-28:]
                cache = Path(tempfile.mkdtemp(dir=root, prefix="cache-"))
                out = Path(tempfile.mkdtemp(dir=root, prefix="out-"))
                startup = run_worker(
                    source,
                    "startup",
                    [str(manifest), model, str(out / "run"), "full"],
                    cache,
                    options.timeout,
                )
                check = {"error": "skipped"}
                if not options.skip_check_data:
                    check = run_worker(source, "check", [str(manifest)], cache, options.timeout)
                line = (
                    f"{label:<28} {n:>8} {_cell(startup, 'seconds', '.2f'):>10} "
                    f"{_cell({**startup, **startup.get('phases', {})}, 'data', '.2f'):>8} "
                    f"{_cell(startup, 'peak_rss_mb', '.0f'):>11} "
                    f"{_cell(startup, 'worker_mb', '.0f'):>9} "
                    f"{_cell(check, 'seconds', '.2f'):>12}"
                )
                if options.freeze_encoder_rows:
                    frozen = {"error": "-"}
                    if n == options.freeze_encoder_rows:
                        frozen = run_worker(
                            source,
                            "startup",
                            [str(manifest), model, str(out / "frozen"), "freeze-encoder"],
                            Path(tempfile.mkdtemp(dir=root, prefix="cache-")),
                            options.timeout,
                        )
                    line += f" {_cell(frozen, 'seconds', '.2f'):>12}"
                print(line, flush=True)
            # Links of the larger manifests would fill the disk's inodes: one N at a time.
            subprocess.run(["rm", "-rf", str(root / f"n{n}")], check=True)


if __name__ == "__main__":
    main()
