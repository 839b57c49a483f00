"""Fine-tuning: the recipe, its checkpoints and its processes.

train          `train(config)`: the library entry point (one process, or launches N)
launch         starting and supervising N processes (`--nproc`)
recipe         `FineTuneRecipe`: setup, the step loop, evaluation during training
step           one optimizer step's loss weights and checks (NaN weights, the rate to suggest)
final          which evaluated step final/ holds, writing it, the --compare-baseline report
datasets       the run's training and evaluation sets, read, split and screened
checkpoints    saving and resuming exactly (manifest, damaged-checkpoint skipping)
encoder_cache  encoder outputs kept on disk for --mode freeze-encoder
"""
