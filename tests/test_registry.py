"""The export formats' registry (`formats.registry`) is the one place a format is named: the
command line offers exactly its rows, and no module outside it branches on a format's name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import get_type_hints

import pytest

import whisper_train
from whisper_train.cli import build_parser
from whisper_train.formats.registry import DEVICES, EXPORT_FORMATS, FORMATS, format_of

PACKAGE = Path(whisper_train.__file__).parent
REGISTRY = PACKAGE / "formats" / "registry.py"
# The data layouts have their own table (`data.layouts.LAYOUTS`), where `hf` names a layout
# (datasets saved by `save_to_disk`), not an export format.
DATA = PACKAGE / "data"


def _export_format_choices() -> list[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    return list(next(a for a in commands["export"]._actions if a.dest == "format").choices)


def test_export_offers_each_registered_format_once():
    choices = _export_format_choices()
    assert choices == list(FORMATS)
    assert sorted(choices) == sorted({fmt.name for fmt in EXPORT_FORMATS}), "one row a name"


@pytest.mark.parametrize("fmt", EXPORT_FORMATS, ids=FORMATS)
def test_each_row_is_whole(fmt):
    """Every row says everything `export`, `--model` and `transcribe` ask of a format."""
    assert fmt.markers and fmt.runtime
    for device in DEVICES:
        quantization, why = fmt.default_quantization(device)
        assert quantization in fmt.quantizations and why
    assert set(fmt.unchecked) <= set(fmt.quantizations)
    # the runner's class, or a function that makes one (ct2's: in the compute type of the device)
    runner = fmt.backend if isinstance(fmt.backend, type) else get_type_hints(fmt.backend)["return"]
    assert callable(runner.transcribe)
    assert fmt.model_file is None or fmt.model_file in fmt.markers
    for function in (fmt.write, fmt.read, fmt.greedy, fmt.scores):
        assert inspect.signature(function).parameters  # a function of its files, not a stub


def test_a_folder_of_each_format_is_that_format(tmp_path):
    """`--model` reads a folder by its markers alone; a CTranslate2 folder's config.json does
    not make it a transformers folder."""
    for fmt in EXPORT_FORMATS:
        folder = tmp_path / fmt.name
        folder.mkdir()
        for marker in fmt.markers:
            (folder / marker).write_bytes(b"")
        assert format_of(folder) is fmt
    assert format_of(tmp_path) is None


def _format_branches(source: str) -> list[tuple[int, str]]:
    """(line, name) of each format name that code decides on: compared (`==`, `in`), a key of
    a dict literal, or a subscript (`TABLE["ggml"]`). Passing one to a call is not a branch."""
    names = set(FORMATS)

    def literals(node: ast.AST | None) -> list[ast.Constant]:
        if isinstance(node, ast.Constant) and node.value in names:
            return [node]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [item for element in node.elts for item in literals(element)]
        return []

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            decided = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            decided = list(node.keys)
        elif isinstance(node, ast.Subscript):
            decided = [node.slice]
        elif isinstance(node, ast.MatchValue):
            decided = [node.value]
        else:
            continue
        found += [(item.lineno, item.value) for part in decided for item in literals(part)]
    return found


def test_the_branch_finder_finds_a_branch():
    """The check below can fail: the shapes the registry replaced are each reported."""
    source = (
        'if format == "ggml":\n    pass\n'
        'elif format in ("ct2", "hf"):\n    pass\n'
        'EXTRAS = {"openai": "openai"}\n'
        'name = RUNTIME_NAMES["ct2"]\n'
        'save(model, "ggml")\n'
    )
    assert sorted(_format_branches(source)) == [
        (1, "ggml"),
        (3, "ct2"),
        (3, "hf"),
        (5, "openai"),
        (6, "ct2"),
    ]


def test_no_module_but_the_registry_branches_on_a_format_name():
    branches = [
        f"{path.relative_to(PACKAGE)}:{line} {name!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != REGISTRY and DATA not in path.parents
        for line, name in _format_branches(path.read_text(encoding="utf-8"))
    ]
    assert not branches, f"format names decided on outside formats/registry.py: {branches}"
