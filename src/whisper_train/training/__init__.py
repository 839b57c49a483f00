"""Fine-tuning: the recipe, its checkpoints and its processes.

train          `train(config)`: the library entry point (one process, or launches N)
launch         starting and supervising N processes (`--nproc`)
recipe         `FineTuneRecipe`: its phases in order, the step loop, evaluation during training
setup_phases   the recipe's setup before step 1, a function a phase (each returns what it builds)
step           one optimizer step's loss weights and checks, and the errors and advice (a lower
               rate, the checkpoint to continue from) when updates go NaN or keep being skipped
finish         the end of a run: its summary lines, the whole model for final/ (refused when NaN),
               final/, result.json, curves and the --compare-baseline report written
final          which evaluated step final/ holds, writing it, the --compare-baseline report
datasets       the run's training and evaluation sets, read, split and screened
checkpoints    what a checkpoint holds, written atomically (manifest, every process agreeing)
resume         --resume: the checkpoint to continue from (damaged ones skipped), the options it
               fixes, loading it exactly, later checkpoints and metrics rows set aside
retention      rotation (the newest and the best kept) and the disk room a run needs at its peak
encoder_cache  encoder outputs kept on disk for --mode freeze-encoder
"""
