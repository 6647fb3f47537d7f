"""What users install on clusters (issue 38, item 5): ``python -m build`` makes an sdist and a wheel, and the wheel,
installed as a cluster installs it (``pip install --no-index --find-links <wheelhouse> --no-deps``), runs a 2-rank job.

The wheel tested is the pure-Python one (``SPARK_HVD_PURE=1``, setup.py): the one that installs on every platform and
Python. It goes into a throwaway virtualenv that sees this environment's packages (a ``.pth`` naming its
site-packages), so on a runtime leg the job runs on the runtime's numpy and cryptography, with spark_hvd from the
wheel and not from the checkout the rest of the suite imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import site
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.compat, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.1.0"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """``SPARK_HVD_PURE=1 python -m build`` of the checkout: an sdist, then a wheel built from that sdist."""
    # find_spec of build.__main__, not of build: a checkout's build/ folder (setuptools' output) imports as `build`
    try:
        found = importlib.util.find_spec("build.__main__") is not None
    except ModuleNotFoundError:  # no `build` at all: find_spec of a submodule imports its parent
        found = False
    if not found:
        pytest.skip("`python -m build` needs the build package (the runtime legs install it: tools/leg.py)")
    out = tmp_path_factory.mktemp("wheelhouse")
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                          env=dict(os.environ, SPARK_HVD_PURE="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_build_makes_an_sdist_with_the_c_loop_and_a_pure_python_wheel(wheelhouse):
    assert sorted(p.name for p in wheelhouse.iterdir()) == [
        f"spark_hvd-{VERSION}-py3-none-any.whl", f"spark_hvd-{VERSION}.tar.gz"]
    with tarfile.open(wheelhouse / f"spark_hvd-{VERSION}.tar.gz") as sdist:
        names = sdist.getnames()
    assert f"spark_hvd-{VERSION}/spark_hvd/core/transport/_ringloop.c" in names  # built where a compiler exists
    assert f"spark_hvd-{VERSION}/setup.cfg" in names
    with zipfile.ZipFile(wheelhouse / f"spark_hvd-{VERSION}-py3-none-any.whl") as wheel:
        files = wheel.namelist()
    assert "spark_hvd/core/__init__.py" in files and "spark_hvd/runner/launch.py" in files
    assert not [f for f in files if f.endswith((".so", ".c"))]


@pytest.mark.timeout(600)
def test_the_wheel_installed_from_a_wheelhouse_runs_a_two_rank_allreduce(wheelhouse, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # the environment under test (a leg's runtime) below the venv's own site-packages, as a cluster's Python is
    # (--ignore-installed: the checkout's editable install is visible there, and must not count as installed)
    Path(venv_site, "_environment_under_test.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheelhouse),
                    "--no-deps", "--ignore-installed", "spark_hvd"], check=True, timeout=300)

    script = tmp_path / "allreduce.py"
    script.write_text(textwrap.dedent("""
        import json
        import numpy as np
        import spark_hvd
        import spark_hvd.core as hvd
        from spark_hvd.core.backend import ReduceOp
        hvd.init()
        data = np.random.default_rng(7 + hvd.rank()).standard_normal(1001)
        out = hvd.allreduce(data.copy(), op=ReduceOp.SUM)
        print("RESULT " + json.dumps({"rank": hvd.rank(), "size": hvd.size(), "file": spark_hvd.__file__,
                                      "sum": out.tolist()}))
        hvd.shutdown()
    """))
    proc = subprocess.run([str(venv / "bin" / "spark-hvd-run"), "-np", "2", "--timeout", "240", str(python),
                           str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {}
    for line in proc.stdout.splitlines():
        rank, _, text = line.partition(" ")
        if text.startswith("RESULT "):
            found[int(rank.strip("[]"))] = json.loads(text[len("RESULT "):])
    assert sorted(found) == [0, 1] and all(r["size"] == 2 for r in found.values())
    assert all(r["file"].startswith(venv_site) for r in found.values()), found[0]["file"]  # the wheel's copy
    expected = sum(np.random.default_rng(7 + r).standard_normal(1001) for r in range(2))
    for r in found.values():
        np.testing.assert_allclose(r["sum"], expected, rtol=1e-12)
