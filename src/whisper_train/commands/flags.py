"""Flags generated from the configuration dataclasses of `config.py`.

Every option of `train` (and of the commands that share its flags) is a field of a dataclass in
`config.py`; the flags are generated from those fields, so a flag, a YAML key and the resolved
configuration written next to a model always agree.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import MISSING, fields
from typing import Union, get_args, get_origin

from whisper_train.config import GROUPS, RunConfig, field_owners


def add_config_arguments(parser: argparse.ArgumentParser, groups=tuple(GROUPS)) -> None:
    """One flag per dataclass field (`lora_r` → `--lora-r`), grouped as in config.py.

    Defaults are suppressed so that only flags the user typed override `--config FILE.yaml`.
    """
    parser.add_argument(
        "--config", metavar="FILE.yaml", help="Options from a YAML file; flags override it."
    )
    for group_name in groups:
        group = parser.add_argument_group(f"{group_name} options")
        for f in fields(GROUPS[group_name]):
            flag = "--" + f.name.replace("_", "-")
            factory = f.default_factory
            default = f.default if f.default is not MISSING else factory()  # type: ignore[misc]
            # argparse %-formats help text: a percent sign in prose must reach it doubled
            help_text = f.metadata.get("help", "").replace("%", "%%")
            if default not in (None, False, [], ""):
                shown = ",".join(default) if isinstance(default, list) else default
                help_text += f" [default: {str(shown).replace('%', '%%')}]"
            if _is_bool(f.type):
                group.add_argument(
                    flag,
                    action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            elif f.metadata.get("repeatable"):  # --eval-data A=x --eval-data B=y
                group.add_argument(
                    flag,
                    metavar=metavar(f.name),
                    action="append",
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            elif "const" in f.metadata:  # a flag that may stand alone: --resume
                group.add_argument(
                    flag,
                    metavar=metavar(f.name),
                    nargs="?",
                    const=f.metadata["const"],
                    default=argparse.SUPPRESS,
                    help=help_text,
                )
            else:
                group.add_argument(
                    flag, metavar=metavar(f.name), default=argparse.SUPPRESS, help=help_text
                )


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Defaults, then the YAML file, then the flags typed on the command line."""
    config = RunConfig.from_yaml(args.config) if getattr(args, "config", None) else RunConfig()
    owners = field_owners()
    config.update({key: value for key, value in vars(args).items() if key in owners})
    return config.validate()


def metavar(name: str) -> str:
    """The placeholder of a flag: its last word (`--batch-size SIZE`)."""
    return name.split("_")[-1].upper()


def _is_bool(annotation) -> bool:
    if annotation in (bool, "bool", "bool | None"):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return bool in get_args(annotation)
    return False
