"""The commands of `whisper-train`, one module each, all in one shape:

* `add_parser(subparsers)` declares the command and its options, each with help text and its
  default (`whisper_train.cli` appends the defaults and placeholders to the help);
* `run(args) -> int` calls one library function with the parsed options, prints its result and
  returns the exit code. A `UserError` it raises becomes one `error:` line and exit code 2.

The library modules they call take typed arguments and never see the command line.
"""

# The command modules, in the order `whisper-train --help` lists them; `commands.X` is the
# command line of the library module `whisper_train.X`.
COMMANDS = (
    "train",
    "distill",
    "evaluate",
    "average",
    "doctor",
    "checkdata",
    "export",
    "transcribe",
    "pseudo_label",
    "demo",
    "cache",
)
