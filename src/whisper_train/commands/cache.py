"""`whisper-train cache ls | clear`: the encoder cache's entries, and removing them
(encoder_cache.py)."""

from __future__ import annotations

import argparse

from whisper_train.commands.flags import add_field
from whisper_train.errors import UserError
from whisper_train.runfolder import encoder_cache_dir
from whisper_train.units import format_bytes

DIR_HELP = (
    "The encoder cache folder, as given to `train --encoder-cache-dir`. Default: "
    "$WHISPER_TRAIN_CACHE/encoder, else $XDG_CACHE_HOME/whisper-train/encoder, else "
    "~/.cache/whisper-train/encoder."
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "cache",
        help="List or remove cached encoder outputs (freeze-encoder training).",
        description="`whisper-train cache`: the encoder outputs that freeze-encoder runs store "
        "and reuse, one entry per encoder weights and precision.",
    )
    actions = parser.add_subparsers(dest="cache_action", metavar="ACTION", required=True)
    ls = actions.add_parser(
        "ls", help="The cache folder, its entries (model keys) and their sizes."
    )
    add_field(ls, "encoder_cache_dir", help=DIR_HELP)
    ls.set_defaults(handler=run_ls)
    clear = actions.add_parser("clear", help="Remove one entry (--model-key) or all (--all).")
    add_field(clear, "encoder_cache_dir", help=DIR_HELP)
    which = clear.add_mutually_exclusive_group()
    which.add_argument(
        "--model-key",
        default=None,
        metavar="KEY",
        help="The entry to remove, as `cache ls` shows it (a unique prefix is enough).",
    )
    which.add_argument("--all", action="store_true", help="Remove every entry.")
    clear.set_defaults(handler=run_clear)


def run_ls(args: argparse.Namespace) -> int:
    from whisper_train.training.encoder_cache import list_cache

    root = _existing_root(args.encoder_cache_dir)
    entries = list_cache(root)
    print(f"encoder cache: {root}")
    if not entries:
        print("  empty")
        return 0
    print(f"  {'model key':<17}{'clips':>8}{'size':>12}  model")
    for e in entries:
        model = e.info.get("model", "?")
        detail = ", ".join(f"{k} {e.info[k]}" for k in ("compute", "shape") if k in e.info)
        print(f"  {e.key:<17}{e.clips:>8}{format_bytes(e.bytes):>12}  {model} ({detail})")
    total = sum(e.bytes for e in entries)
    print(f"  total: {sum(e.clips for e in entries)} clips, {format_bytes(total)}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from whisper_train.training.encoder_cache import clear_cache

    root = _existing_root(args.encoder_cache_dir)
    removed = clear_cache(root, key=args.model_key, everything=args.all)
    freed = sum(e.bytes for e in removed)
    keys = ", ".join(e.key for e in removed) or "nothing (the cache is empty)"
    print(f"removed {keys} from {root}: {format_bytes(freed)} freed")
    return 0


def _existing_root(flag_value):
    """The cache folder; a --encoder-cache-dir that does not exist is a typo, not an empty
    cache (the default folder may simply not exist yet)."""
    root = encoder_cache_dir(flag_value)
    if flag_value and not root.is_dir():
        raise UserError(
            f"--encoder-cache-dir {flag_value}: no such folder; pass the folder given to train"
        )
    return root
