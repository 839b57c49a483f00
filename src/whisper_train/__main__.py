"""`python -m whisper_train` (and `accelerate launch -m whisper_train train ...`)."""

import sys

from whisper_train.cli import main

sys.exit(main())
