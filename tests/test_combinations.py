"""The options users combine, covered pairwise: each combination trains 2 steps with its
invariants, or is refused at start in one line that names the flags.

The factors (`FACTORS`) are the training options that interact: mode, processes, gradient
accumulation, checkpointing, packing, streamed shards or lhotse cuts, --fsdp, the encoder
cache, precision, LoRA's targets (and DoRA), --resume, data-loading workers, the trackers of
--report-to, settings given as flags or in a YAML --config, --prompt-probability, --nonspeech,
bad clips among the training data (missing, empty, unreadable), --new-language (a language
token added to a multilingual model), and evaluation during the run (a speech set and a
non-speech set held to --max-nonspeech-rise) with --average-checkpoints, or --only-train,
--group-by-length, and distillation (--teacher, a student of 1 of the model's 2 decoder layers). A
seeded greedy generator (`covering_array`) picks rows until every pair of values
that some valid row can hold is in a row (the 3-wise array is the slow test). Pairs no row may
hold (`REFUSED`) are each tested to be refused.

Every training row is compared with its twin: the same mode, data, packing, precision and
targets, trained in this process without anything else (1 process, no accumulation, no
checkpointing, no cache, no --fsdp, no workers, flags, uninterrupted) at the same global batch.
The row's losses must be the twin's: N processes = 1 process, batch b x accumulation a = batch
a*b, recomputed = stored activations, cached = computed encoder outputs, sharded = whole,
resumed = uninterrupted, workers = none, trackers = TensorBoard alone, YAML = flags, bad clips
skipped = never there (and each named once a run, whichever process read it). Each step holds every training clip (a
step is the whole data), so equal losses need neither the same order nor the same split of
clips over processes, only every clip once a step. A row also checks that every parameter its
mode trains gets a nonzero gradient (observed at the optimizer step,
`install_gradient_observer`) and that final/ changed exactly the weights those parameters are;
with MLflow and W&B, that each holds metrics.jsonl's numbers (read back from their files).
Twins are shared by the rows that have the same one.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (
    SAME_RUN_LOSS_ATOL,
    lora_on_the_decoder_only,
    metric_rows,
    train_in_subprocess,
    write_tone_dataset,
)
from safetensors.torch import load_file
from test_lhotse import write_cut_windows
from test_streaming import write_shards
from test_trackers import assert_trackers_hold_the_metrics, tracker_env

from whisper_train.cli import main
from whisper_train.config.resolve import choose_packing

FACTORS: dict[str, tuple] = {
    "mode": ("full", "lora", "freeze-encoder"),
    "nproc": (1, 2),
    "accumulation": (1, 2),
    "checkpointing": ("off", "full", "every-2"),
    "packing": ("off", "on", "per-clip"),
    # an audiofolder read whole, WebDataset .tar shards, or a lhotse CutSet with --streaming (its
    # cuts windows of one recording; read whole, cuts become the examples "whole" stands for)
    "data": ("whole", "stream", "cuts"),
    "fsdp": (False, True),
    "cache": (False, True),  # --cache-encoder, else --no-cache-encoder (freeze-encoder's default)
    "precision": ("fp32", "bf16"),
    # LoRA's --lora-targets: the default (every linear layer), or the HF blog's q_proj,v_proj;
    # or every linear layer with --lora-variant dora (a magnitude per output trained beside A, B)
    "targets": ("all-linear", "q,v", "dora"),
    "resume": (False, True),  # 1 step and a checkpoint, then --resume for the second
    "workers": (0, 2),  # --num-workers
    # --report-to: the default, or every tracker (MLflow to a file store, W&B offline)
    "trackers": ("tensorboard", "tensorboard,mlflow,wandb"),
    "options": ("flags", "yaml"),  # the row's settings as flags, or in a --config file
    # --prompt-probability: off, or every clip with a previous text prompted with it
    "prompts": (0.0, 1.0),
    # the training data as it is, or with bad clips among it (`BAD_CLIPS`: a missing, an empty
    # and an unreadable file): each named once, and the good ones trained as the twin trains
    "bad": (False, True),
    # --nonspeech: none, or a clip of noise with an empty target (<|nospeech|>) mixed into the
    # data, in place of one speech clip so that a step still holds all of it (the default,
    # auto, is such a clip of the built-in set: tests/test_no_speech.py)
    "nonspeech": (False, True),
    # --new-language eo --new-language-init es --language eo on a tiny multilingual model (the
    # English-only one has no language tokens): its row trained (LoRA: peft's trainable token)
    "new_language": (False, True),
    # --only-train, or evaluated and averaged: a speech set and a non-speech set scored at
    # each step (--max-nonspeech-rise holding final/ to the latter), a checkpoint a step, and
    # --average-checkpoints 2 evaluated on both at the end (evaluation changes no loss)
    "judged": (False, True),
    # --group-by-length: a step's clips drawn by label length (the noise of --nonspeech dealt
    # evenly through the steps, `step_plan.WholePlan`); a step here holds all the data either way
    "grouped": (False, True),
    # --quantize-base: LoRA's frozen base as loaded, or in bitsandbytes' 8-bit (int8) or 4-bit
    # NF4 layers (its twin holds it so too; final/ is the adapters merged into the original
    # weights)
    "quantize": ("none", "int8", "nf4"),
    # --teacher (distillation): the tiny model teaches a student of 1 of its 2 decoder layers
    # (--decoder-layers 1) on CE + KL at T=2; its twin distils too
    "distill": (False, True),
}
NAMES = list(FACTORS)

# Pairs no run may hold, each refused before training with one line naming (all of) these.
REFUSED: dict[tuple[tuple[str, object], tuple[str, object]], tuple[str, ...]] = {
    (("fsdp", True), ("nproc", 1)): ("--fsdp", "--nproc 2"),
    (("cache", True), ("mode", "full")): ("--cache-encoder", "--mode freeze-encoder"),
    (("cache", True), ("data", "stream")): ("--cache-encoder", "streamed"),
    (("cache", True), ("packing", "on")): ("--packing on", "--no-cache-encoder"),
    (("cache", True), ("packing", "per-clip")): ("--packing per-clip", "--no-cache-encoder"),
    (("data", "stream"), ("packing", "per-clip")): ("--packing per-clip", "streamed"),
    (("cache", True), ("data", "cuts")): ("--cache-encoder", "streamed"),
    (("data", "cuts"), ("packing", "per-clip")): ("--packing per-clip", "streamed"),
    (("cache", True), ("fsdp", True)): ("--fsdp", "--no-cache-encoder"),
    (("data", "stream"), ("prompts", 1.0)): ("--prompt-probability", "streamed"),
    (("data", "cuts"), ("prompts", 1.0)): ("--prompt-probability", "streamed"),
    (("data", "stream"), ("nonspeech", True)): ("--nonspeech", "streamed"),
    (("data", "cuts"), ("nonspeech", True)): ("--nonspeech", "streamed"),
    (("mode", "full"), ("targets", "dora")): ("--lora-variant dora", "--mode full"),
    (("mode", "freeze-encoder"), ("targets", "dora")): ("--lora-variant dora", "--mode freeze"),
    (("fsdp", True), ("judged", True)): ("--average-checkpoints", "--fsdp"),
    (("packing", "on"), ("grouped", True)): ("--group-by-length", "--packing on"),
    (("packing", "per-clip"), ("grouped", True)): ("--group-by-length", "--packing per-clip"),
    (("data", "stream"), ("grouped", True)): ("--group-by-length", "streamed"),
    (("data", "cuts"), ("grouped", True)): ("--group-by-length", "streamed"),
    (("mode", "full"), ("quantize", "nf4")): ("--quantize-base nf4", "--mode full"),
    (("mode", "freeze-encoder"), ("quantize", "nf4")): ("--quantize-base nf4", "--mode lora"),
    (("fsdp", True), ("quantize", "nf4")): ("--quantize-base nf4", "--fsdp"),
    (("cache", True), ("quantize", "nf4")): ("--quantize-base nf4", "--no-cache-encoder"),
    (("mode", "full"), ("quantize", "int8")): ("--quantize-base int8", "--mode full"),
    (("mode", "freeze-encoder"), ("quantize", "int8")): ("--quantize-base int8", "--mode lora"),
    (("fsdp", True), ("quantize", "int8")): ("--quantize-base int8", "--fsdp"),
    (("cache", True), ("quantize", "int8")): ("--quantize-base int8", "--no-cache-encoder"),
    (("new_language", True), ("distill", True)): ("--new-language eo", "--teacher"),
}
# Pairs that mean nothing (no flag to refuse): --lora-targets only matters with --mode lora.
MEANINGLESS = {
    (("targets", "q,v"), ("mode", "full")),
    (("targets", "q,v"), ("mode", "freeze-encoder")),
}
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")


# One subprocess (three Pythons importing torch, ~20 s on this 2-core machine) per run of a
# 2-process row; a resumed row runs twice. The generator prefers rows that cost less.
def row_cost(row: dict) -> int:
    return (1 + row.get("resume", False)) if row.get("nproc") == 2 else 0


def _pair_key(a: tuple[str, object], b: tuple[str, object]):
    return tuple(sorted((a, b), key=lambda fv: NAMES.index(fv[0])))


FORBIDDEN = {_pair_key(*pair) for pair in [*REFUSED, *MEANINGLESS]}


def _consistent(assigned: dict) -> bool:
    """No forbidden pair among the values assigned so far, nor a streamed row whose step no
    plain twin holds (`TWINLESS`)."""
    items = list(assigned.items())
    for twinless in TWINLESS:
        if all(assigned.get(name) == value for name, value in twinless):
            return False
    return not any(_pair_key(a, b) in FORBIDDEN for a, b in itertools.combinations(items, 2))


# Each DataLoader worker batches its own share of a stream: with 2 workers, one micro-batch
# holds one worker's clips, so a step holds every clip only if it takes a micro-batch of each
# worker (accumulation 2). Without, a step of 2 workers is other clips than the twin's
# (measured: step 1 moved by 1.8e-2). A valid run, but one no plain twin repeats.
# Packed cuts with bad ones among them, read by 2 workers or processes: `datasets` deals the
# manifest's 8 parts (one cut each) in a new order each pass, so a worker may get 3 good cuts
# and the other 1, and a micro-batch of 2 windows then holds other clips than the twin's
# (unpacked, a micro-batch is a worker's 4 rows, bad or not; shards hold a bad clip each).
TWINLESS = tuple(
    (("data", stream), ("workers", 2), ("accumulation", 1)) for stream in ("stream", "cuts")
) + tuple(
    (("data", "cuts"), ("packing", "on"), ("bad", True), readers)
    for readers in (("workers", 2), ("nproc", 2))
)


def _tuples(row: dict, strength: int) -> set:
    return set(
        itertools.combinations(sorted(row.items(), key=lambda fv: NAMES.index(fv[0])), strength)
    )


def valid_tuples(strength: int) -> set:
    """Every `strength`-tuple of (factor, value) that some valid row holds."""
    found = set()
    for names in itertools.combinations(NAMES, strength):
        for values in itertools.product(*(FACTORS[name] for name in names)):
            partial = dict(zip(names, values, strict=True))
            if _completable(partial):
                found |= _tuples(partial, strength)
    return found


def _completable(assigned: dict) -> bool:
    """Whether some valid row holds `assigned` (a depth-first search, one factor at a time)."""
    if not _consistent(assigned):
        return False
    name = next((name for name in NAMES if name not in assigned), None)
    return name is None or any(_completable({**assigned, name: v}) for v in FACTORS[name])


def covering_array(strength: int = 2, *, seed: int = 0, candidates: int = 40) -> list[dict]:
    """Valid rows holding every valid `strength`-tuple at least once, by AETG's greedy: a row
    starts from the first uncovered tuple and fills the other factors one by one (in a random
    order) with the cheapest value, then the one that holds the most uncovered tuples; the best
    of `candidates` seeded tries is kept. (Seed 0 needed 6 launches of 2 processes, the best of
    seeds 0-19; choosing the values that hold the most tuples first needed 8. With lhotse cuts
    in the data factor, seed 0 needs 7, seeds 1-19 not compared again.)"""
    rng = random.Random(seed)
    uncovered = valid_tuples(strength)
    rows: list[dict] = []
    while uncovered:
        first = min(uncovered, key=lambda t: [(NAMES.index(f), str(v)) for f, v in t])
        best, best_score = None, None
        for _ in range(candidates):
            row = _greedy_row(dict(first), strength, uncovered, rng)
            if row is None:
                continue
            score = (len(_tuples(row, strength) & uncovered), -row_cost(row))
            if best_score is None or score > best_score:
                best, best_score = row, score
        rows.append(best)
        uncovered -= _tuples(best, strength)
    return rows


def _greedy_row(row: dict, strength: int, uncovered: set, rng: random.Random) -> dict | None:
    """`row` completed one factor at a time, in a random order, each with the cheapest valid
    value that holds the most `uncovered` tuples; None if a factor is left no valid value."""
    rest = [name for name in NAMES if name not in row]
    rng.shuffle(rest)
    for name in rest:
        options = []
        for value in FACTORS[name]:
            trial = {**row, name: value}
            if _consistent(trial):
                gain = sum(
                    1 for t in _tuples(trial, strength) if t in uncovered and (name, value) in t
                )
                options.append((row_cost(trial), -gain, rng.random(), value))
        if not options:
            return None
        row[name] = min(options)[-1]
    return {name: row[name] for name in NAMES}


def row_id(row: dict) -> str:
    parts = [row["mode"], f"np{row['nproc']}", f"acc{row['accumulation']}", row["checkpointing"]]
    parts += {"off": [], "on": ["pack"], "per-clip": ["perclip"]}[row["packing"]]
    parts += [row["data"]] * (row["data"] != "whole")
    parts += ["fsdp"] * row["fsdp"] + ["cache"] * row["cache"] + [row["precision"]]
    parts += ["qv"] * (row["targets"] == "q,v") + ["dora"] * (row["targets"] == "dora")
    parts += ["resume"] * row["resume"]
    parts += [f"w{row['workers']}"] * bool(row["workers"]) + ["yaml"] * (row["options"] == "yaml")
    parts += ["trackers"] * (row["trackers"] != "tensorboard")
    parts += ["prompts"] * bool(row.get("prompts"))
    parts += ["nonspeech"] * bool(row.get("nonspeech"))
    parts += ["decoder-adapters"] * row.get("decoder_adapters", False)
    parts += ["bad"] * row.get("bad", False)
    parts += ["newlang"] * row.get("new_language", False)
    parts += ["averaged"] * row.get("judged", False)
    parts += ["grouped"] * row.get("grouped", False)
    parts += [f"quantize-{row['quantize']}"] * (row.get("quantize", "none") != "none")
    parts += ["distill"] * row.get("distill", False)
    return "-".join(parts)


# Seed 16: of seeds 0-19 with --group-by-length among the factors, the cheapest in launches of
# 2 processes (`row_cost`): 8 in 19 rows (seeds 3, 5 and 18: 8 in 20 or 21; the others 9 to 11).
# With --quantize-base among them, 9 in 22 rows, as cheap as any of seeds 0-16 (1, 3, 4, 10 and
# 12: 9 in 19 to 21 rows; the others 10 to 13).
# With --teacher among them, 10 in 23 rows (seeds not compared again). With int8 a level of
# --quantize-base, 10 in 24 rows (5 of them int8; seeds not compared again).
PAIRWISE = covering_array(2, seed=16)

# -- running a row ---------------------------------------------------------------------------

GLOBAL_BATCH = 4  # clips, or packed windows: all the training data, a step is a pass over it


def install_gradient_observer(out_dir: str, patch=setattr) -> None:
    """Log, at every optimizer step of this process, the parameters with a nonzero gradient
    (and once the ones that require one) to OUT_DIR/grads-RANK-PID.jsonl. Runs in the test's
    process (patch: monkeypatch.setattr) and, as sitecustomize, in each launched process.

    The gradients themselves, not moved weights: AdamW's first step moves a parameter with any
    nonzero gradient by ~lr however small it is, and a later step moves one whose gradient
    stopped reaching it by its momentum alone (with --fsdp: each process's shard, unioned)."""
    import json
    import os

    import whisper_train.memory as memory

    real_build = memory.build_optimizer

    def observed_build(model, *args, **kwargs):
        optimizer = real_build(model, *args, **kwargs)
        named = list(model.named_parameters())
        rank = os.environ.get("RANK", "0")
        log = os.path.join(out_dir, f"grads-{rank}-{os.getpid()}.jsonl")
        with open(log, "a") as file:
            trainable = [name for name, p in named if p.requires_grad]
            file.write(json.dumps({"trainable": trainable}) + "\n")

        def before_step(_optimizer, _args, _kwargs):
            nonzero = []
            for name, p in named:
                grad = p.grad
                if grad is None:
                    continue
                grad = grad.to_local() if hasattr(grad, "to_local") else grad  # --fsdp's shard
                if bool(grad.ne(0).any()):
                    nonzero.append(name)
            with open(log, "a") as file:
                file.write(json.dumps({"nonzero_grad": nonzero}) + "\n")

        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        torch_optimizer.register_step_pre_hook(before_step)
        return optimizer

    patch(memory, "build_optimizer", observed_build)


OBSERVER_SITECUSTOMIZE = (
    "import os\n\n"
    + inspect.getsource(install_gradient_observer)
    + "\n\nif os.environ.get('RANK') is not None and os.environ.get('MATRIX_GRADS_DIR'):\n"
    "    install_gradient_observer(os.environ['MATRIX_GRADS_DIR'])\n"
)


def observed_gradients(grads_dir: Path) -> tuple[set[str], set[str]]:
    """(parameters that required a gradient, parameters that got a nonzero one at some step of
    some process), with a LoRA model's `base_model.model.` prefix taken off."""
    trainable, nonzero = set(), set()
    for log in grads_dir.glob("grads-*.jsonl"):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            trainable |= set(entry.get("trainable", []))
            nonzero |= set(entry.get("nonzero_grad", []))
    strip = lambda names: {n.removeprefix("base_model.model.") for n in names}  # noqa: E731
    return strip(trainable), strip(nonzero)


def adapted_parts(row: dict) -> tuple[str, ...]:
    """Where LoRA's adapters go: the whole model, or the decoder alone on cached encoder
    outputs (computed once without gradient, an encoder adapter would never train)."""
    return ("model.decoder.",) if row["cache"] or row.get("decoder_adapters") else ("model.",)


def expected_trainable(row: dict, model) -> set[str]:
    """The parameters a mode trains, from Whisper's structure (not from whisper-train)."""
    if row["mode"] == "lora":
        targets = ("q_proj", "v_proj") if row["targets"] == "q,v" else ALL_LINEAR
        # DoRA: a magnitude vector per adapted layer besides A and B.
        parts = ("A", "B", "magnitude_vector") if row["targets"] == "dora" else ("A", "B")
        # --new-language: the new token's row, beside the adapters (peft's trainable tokens).
        token = {"model.decoder.embed_tokens.token_adapter.trainable_tokens_delta.default"}
        return {
            f"{name}.lora_{part}.default.weight"
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
            if name.startswith(adapted_parts(row))
            for part in parts
        } | (token if row.get("new_language") else set())
    # Whisper's encoder positions are fixed sinusoids (transformers freezes them).
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if row["mode"] == "freeze-encoder":
        trainable = {name for name in trainable if name.startswith("model.decoder.")}
    return trainable


def expected_changed_weights(row: dict, saved: dict) -> set[str]:
    """The tensors of final/model.safetensors that 2 steps must change (all others must not)."""
    if row["mode"] == "lora":  # the adapters merged into their linear layers' weights
        targets = ("q_proj", "v_proj") if row["targets"] == "q,v" else ALL_LINEAR
        # --new-language: the token embedding (one row more, that row trained).
        embedding = {"model.decoder.embed_tokens.weight"} if row.get("new_language") else set()
        return {
            n
            for n in saved
            if n.endswith(".weight") and n.split(".")[-2] in targets
            if n.startswith(adapted_parts(row))
        } | embedding
    if row["mode"] == "freeze-encoder":
        return {n for n in saved if n.startswith("model.decoder.")}
    return {n for n in saved if n != "model.encoder.embed_positions.weight"}


def write_long_clips(folder: Path, n: int, seconds: float, *, shards: int | None = None) -> Path:
    """`n` tone clips of `seconds` with 3-word transcripts: an audiofolder, or `shards`
    WebDataset .tar files of consecutive clips."""
    import io
    import tarfile

    import soundfile as sf

    rng = np.random.default_rng(1)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    folder.mkdir(parents=True)
    t = np.arange(int(16000 * seconds)) / 16000
    clips = []
    for i in range(n):
        text = " ".join(rng.choice(words, 3))
        audio = 0.2 * np.sin(2 * np.pi * (200 + 40 * i) * t) + 0.01 * rng.standard_normal(t.size)
        buffer = io.BytesIO()
        sf.write(buffer, audio.astype(np.float32), 16000, format="FLAC")
        clips.append((f"clip{i:03d}", buffer.getvalue(), text))
    if shards is None:
        for name, audio, _ in clips:
            (folder / f"{name}.flac").write_bytes(audio)
        lines = ["file_name,transcription"] + [f"{n}.flac,{text}" for n, _, text in clips]
        (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
        return folder
    per_shard = n // shards
    for shard in range(shards):
        with tarfile.open(folder / f"train-{shard:06d}.tar", "w") as tar:
            for name, audio, text in clips[shard * per_shard : (shard + 1) * per_shard]:
                for member, content in ((f"{name}.flac", audio), (f"{name}.txt", text.encode())):
                    info = tarfile.TarInfo(member)
                    info.size = len(content)
                    tar.addfile(info, io.BytesIO(content))
    return folder


def write_noise(folder: Path, seconds: float) -> Path:
    """A folder of one clip of noise, no transcript: --nonspeech's data."""
    import soundfile as sf

    folder.mkdir(parents=True)
    noise = 0.05 * np.random.default_rng(2).standard_normal(int(16000 * seconds))
    sf.write(folder / "noise.wav", noise.astype(np.float32), 16000)
    return folder


def with_previous_texts(folder: Path) -> Path:
    """The audiofolder with a previous_text column (the row before's transcript; none for the
    first row), which --prompt-probability prompts with and every other row ignores."""
    lines = (folder / "metadata.csv").read_text().splitlines()
    texts = [line.split(",", 1)[1] for line in lines[1:]]
    rows = [f"{line},{previous}" for line, previous in zip(lines[1:], ["", *texts], strict=False)]
    (folder / "metadata.csv").write_text("\n".join([lines[0] + ",previous_text", *rows]) + "\n")
    return folder


# Bad clips added to a row's training data: a missing file, an empty one, and two that are not
# audio (a few bytes of garbage, a text file), all named .wav (.flac in shards). Four, so that
# each of a stream's 4 shards or parts holds one: every DataLoader worker then reads one good
# clip and one bad one, and unpacked, a micro-batch of 2 rows is a worker's whole pass.
BAD_CLIPS = {
    "missing": None,
    "empty": b"",
    "garbage": b"RIFF\x04\x00\x00\x00WAVEjunk",
    "text": b"hello",
}


def with_bad_clips(path: Path, folder: Path) -> tuple[Path, list[str]]:
    """A copy of a row's training data (an audiofolder, WebDataset shards, or a cut manifest
    and its recording) in `folder` with BAD_CLIPS among it, and each bad clip's origin as the
    skip report prints it (followed by its detail in brackets)."""
    import gzip
    import io
    import shutil
    import tarfile

    source = path if path.is_dir() else path.parent
    shutil.copytree(source, folder)
    for name, content in BAD_CLIPS.items():
        if content is not None and not list(folder.glob("*.tar")):
            (folder / f"{name}.wav").write_bytes(content)
    shards = sorted(folder.glob("*.tar"))
    if shards:  # one bad sample appended to each shard
        origins = []
        for shard, (name, content) in zip(shards, BAD_CLIPS.items(), strict=True):
            with tarfile.open(shard) as tar:
                text_member = next(m for m in tar.getnames() if not m.endswith(".flac"))
                audio_member = next(m for m in tar.getnames() if m.endswith(".flac"))
                if content is None:  # no sample may lack its audio (`datasets` refuses the
                    # whole set): a file cut after its header stands for the missing one
                    content = tar.extractfile(audio_member).read()[:100]
            suffix = text_member.rsplit(".", 1)[1]
            label = "alpha bravo charlie"
            if suffix == "json":
                label = json.dumps({"text": label, "language": "en"})
            members = [(f"bad-{name}.{suffix}", label.encode()), (f"bad-{name}.flac", content)]
            with tarfile.open(shard, "a") as tar:
                for member, data in members:
                    info = tarfile.TarInfo(member)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
            origins.append(f"{shard.name}:bad-{name}")
        return folder, origins
    if path.is_dir():  # an audiofolder: rows appended to metadata.csv
        metadata = folder / "metadata.csv"
        lines = metadata.read_text().splitlines()
        extra = "," * lines[0].count(",", lines[0].index("transcription"))
        rows = [f"{name}.wav,alpha bravo charlie{extra}" for name in BAD_CLIPS]
        metadata.write_text("\n".join([*lines, *rows]) + "\n")
        first = len(lines) + 1  # a row's origin is its line number
        return folder, [f"metadata.csv:{first + i}" for i in range(len(BAD_CLIPS))]
    # A cut manifest: cuts of other recordings among the good ones. Row n is part n of the 8
    # (`lhotse_cuts.cut_examples`), which `datasets` deals to processes and workers in halves
    # or alternately: the good ones at rows 0, 3, 5 and 6 put one good and one bad cut in
    # every pair it may deal to a worker, and two of each in every half.
    manifest = folder / path.name
    with gzip.open(manifest, "rt") as rows:
        good = [json.loads(line) for line in rows if line.strip()]
    bad = []
    for name in BAD_CLIPS:
        cut = json.loads(json.dumps(good[0]))
        cut["id"] = f"bad-{name}"
        cut["start"] = 0.0
        cut["recording"]["id"] = f"rec-{name}"
        cut["recording"]["sources"][0]["source"] = f"{name}.wav"
        for supervision in cut["supervisions"]:
            supervision["recording_id"] = f"rec-{name}"
        bad.append(cut)
    cuts = [(good if row in (0, 3, 5, 6) else bad).pop(0) for row in range(8)]
    with gzip.open(manifest, "wt") as rows:
        rows.writelines(json.dumps(cut) + "\n" for cut in cuts)
    return manifest, [f"(cut bad-{name})" for name in BAD_CLIPS]


def data_of(row: dict, data: dict) -> Path:
    """The training data of `row`: its (data, packing)'s, with BAD_CLIPS among it if asked;
    with --nonspeech, one speech clip fewer (a clip of noise takes its place in a step; a
    stream refuses --nonspeech, its rows keep their data)."""
    key = (row["data"], row["packing"])
    speech = data["fewer"] if row.get("nonspeech") and row["data"] == "whole" else data
    return speech["bad"][key][0] if row.get("bad") else speech[key]


def without_last_clip(path: Path, folder: Path) -> Path:
    """A copy of the audiofolder `path` in `folder` without the last row of its metadata.csv."""
    import shutil

    shutil.copytree(path, folder)
    metadata = folder / "metadata.csv"
    metadata.write_text("\n".join(metadata.read_text().splitlines()[:-1]) + "\n")
    return folder


def multilingual_model(folder: Path) -> Path:
    """A saved seeded tiny multilingual Whisper (the --new-language rows' model)."""
    from multilingual import make_tiny_multilingual_whisper

    model, processor = make_tiny_multilingual_whisper(seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def matrix_data(tmp_path_factory, tiny_whisper_dir):
    """The tiny model and the training data of each (data, packing), each step all of it:

    unpacked, 4 short clips (a step of 4 clips); packed and read whole, 8 clips of 10 s, 2 to
    a window (a third would pass 30 s), so a step of 4 windows. A stream packs each process's
    own rows (no plan of the whole stream exists): 2 processes pack other windows than 1 (here
    step 1 moved by 3.5e-2), so the packed stream is 4 clips of 16 s, one to a window, the same
    windows however the rows are split. Streams are 4 WebDataset shards of a clip each, or 4
    cuts of one recording (a part of the manifest each): 2 processes x 2 workers read one each."""
    root = tmp_path_factory.mktemp("matrix")
    write_shards(root / "shards", "webdataset", [1, 1, 1, 1])
    data = {
        ("whole", "off"): with_previous_texts(write_tone_dataset(root / "whole", n=GLOBAL_BATCH)),
        ("stream", "off"): root / "shards",
        ("whole", "on"): with_previous_texts(write_long_clips(root / "long", 8, 10.0)),
        ("whole", "per-clip"): root / "long",  # the same windows, each clip decoded alone
        ("stream", "per-clip"): root / "long-shards",  # refused at start
        ("stream", "on"): write_long_clips(root / "long-shards", 4, 16.0, shards=4),
        ("cuts", "off"): write_cut_windows(root / "cuts", GLOBAL_BATCH, 1.2),
        ("cuts", "on"): write_cut_windows(root / "long-cuts", 4, 16.0),
        ("cuts", "per-clip"): root / "long-cuts" / "cuts.jsonl.gz",  # refused at start
    }
    fewer = {
        key: without_last_clip(path, root / "fewer" / f"{key[0]}-{key[1]}")
        for key, path in data.items()
        if key[0] == "whole"
    }
    return {
        **data,
        "noise": write_noise(root / "noise", 10.0),
        "model": tiny_whisper_dir,
        "multilingual": multilingual_model(root / "multilingual"),
        "twins": {},  # twin key -> its losses, shared by the rows
        "root": root,
        # the same data with the bad clips among it (`with_bad_clips`); their origins
        "bad": {
            key: with_bad_clips(path, root / "bad" / f"{key[0]}-{key[1]}")
            for key, path in data.items()
        },
        # --nonspeech's speech data (read whole: a stream refuses --nonspeech), and with bad clips
        "fewer": {
            **fewer,
            "bad": {
                key: with_bad_clips(path, root / "fewer-bad" / f"{key[0]}-{key[1]}")
                for key, path in fewer.items()
            },
        },
    }


def row_settings(row: dict) -> dict[str, object]:
    """The row's settings: {option: value as a user writes it}."""
    # --batch-size counts clips; packed data read whole has 2 a window (`matrix_data`), a
    # stream's packed windows are counted as windows (one clip each here).
    clips_a_window = 2 if row["packing"] != "off" and row["data"] == "whole" else 1
    if row.get("bad") and row["packing"] == "off":  # a step of 4 good clips and 4 bad ones
        clips_a_window = 2  # (packed, the bad ones are in no window, or a window's skips)
    settings = {
        "mode": row["mode"],
        "batch_size": clips_a_window * GLOBAL_BATCH // (row["nproc"] * row["accumulation"]),
        "gradient_accumulation": row["accumulation"],
        "gradient_checkpointing": row["checkpointing"],
        "packing": row["packing"],
        "precision": row["precision"],
        "cache_encoder": row["cache"],
        "num_workers": row["workers"],
        "report_to": row["trackers"].split(","),
    }
    if row.get("prompts"):
        settings["prompt_probability"] = row["prompts"]
    if row["nproc"] > 1:
        settings["nproc"] = row["nproc"]
    if row["fsdp"]:
        settings["fsdp"] = True
    if row["targets"] == "q,v":
        settings["lora_targets"] = ["q_proj", "v_proj"]
    if row["targets"] == "dora":
        settings["lora_variant"] = "dora"
    if row.get("new_language"):
        settings.update(new_language="eo", new_language_init="es", language="eo")
    if row.get("grouped"):
        settings["group_by_length"] = True
    if row.get("quantize", "none") != "none":
        settings["quantize_base"] = row["quantize"]
    if row.get("distill"):
        settings.update(teacher=str(DISTILL_TEACHER), decoder_layers=DISTILL_LAYERS)
    return settings


# The distill rows' teacher (the tiny model, `--model`'s: a student made from it reads no
# --model) and the depth of its student: 1 of its 2 decoder layers.
DISTILL_TEACHER = "MODEL"
DISTILL_LAYERS = 1


def student_tensors(teacher: dict) -> dict:
    """The tensors of a student of DISTILL_LAYERS made from `teacher`'s (a model file's):
    decoder layer `kept[i]` renamed to i, the other decoder layers left out."""
    from whisper_train.student import kept_decoder_layers

    kept = kept_decoder_layers(2, DISTILL_LAYERS)
    tensors = {}
    for name, tensor in teacher.items():
        if not name.startswith("model.decoder.layers."):
            tensors[name] = tensor
            continue
        index, rest = name.removeprefix("model.decoder.layers.").split(".", 1)
        if int(index) in kept:
            tensors[f"model.decoder.layers.{kept.index(int(index))}.{rest}"] = tensor
    return tensors


def row_flags(row: dict, data: dict, workdir: Path) -> list[str]:
    """`whisper-train train` arguments of `row` (less --max-steps and --resume), training into
    WORKDIR/out. With options "yaml", the row's settings are in WORKDIR/options.yaml, written
    as a user would (bare on, off, true, a list in brackets)."""
    settings = row_settings(row)
    if settings.get("teacher") == DISTILL_TEACHER:  # --model's, which it replaces
        settings["teacher"] = str(data["multilingual" if row.get("new_language") else "model"])
    if row["options"] == "yaml":
        lines = []
        for key, value in settings.items():
            if isinstance(value, bool):
                value = str(value).lower()
            elif isinstance(value, list):
                value = "[" + ", ".join(value) + "]"
            lines.append(f"{key}: {value}")
        config = workdir / "options.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text("\n".join(lines) + "\n")
        options = [f"--config={config}"]
    else:
        options = []
        for key, value in settings.items():
            flag = "--" + key.replace("_", "-")
            if isinstance(value, bool):
                options.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                options.append(f"{flag}={','.join(value)}")
            else:
                options.append(f"{flag}={value}")
    if row.get("nonspeech"):  # one speech clip fewer (`data_of`), one of noise: 1 of 4 or 8
        # The share is of the clips listed (`nonspeech_count`): bad ones are found only as they
        # are read, so 3 or 7 good clips and the 4 bad ones count 7 or 11. 0.09 (a tenth of
        # the listed clips, rounded) makes one clip of noise of each, as of the twin's 3 or 7;
        # 0.125 made two of 11 (step 1 moved by 1e-2).
        options += [f"--nonspeech={data['noise']}", "--nonspeech-share=0.09"]
    else:  # the default (auto) would mix a clip of builtin noise into data read whole
        options.append("--nonspeech=none")
    flags = [
        f"--data={data_of(row, data)}",
        *["--streaming"] * (row["data"] == "cuts"),
        f"--model={data['multilingual' if row.get('new_language') else 'model']}",
        f"--output-dir={workdir / 'out'}",
        *options,
        f"--encoder-cache-dir={workdir / 'encoder-cache'}",
        *(JUDGED_FLAGS(data) if row.get("judged") else ["--only-train"]),
        "--learning-rate=1e-3",
        # Constant: a --resume that changes --max-steps keeps the schedule of the first steps.
        "--lr-scheduler=constant_with_warmup",
        "--seed=0",
        # Each process and each micro-batch draws its own dropout masks: no twin could.
        "--lora-dropout=0",
    ]
    return flags


def JUDGED_FLAGS(data: dict) -> list[str]:  # noqa: N802 (a factor's flags, as ALL_LINEAR)
    """A judged row's evaluation: a speech clip and the clip of noise, no held-out split (a
    step keeps all the training data), scored at the start (the non-speech set's) and the end
    (and where a resumed row stops), a checkpoint a step, the last 2 averaged at the end."""
    return [
        "--eval-split=0",
        f"--eval-data=speech={data['whole', 'off']}",
        "--eval-subset=1",
        f"--eval-data=quiet:nonspeech={data['noise']}",
        "--max-nonspeech-rise=30",
        "--eval-steps=2",
        "--save-steps=1",
        "--average-checkpoints=2",
        "--generation-max-length=2",
        "--temperatures=0",
    ]


def run_row(row: dict, data: dict, workdir: Path, monkeypatch, capsys=None) -> tuple[Path, list]:
    """Train `row` (2 steps, or 1 then --resume for 1 more), its gradients observed; returns
    its output folder and what each invocation printed (in-process: read with `capsys`)."""
    out, grads = workdir / "out", workdir / "grads"
    grads.mkdir(parents=True)
    if row["trackers"] != "tensorboard":  # inherited by the processes of --nproc too
        tracker_env(monkeypatch, workdir)
    flags = row_flags(row, data, workdir)
    invocations = [["--max-steps=1", "--save-steps=1"], ["--max-steps=2", "--resume=latest"]]
    if not row["resume"]:
        invocations = [["--max-steps=2"]]
    printed = []
    if row["nproc"] == 1:
        install_gradient_observer(str(grads), patch=monkeypatch.setattr)
        if row.get("decoder_adapters"):  # a cached LoRA row's twin: its adapters, uncached
            lora_on_the_decoder_only(monkeypatch)
        for extra in invocations:
            if capsys is not None:
                capsys.readouterr()
            assert main(["train", *flags, *extra]) == 0
            printed.append(capsys.readouterr().out if capsys is not None else "")
        return out, printed
    hook = workdir / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(OBSERVER_SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.setenv("MATRIX_GRADS_DIR", str(grads))
    for extra in invocations:
        printed.append(train_in_subprocess([*flags, *extra]).stdout)
    return out, printed


def twin_of(row: dict) -> dict:
    """The plain run `row` must equal: 1 process, no accumulation, checkpointing, cache,
    sharding, interruption or workers, given as flags; the same mode, data, packing, precision
    and targets. LoRA on cached encoder outputs puts its adapters on the decoder only: so does
    its twin (in-process, without a flag for it)."""
    return {
        "decoder_adapters": row["mode"] == "lora" and row["cache"],
        **row,
        "nproc": 1,
        "accumulation": 1,
        "checkpointing": "off",
        "fsdp": False,
        "cache": False,
        "resume": False,
        "workers": 0,
        "trackers": "tensorboard",
        "options": "flags",
        "bad": False,
        "judged": False,
    }


def twin_losses(row: dict, data: dict, monkeypatch) -> list[float]:
    twin = twin_of(row)
    key = row_id(twin)
    if key not in data["twins"]:
        with monkeypatch.context() as patch:
            out, _ = run_row(twin, data, data["root"] / "twins" / key, patch)
        data["twins"][key] = [r["loss"] for r in metric_rows(out) if "loss" in r]
    return data["twins"][key]


# bf16 on a CPU: matrix products round their outputs to 8 significant bits (2^-9 = 2e-3
# relative), so two runs whose batches have other shapes (another split over processes or
# micro-batches) or whose encoder outputs come from the cache (stored as float16, then cast)
# round differently. Measured over this matrix's bf16 rows: 2e-4 at most. 1e-3 sits 5x above
# that, and 6.5x below the smallest real change conftest names (learning rate +10% moves
# step 2 by 6.5e-3); the same 8 clips packed into other windows moved step 1 by 3.5e-2 here.
BF16_LOSS_ATOL = 1e-3


def loss_tolerance(row: dict) -> float:
    return SAME_RUN_LOSS_ATOL if row["precision"] == "fp32" else BF16_LOSS_ATOL


@pytest.mark.parametrize("row", PAIRWISE, ids=row_id)
@pytest.mark.long
def test_a_combination_trains_as_its_plain_twin(row, matrix_data, tmp_path, monkeypatch, capsys):
    check_row(row, matrix_data, tmp_path, monkeypatch, capsys)


def check_row(row: dict, data: dict, tmp_path: Path, monkeypatch, capsys) -> None:
    from tiny_models import make_tiny_whisper

    # The twin first: the row's gradient observer, once installed, would also log the twin's.
    expected = twin_losses(row, data, monkeypatch)
    out, printed = run_row(row, data, tmp_path, monkeypatch, capsys)
    losses = [r["loss"] for r in metric_rows(out) if "loss" in r]
    assert len(losses) == 2, metric_rows(out)
    np.testing.assert_allclose(losses, expected, rtol=0, atol=loss_tolerance(row))
    if row["bad"]:  # every step reads them all: each run names them in one report, each once
        speech = data["fewer"] if row.get("nonspeech") and row["data"] == "whole" else data
        origins = speech["bad"][row["data"], row["packing"]][1]
        for text in printed:
            assert text.count(f"clips skipped as they were read: {len(BAD_CLIPS)} skipped") == 1
            assert all(text.count(f"{origin} [") <= 1 for origin in origins), text
            assert sum(f"{origin} [" in text for origin in origins) >= 3, text  # 3 a reason shown
            assert f"skipped {len(BAD_CLIPS)} clips during training" in text, text

    model, _ = make_tiny_whisper()
    if row.get("distill"):
        from whisper_train.student import student_from_teacher

        model = student_from_teacher(model, DISTILL_LAYERS)
    trainable, nonzero = observed_gradients(tmp_path / "grads")
    expected_names = expected_trainable(row, model)
    assert trainable == expected_names, trainable ^ expected_names
    assert nonzero == expected_names, ("without a gradient", sorted(expected_names - nonzero))

    initial = load_file(
        data["multilingual" if row.get("new_language") else "model"] / "model.safetensors"
    )
    if row.get("distill"):
        initial = student_tensors(initial)
    final = load_file(out / "final" / "model.safetensors")
    assert set(final) == set(initial)
    changed = {n for n in initial if not torch.equal(initial[n], final[n])}
    must_change = expected_changed_weights(row, initial)
    assert changed == must_change, (
        ("unchanged", sorted(must_change - changed)),
        ("changed", sorted(changed - must_change)),
    )
    if row["trackers"] != "tensorboard":  # a resumed row's trackers hold two runs each
        assert_trackers_hold_the_metrics(out, f"file:{tmp_path / 'mlruns'}")
    if row.get("judged"):
        check_judged(out, printed[-1] if row["nproc"] == 1 else "")


def check_judged(out: Path, said: str) -> None:
    """Both sets scored at step 0 (the non-speech set's start) and at the end (a resumed row
    at step 1 too), and the average of steps 1 and 2 on both; final/ is the step or the
    average the judge chose."""
    rows = [r for r in metric_rows(out) if "set" in r]
    steps = {
        name: sorted(r["step"] for r in rows if r["set"] == name and not r.get("averaged"))
        for name in ("speech", "quiet")
    }
    assert steps["speech"] == steps["quiet"], steps
    assert steps["speech"][0] == 0 and steps["speech"][-1] == 2, steps
    assert sorted(r["set"] for r in rows if r.get("averaged") == [1, 2]) == ["quiet", "speech"]
    result = json.loads((out / "result.json").read_text())
    assert result["final_averaged"] in (None, [1, 2])
    if said:
        assert "averaging the checkpoints of steps 1, 2" in said, said


@pytest.mark.parametrize(("pair", "named"), list(REFUSED.items()), ids=str)
def test_a_forbidden_pair_is_refused_in_one_line(
    pair, named, matrix_data, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not started by a launcher
    row = refused_row(pair)
    flags = row_flags(row, matrix_data, tmp_path)
    assert main(["train", *flags, "--max-steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: "), err
    for text in named:
        assert text in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("row", PAIRWISE, ids=row_id)
def test_packing_auto_is_per_clip_wherever_the_matrix_trains_per_clip(
    row, matrix_data, tmp_path, monkeypatch
):
    """--packing auto (the default) with every row's other options: per-clip where the matrix
    lets per-clip meet them, off where per-clip would be refused (never an error itself)."""
    from whisper_train.cli import build_parser, config_from_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = row_flags(row, matrix_data, tmp_path)
    if row["options"] == "yaml":
        yaml_file = tmp_path / "options.yaml"
        yaml_file.write_text(
            yaml_file.read_text().replace(f"packing: {row['packing']}", "packing: auto")
        )
    else:
        flags = ["--packing=auto" if f.startswith("--packing=") else f for f in flags]
    config = config_from_args(build_parser().parse_args(["train", *flags])).validate()
    per_clip_allowed = _consistent({**row, "packing": "per-clip"})
    packing, note = choose_packing(config)
    assert packing == ("per-clip" if per_clip_allowed else "off")
    assert note.startswith(f"packing auto -> {packing}: ")  # the start line says which, and why


def refused_row(pair) -> dict:
    """A row that holds `pair` and no other forbidden pair: the refusal names `pair`'s flags."""
    row, others = dict(pair), {}
    for name in NAMES:
        if name not in row:
            others[name] = next(
                v
                for v in FACTORS[name]
                if all(_consistent({**others, name: v, **dict([fixed])}) for fixed in pair)
            )
    row.update(others)
    return {name: row[name] for name in NAMES}


def test_the_array_holds_every_valid_pair_and_only_valid_rows():
    every_pair = {
        _pair_key((a, va), (b, vb))
        for a, b in itertools.combinations(NAMES, 2)
        for va in FACTORS[a]
        for vb in FACTORS[b]
    }
    valid = valid_tuples(2)
    # Each pair of values is trained in some row, or refused (or means nothing): none is lost.
    assert not valid & FORBIDDEN
    assert all(_consistent(row) for row in PAIRWISE)
    assert set().union(*(_tuples(row, 2) for row in PAIRWISE)) == valid
    assert every_pair - valid - FORBIDDEN == set()
    # Each refusal row holds its pair and no other forbidden one (the line names that pair).
    for pair in REFUSED:
        row = refused_row(pair)
        assert [
            _pair_key(a, b)
            for a, b in itertools.combinations(row.items(), 2)
            if _pair_key(a, b) in FORBIDDEN
        ] == [_pair_key(*pair)]


@functools.cache
def three_wise() -> list[dict]:
    """The 3-wise array (~10 s to generate on a busy machine: only when its test runs)."""
    return covering_array(3)


THREE_WISE_ROWS = 92  # with --quantize-base none/int8/nf4 and --teacher (computed)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(THREE_WISE_ROWS))
def test_every_triple_of_options_trains_as_its_plain_twin(
    index, matrix_data, tmp_path, monkeypatch, capsys
):
    assert len(three_wise()) == THREE_WISE_ROWS  # the generator, seeded, gives the same rows
    row = three_wise()[index]
    print(row_id(row))
    check_row(row, matrix_data, tmp_path, monkeypatch, capsys)
