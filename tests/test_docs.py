"""The user documentation (README.md, docs/*.md) stays true to the code.

- every relative link points to a file of the repository;
- every ``python`` block parses, and the blocks marked ``<!-- doctest -->`` run (they need no Spark);
- the settings table of docs/settings.md is the one ``Settings.describe()`` gives;
- every Param of the estimators is named on the migration page and on the estimators page.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_BLOCK = re.compile(r"(<!-- doctest -->\n)?```python\n(.*?)```", re.S)


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _blocks(page: Path) -> list[tuple[bool, str]]:
    """(marked as doctest, code) of every python block; blocks indented in a list item are dedented."""
    return [(bool(m.group(1)), textwrap.dedent(m.group(2))) for m in _BLOCK.finditer(page.read_text())]


def test_pages_exist():
    names = {p.name for p in PAGES}
    for wanted in ("README.md", "index.md", "install.md", "quickstart.md", "clusters.md", "stores.md",
                   "migrating-from-horovod.md", "settings.md", "benchmarks.md", "estimators.md", "horovod-api.md"):
        assert wanted in names, f"docs page {wanted} is missing"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve(page: Path):
    missing = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{_page_id(page)}: links to missing files {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_python_blocks_parse(page: Path):
    for i, (_, code) in enumerate(_blocks(page)):
        try:
            ast.parse(code)
        except SyntaxError as exc:
            pytest.fail(f"{_page_id(page)}: python block {i} does not parse: {exc}\n{code}")


def test_doctest_blocks_run(tmp_path: Path):
    """The blocks marked ``<!-- doctest -->`` run as written, each in a fresh interpreter."""
    ran = 0
    for page in PAGES:
        for i, (marked, code) in enumerate(_blocks(page)):
            if not marked:
                continue
            script = tmp_path / f"{page.stem}-{i}.py"
            script.write_text(code)
            proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=300)
            assert proc.returncode == 0, f"{_page_id(page)} block {i} failed:\n{code}\n{proc.stderr[-3000:]}"
            ran += 1
    assert ran >= 3


def test_settings_table_matches_code():
    from spark_hvd.core.settings import Settings

    text = (ROOT / "docs" / "settings.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\| `(SPARK_HVD_[A-Z_]+)` \| (`(HOROVOD_[A-Z_]+)`)? *\| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = (m.group(3), m.group(4).strip())
    for variable, alias, default, _doc in Settings.describe():
        assert variable in rows, f"docs/settings.md lacks {variable}"
        doc_alias, doc_default = rows[variable]
        assert doc_alias == alias, f"{variable}: docs say alias {doc_alias}, code says {alias}"
        if default is None:
            assert doc_default == "off" or doc_default.startswith("unset ("), \
                f"{variable}: default is unset, docs say {doc_default!r} (want 'off' or 'unset (what happens)')"
        elif isinstance(default, bool):
            assert doc_default == str(default).lower(), f"{variable}: default {default}, docs say {doc_default!r}"
        else:
            assert doc_default.split()[0] == str(default), f"{variable}: default {default}, docs say {doc_default!r}"


def test_every_estimator_param_is_documented():
    pytest.importorskip("pyspark")
    from spark_hvd.estimators.keras.params import KerasEstimatorParams
    from spark_hvd.estimators.lightning.params import LightningEstimatorParams
    from spark_hvd.estimators.torch.params import TorchEstimatorParams

    names = {p.name for cls in (TorchEstimatorParams, KerasEstimatorParams, LightningEstimatorParams)
             for p in cls().params}
    for page in ("migrating-from-horovod.md", "estimators.md"):
        text = (ROOT / "docs" / page).read_text()
        missing = sorted(n for n in names if f"`{n}`" not in text)
        assert not missing, f"docs/{page} does not name the params {missing}"


def test_readme_has_the_two_commands_and_the_benchmarks():
    text = (ROOT / "README.md").read_text()
    for needle in ("make demo", "make test", "benchmarks/RESULTS.md", "spark-submit", "docs/"):
        assert needle in text, f"README.md lacks {needle!r}"
