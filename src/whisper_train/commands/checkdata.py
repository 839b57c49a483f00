"""`whisper-train check-data`: a dataset's clips, hours, durations and problems (checkdata.py).

Exit codes: 0 clean (notes allowed), 1 problems found under --strict (without it they are
warnings and the exit is 0), 2 unusable input (the data cannot be read at all).
"""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "check-data",
        help="Report clips, hours, durations, formats and problems in a dataset.",
        description="`whisper-train check-data`: look at a dataset before spending GPU hours on "
        "it.",
    )
    parser.add_argument("data", help="The data, in any layout `train --data` accepts.")
    parser.add_argument(
        "--data-format", default=None, help="Force a layout instead of detecting it."
    )
    parser.add_argument(
        "--model",
        default=None,
        help="Count label tokens with this model's tokenizer (folder, hub id or tiny.en).",
    )
    parser.add_argument(
        "--strict", action="store_true", help="Exit with code 1 when any problem is found."
    )
    parser.add_argument("--json", action="store_true", help="Print the report as JSON.")
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
    if args.png:
        print(f"histogram written to {write_histogram_png(report, args.png)}")
    if report.problems and args.strict:
        return 1
    return 0
