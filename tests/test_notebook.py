"""examples/finetune.ipynb runs top to bottom, as a newcomer runs it, on small parameters.

The notebook is executed by nbclient in a `python3` kernel: ipykernel's own kernelspec, which
jupyter_client starts with this interpreter (the kernelspec's `python` means sys.executable), so
the kernel has the same packages as the test, offline. Only the cell tagged `parameters` changes:
each of its assignments below is replaced by a smaller value (16 training sentences: two steps
of 8; four held-out and four guard sentences; two clips for the export's check). What a user
would notice is checked: every code cell ran without an error, the before/after table holds
numbers for held-out and guard, the export folder holds a CTranslate2 model, and the export's
transcript of a clip is not empty.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "finetune.ipynb"
# A whole run of the small notebook took ~40 s on the project's 2-core CPU; a hung kernel fails.
CELL_TIMEOUT_S = 300


def small_parameters(work_dir: Path) -> dict[str, str]:
    return {
        "TRAIN_UTTERANCES": "16",
        "EVAL_UTTERANCES": "4",
        "GUARD_UTTERANCES": "4",
        "EPOCHS": "1",
        "BATCH_SIZE": "8",
        "CHECK_CLIPS": "2",
        "WORK_DIR": f"Path({str(work_dir)!r})",
    }


def shrink(notebook, values: dict[str, str]) -> None:
    """Replace each `NAME = ...` line of the `parameters` cell by `NAME = value`."""
    (cell,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    source = cell.source
    for name, value in values.items():
        source, count = re.subn(rf"^{name} = .*$", f"{name} = {value}", source, flags=re.M)
        assert count == 1, f"the parameters cell no longer assigns {name} once"
    cell.source = source


def stdout_of(cell) -> str:
    return "".join(
        out.get("text", "")
        for out in cell.outputs
        if out.output_type == "stream" and out.name == "stdout"
    )


def cell_with(notebook, text: str):
    (cell,) = [c for c in notebook.cells if c.cell_type == "code" and text in c.source]
    return cell


def test_stored_notebook_has_no_outputs():
    """Outputs stay out of git, so a change to the notebook is a small diff."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


# What it checks (every cell ran, numbers in the table, a CTranslate2 folder, a transcript not
# empty) holds for either espeak-ng engine's audio: CI's second speech pass leaves it out.
@pytest.mark.speech
@pytest.mark.any_speech
@pytest.mark.timeout(2 * CELL_TIMEOUT_S)
@pytest.mark.long
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    work_dir = tmp_path / "work"
    shrink(notebook, small_parameters(work_dir))
    # The kernel inherits the environment: offline, one OpenMP thread as the suite's subprocesses.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working folder
    )
    client.execute()  # raises CellExecutionError, naming the cell, if one fails

    code_cells = [c for c in notebook.cells if c.cell_type == "code"]
    for cell in code_cells:
        assert cell.execution_count is not None, cell.source[:80]
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source[:80]

    table = stdout_of(cell_with(notebook, "before, after = score("))
    percent = r"\s+(\d+\.\d)%"
    for name in ("held-out", "guard"):
        found = re.search(rf"^{name} WER{percent}{percent}$", table, re.M)
        assert found, f"no {name} WER before and after in:\n{table}"
        assert all(0 <= float(v) <= 1000 for v in found.groups())

    export = work_dir / "export-ct2"
    assert (export / "model.bin").is_file() and (export / "tokenizer.json").is_file()
    assert "passed=True" in stdout_of(cell_with(notebook, "export_model("))

    said = stdout_of(cell_with(notebook, "transcribe_paths("))
    transcript = re.search(r"^transcript:(.*)$", said, re.M)
    assert transcript and transcript.group(1).strip(), said
