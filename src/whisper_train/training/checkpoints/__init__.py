"""Training checkpoints, the format's one home: what `OUTPUT/checkpoint-<step>/` holds
(`format`: its file names and the trainer's state), writing it atomically (`save`) and reading
it back (`load`). Which checkpoint a --resume continues from, and what it may change there, is
`training.resume`'s; which ones stay on disk `training.retention`'s. The other names a run
writes into OUTPUT are `runfolder`'s.

A checkpoint holds everything needed to continue a run exactly where it stopped:

    trainable.safetensors  the weights that train: all of them for full fine-tuning, the decoder
                           for freeze-encoder, only the adapters for LoRA (the frozen rest is read
                           from --model again on resume)
    optimizer.pt           optimiser state (tensors and numbers only: loaded with weights_only)
    scheduler.pt           learning-rate scheduler state
    scaler.pt              fp16 loss-scaler state (fp16 runs only)
    rng-<rank>.pt          Python, NumPy and torch random states of each process
    stream-<rank>.json     a streamed --data only: each process's place in its stream (epoch,
                           rows each data-loader worker handed out; `streaming.StreamPosition`)
    trainer_state.json     step, epoch, steps trained in the epoch, bad-step counters,
                           evaluations so far, the guard's start, world size
    whisper-train.yaml     the options of the run and its record (`config.record`), which a
                           --resume compares with its own
    manifest.json          written last: every file's size, so that a truncated or missing
                           file is found before anything is loaded (`load.find_damage`)

Every file is written into `checkpoint-<step>.tmp/` and the folder is renamed when complete, so a
crash or a full disk mid-write never leaves a checkpoint that looks usable and is not; a failed
write removes the temporary folder and leaves the previous checkpoints untouched. What a rename
cannot rule out (a power cut before the files reached the disk, a partial copy)
`load.find_damage` finds cheaply: `--resume latest` then skips to the newest intact one.

Loading never runs code from the checkpoint (`load`): weights come from safetensors, and
every `.pt` file is read with `torch.load(..., weights_only=True)`.

Under --fsdp each process holds a shard of the weights and of the optimiser state: they are
saved instead as `sharded/`, a torch.distributed.checkpoint folder to which every process writes
its own shard (the trainable weights and the optimiser state, by parameter name), and read back
the same way; a resume needs the same number of processes, as any resume does. The rest of the
folder is as above.
"""

from whisper_train.training.checkpoints.format import (
    MANIFEST_FILE,
    PREFIX,
    SHARDED_DIR,
    STATE_FILE,
    STREAM_FILE,
    WEIGHTS_FILE,
    TrainerState,
    checkpoint_folders,
    checkpoint_step,
    estimate_checkpoint_bytes,
    list_checkpoints,
)
from whisper_train.training.checkpoints.load import (
    earlier_advice,
    find_damage,
    load_checkpoint,
    load_weights,
    read_stream_position,
    read_weights,
    saved_record,
)
from whisper_train.training.checkpoints.save import save_checkpoint

__all__ = [
    "MANIFEST_FILE",
    "PREFIX",
    "SHARDED_DIR",
    "STATE_FILE",
    "STREAM_FILE",
    "WEIGHTS_FILE",
    "TrainerState",
    "checkpoint_folders",
    "checkpoint_step",
    "earlier_advice",
    "estimate_checkpoint_bytes",
    "find_damage",
    "list_checkpoints",
    "load_checkpoint",
    "load_weights",
    "read_stream_position",
    "read_weights",
    "save_checkpoint",
    "saved_record",
]
