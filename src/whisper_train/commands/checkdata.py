"""`whisper-train check-data`: a dataset's clips, hours, durations and problems (checkdata.py).

Exit codes: 0 clean (notes allowed), 1 problems found under --strict (without it they are
warnings and the exit is 0), 2 unusable input (the data cannot be read at all).
"""

from __future__ import annotations

import argparse
import json

from whisper_train.commands.flags import add_field, add_shared


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "check-data",
        help="Report clips, hours, durations, formats and problems in a dataset.",
        description="`whisper-train check-data`: look at a dataset before spending GPU hours on "
        "it.",
    )
    parser.add_argument(
        "data", metavar="PATH", help="The data, in any layout `train --data` accepts."
    )
    add_field(parser, "data_format", help="Force a layout instead of detecting it.")
    add_field(
        parser,
        "model",
        default=None,
        help="Count label tokens with this model's tokenizer (folder, hub id or tiny.en).",
    )
    add_field(parser, "strict", help="Exit with code 1 when any problem is found.")
    add_shared(parser, "json")
    parser.add_argument("--png", default=None, metavar="FILE", help="Save the histogram here.")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """0 clean (or problems without --strict), 1 problems under --strict; UserError → 2."""
    from whisper_train.checkdata import check_data, format_report, write_histogram_png

    report = check_data(
        args.data, data_format=args.data_format, model=args.model or None, strict=args.strict
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(format_report(report))
    if args.png and (written := write_histogram_png(report, args.png)) is not None:
        print(f"histogram written to {written}")
    if report.problems and args.strict:
        return 1
    return 0
