"""The values options take, named once. The configuration checks them (`config`), and the
layers that act on them (`memory`, `data`) import them from here, below them all, so no list
of choices is written twice."""

from __future__ import annotations

# --mode: what trains (`memory.prepare_model`).
MODES = ("full", "lora", "freeze-encoder")
# --lora-variant: how --mode lora's adapters update a weight (`memory.prepare_model`): plain
# LoRA (scale alpha / r), DoRA (the update's direction, with a trained magnitude per output) or
# rsLoRA (LoRA scaled by alpha / sqrt(r)).
LORA_VARIANTS = ("lora", "dora", "rslora")
# --quantize-base: how --mode lora holds its frozen base (`memory.quantize`): as loaded (none),
# in bitsandbytes' 8-bit layers (int8) or in its 4-bit NormalFloat layers (nf4).
QUANTIZE_BASE = ("none", "int8", "nf4")
# --average-by: which checkpoints --average-checkpoints N averages: the last N saved (icefall's
# --avg) or the N best evaluated by the run's final rule (ESPnet's valid.acc.ave).
AVERAGE_BY = ("last", "best")
# --optim: AdamW in one of three implementations (`memory.optim`).
OPTIMIZERS = ("adamw", "adamw-fused", "adamw8bit")
# --task: Whisper's two (`data.labels`).
TASKS = ("transcribe", "translate")
# --packing: off (one clip a window), on (windows labelled with their clips' transcripts
# joined), per-clip (windows whose clips are each decoded on their own, `memory.clip_attention`);
# auto, the option's default, chooses per-clip or off (`config.resolve.choose_packing`).
PER_CLIP = "per-clip"
PACKINGS = ("off", "on", PER_CLIP)
PACKING_AUTO = "auto"
# --nonspeech: clips where nobody speaks mixed into training (a folder of audio, or builtin:
# `data.nonspeech`); none (or off) trains on the data alone; auto, the option's default, is
# builtin for data read whole and none for a stream (`config.resolve.choose_nonspeech`).
NONSPEECH_AUTO = "auto"
BUILTIN_SET = (
    "builtin"  # also a non-speech evaluation set's path (`--eval-data NAME:nonspeech=builtin`)
)
NONSPEECH_OFF = ("none", "off", "false", "no", "0")
# Where a run's clips of --nonspeech go (the record's nonspeech placement, resumed as trained):
# alongside the speech with --packing per-clip (riding in the room its windows leave, none of a
# step's clips: `packing.plan_windows`), else spread: as clips of the epoch, dealt evenly
# through its steps (`step_plan.WholePlan`). As-clips, a record written before spreading: as
# clips shuffled in with the speech (dealt evenly under --group-by-length alone).
NONSPEECH_ALONGSIDE = "alongside"
NONSPEECH_SPREAD = "spread"
NONSPEECH_AS_CLIPS = "as-clips"
