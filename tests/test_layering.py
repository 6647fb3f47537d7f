"""The package's layers hold (DESIGN.md: each layer imports only the layers below it; core's rooms likewise).

Read from the source with ``ast``: every import counts, the lazy ones inside functions too, except those under
``if TYPE_CHECKING:`` (they never run). An import names the module it loads: ``from P import x`` is module ``P.x``
where that is a module, else ``P`` itself; the parent packages Python runs on the way are not counted (their
``__init__`` is the package's front door, not a dependency of the file).

- no import circle between files;
- no import upward, nor between two rooms of one layer (``runner/`` and ``data/`` know nothing of each other);
- every module of the package sits in a room of ``LAYERS``: a new folder or root module must be placed there.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "spark_hvd"

#: Bottom first. A layer is a list of rooms side by side; a room is a folder or module name, or a tuple of them.
#: A module belongs to the room with the longest name that is it or a package above it (``spark_hvd`` itself: only
#: the package's ``__init__``).
LAYERS: list[list[str | tuple[str, ...]]] = [
    [("spark_hvd", "spark_hvd.errors", "spark_hvd.pickling")],
    [("spark_hvd.core.errors", "spark_hvd.core.settings", "spark_hvd.core.jobenv", "spark_hvd.core.backend",
      "spark_hvd.core.reduce", "spark_hvd.core.compression")],  # core's ground floor
    ["spark_hvd.core.transport"],   # frames, listeners, TCP peers and the ring loop, shared memory, rendezvous
    ["spark_hvd.core.algorithms"],  # agreed, recursive / halving-doubling, hierarchical, Adasum
    ["spark_hvd.core.backends"],    # ring, MPI, torch.distributed, local
    ["spark_hvd.core.engine"],      # negotiation table, executor and groups, devices, rounds, timeline
    ["spark_hvd.core"],             # the process API: context, process sets, elastic, torchrun
    ["spark_hvd.store"],
    ["spark_hvd.runner", "spark_hvd.data"],
    ["spark_hvd.ray"],  # Ray's launch seam, over the runner's rendezvous, elastic state and driver service
    [("spark_hvd._binding_common", "spark_hvd._process_api")],  # _process_api: the names every binding exports
    ["spark_hvd.torch", "spark_hvd.mxnet", "spark_hvd._keras_common"],  # _keras_common: shared by keras/, tensorflow/
    ["spark_hvd.tensorflow"],  # GPU tensors reach torch's device group by DLPack
    ["spark_hvd.keras"],       # Keras 3 runs on TensorFlow, torch or JAX: over their bindings, never under them
    ["spark_hvd.estimators.common"],  # what the estimators share: params, fit, the model's transform, the rank's run
    ["spark_hvd.estimators.torch", "spark_hvd.estimators.keras"],
    ["spark_hvd.estimators.lightning"],  # over the torch estimator
    ["spark_hvd.estimators"],  # the front door: the estimators by name, the flat layout's names as aliases
]


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``root`` (a package ``P`` is its ``P/__init__.py``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that ``name`` imports anywhere in its file, ``TYPE_CHECKING`` blocks excepted."""
    tree = ast.parse(path.read_text())
    unseen = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
              for n in ast.walk(node)}
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in unseen:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                up = base.split(".")[: len(base.split(".")) - node.level + 1]
                mod = ".".join(up + ([mod] if mod else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def room_of(name: str) -> tuple[int, str | tuple[str, ...]] | None:
    """(layer index, room) of module ``name``, or None where no room holds it."""
    best = None
    for i, layer in enumerate(LAYERS):
        for room in layer:
            for prefix in (room,) if isinstance(room, str) else room:
                hit = name == prefix or (prefix != "spark_hvd" and name.startswith(prefix + "."))
                if hit and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), i, room)
    return None if best is None else best[1:]


def violations(graph: dict[str, set[str]]) -> list[str]:
    """An upward import, an import between two rooms of one layer, or a module in no room: one line each."""
    out = []
    for name, targets in sorted(graph.items()):
        here = room_of(name)
        if here is None:
            out.append(f"{name}: in no room of LAYERS (place it there)")
            continue
        for target in sorted(targets):
            there = room_of(target)
            if there is not None and (there[0] > here[0] or (there[0] == here[0] and there[1] != here[1])):
                out.append(f"{name} (layer {here[0]}) imports {target} (layer {there[0]}, {there[1]})")
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules(PKG)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_circle_between_files(graph):
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' imports '.join(reversed(exc.args[1]))}")  # graphlib lists it backwards


def test_no_upward_import_between_layers_and_rooms(graph):
    found = violations(graph)
    assert not found, "imports against LAYERS:\n" + "\n".join(found)


def test_the_checks_see_what_they_should(tmp_path: Path):
    """The rules themselves: a lazy upward import, an import between side rooms, an unplaced module, a circle."""
    graph = {"spark_hvd.core.transport.tcp": {"spark_hvd.core.engine.engine"},
             "spark_hvd.runner.spark": {"spark_hvd.data.reader"},
             "spark_hvd.tensorflow.elastic": {"spark_hvd.keras.elastic"},
             "spark_hvd.unplaced": set(),
             "spark_hvd.keras.compression": {"spark_hvd.tensorflow.compression", "spark_hvd.core"}}
    assert [line.split(" ")[0] for line in violations(graph)] == [
        "spark_hvd.core.transport.tcp", "spark_hvd.runner.spark", "spark_hvd.tensorflow.elastic", "spark_hvd.unplaced:"]
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"a": {"b"}, "b": {"c"}, "c": {"a"}}).prepare()
    source = "def f():\n    from spark_hvd.core.engine import engine\nif TYPE_CHECKING:\n    import spark_hvd.store\n"
    fake = {"spark_hvd.core.transport.tcp": Path("tcp.py"), "spark_hvd.core.engine.engine": Path("engine.py"),
            "spark_hvd.core.engine": Path("__init__.py"), "spark_hvd.store": Path("__init__.py")}
    (tmp_path / "tcp.py").write_text(source)
    assert imports("spark_hvd.core.transport.tcp", tmp_path / "tcp.py", fake) == {"spark_hvd.core.engine.engine"}
