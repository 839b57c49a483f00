"""`train(config)`: check the run folder, then run the fine-tuning recipe here or in N processes.

The recipe itself (setup, the loop, evaluation, checkpoints, the final model) is
`recipe.FineTuneRecipe`; `--nproc N` re-launches this command as N processes (`launch`), each of
which runs the recipe on its share of every batch.
"""

from __future__ import annotations

from pathlib import Path

from whisper_train.config import RunConfig
from whisper_train.errors import UserError
from whisper_train.launch import claimed_by_parent, inside_launcher, launch_data_parallel
from whisper_train.recipe import FineTuneRecipe
from whisper_train.runfolder import check_writable, claim_output_dir
from whisper_train.runlog import TrainResult

__all__ = ["TrainResult", "train"]


def train(config: RunConfig) -> TrainResult:
    """Fine-tune per `config`; with `--nproc N` (outside a launcher) re-launch as N processes."""
    config.validate()
    if not config.data.data:
        raise UserError("--data is required: a folder with metadata.csv, or a JSONL/CSV manifest")
    output_dir = Path(config.train.output_dir)
    check_writable(output_dir)
    if not claimed_by_parent(output_dir):
        claim_output_dir(config)  # refuse an earlier run's folder, or move it aside
    if config.train.nproc > 1 and not inside_launcher():
        return launch_data_parallel(config)
    recipe = FineTuneRecipe(config)
    recipe.setup()
    recipe.train()
    return recipe.finish()
