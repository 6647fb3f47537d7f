"""docs/architecture.md names only modules that exist: a contributor who follows it finds every file it points to.

What counts as a name: a backticked path ending in ``.py`` or ``/`` (``core/engine/engine.py``, ``core/transport/tcp/``,
relative to ``spark_hvd/`` or to the repository; a bare file name such as ``serde.py`` is looked for anywhere in
the package; ``*`` globs must match something), and a dotted ``spark_hvd.x.y`` name anywhere in the text (a module,
or an attribute of one).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "spark_hvd"

_PATH = re.compile(r"`([\w*./-]+(?:\.py|/))`")
_DOTTED = re.compile(r"\bspark_hvd(?:\.\w+)+")


def missing_paths(text: str) -> list[str]:
    """The backticked paths of ``text`` that name no file or folder of the repository."""
    out = []
    for name in sorted(set(_PATH.findall(text))):
        if "/" not in name.rstrip("/"):  # a bare file name: anywhere in the package
            found = any(PACKAGE.rglob(name.rstrip("/")))
        else:
            found = any(any(base.glob(name.rstrip("/"))) for base in (PACKAGE, ROOT))
        if not found:
            out.append(name)
    return out


def resolves(name: str) -> bool:
    """Whether the dotted ``name`` is a module, or an attribute (chain) of the longest module it starts with."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:  # a name below a module that is no package
            spec = None
        if spec is not None:
            obj = importlib.import_module(module)
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def missing_dotted(text: str) -> list[str]:
    """The dotted ``spark_hvd.`` names of ``text`` that are neither a module nor an attribute of one."""
    return [name for name in sorted(set(_DOTTED.findall(text))) if not resolves(name)]


def test_every_module_architecture_md_names_exists():
    text = DOC.read_text()
    assert _PATH.findall(text), "the checks below found no path in docs/architecture.md: the pattern is wrong"
    assert not missing_paths(text), f"docs/architecture.md names files that are gone: {missing_paths(text)}"
    assert not missing_dotted(text), f"docs/architecture.md names modules that are gone: {missing_dotted(text)}"


@pytest.mark.parametrize("text, missing", [
    ("`core/engine/engine.py` and `core/transport/tcp/`", []),
    ("`core/engine/gone.py`", ["core/engine/gone.py"]),
    ("`estimators/*/rank.py`", []),
    ("`estimators/*/nothing.py`", ["estimators/*/nothing.py"]),
    ("`tests/test_layering.py` and `serde.py`", []),
    ("`no_such_file.py`", ["no_such_file.py"]),
])
def test_the_path_check_sees_what_it_should(text, missing):
    assert missing_paths(text) == missing


def test_the_dotted_check_sees_what_it_should():
    assert missing_dotted("spark_hvd.store.RunDir, spark_hvd.core.jobenv and spark_hvd.estimators.common.fit") == []
    assert missing_dotted("spark_hvd.store.Gone and spark_hvd.no_such") == ["spark_hvd.no_such", "spark_hvd.store.Gone"]
