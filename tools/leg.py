"""One CI leg: a Databricks runtime's Python packages, spark_hvd installed over them as a user would, the
compatibility subset of the suite run there.

    python tools/leg.py runtimes/dbr-15.4-ml.txt            # build (or reuse) .venv-dbr-15.4-ml, install, check, test
    python tools/leg.py runtimes/dbr-15.4-ml.txt -- -x -k torch   # arguments after -- go to pytest

A leg file (runtimes/*.txt) lists the runtime's packages that matter to spark_hvd as exact pins, with comments saying
where each version comes from, and may name the extras its user installs in a comment line
``# leg-extras: torch,spark,...`` (default: ``EXTRAS``); an extra may add packages the runtime lacks (MXNet on the
floor leg), never replace one. The steps, each failing loudly:

1. the runtime: a virtualenv ``.venv-<leg>`` built from the leg file (``pip install -r``), its ``pip list``
   saved as the runtime's snapshot. Reused while the leg file's pins are unchanged (their hash is in
   ``.leg-stamp``; comments and the extras line do not count);
2. the user's install: ``pip install -e '.[EXTRAS]'`` with no constraints file, as a user would run
   ``pip install spark_hvd[...]``; then every package of the snapshot must still be there at the same version
   (packages the runtime lacks may be added). Editable, so that the test process, Spark's Python workers and the
   ranks all import the same checked-out code the tests were written against; the dependency resolution, which is
   what this step checks, is the same as a non-editable install's (one metadata). The non-editable path is tested
   by tests/test_packaging.py, which installs the built wheel over the leg;
3. the test tools (pytest, ...) installed with the snapshot as constraints, so they cannot move a runtime package;
   checked again;
4. the frameworks import (``import lightning`` ...), the runtime's and those its extras added: the test modules
   skip themselves when a framework does not import, which on a leg that has the framework would hide a broken
   install as a skip;
5. ``pytest -m compat``: the tests marked ``compat`` (setup.cfg), with the leg's interpreter for the driver and
   Spark's workers. No test selected (pytest's exit code 5) is a failure: the subset is the leg's whole point.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import lock

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "spark-hvd"
# What a user of a Databricks ML runtime installs: the frameworks it already has, so nothing new should come in.
EXTRAS = "torch,tensorflow,spark,lightning,mlflow"
# What the compatibility subset needs beside the runtime and spark_hvd (the runtime has scikit-learn and pillow).
TEST_TOOLS = ["pytest>=8", "pytest-timeout", "build"]
# Distribution -> module: the frameworks the subset exercises, imported on every leg that has them (its file
# lists them or its extras added them).
FRAMEWORKS = {"pyspark": "pyspark", "numpy": "numpy", "pandas": "pandas", "pyarrow": "pyarrow", "torch": "torch",
              "tensorflow": "tensorflow", "keras": "keras", "lightning": "lightning", "mlflow-skinny": "mlflow",
              "mxnet": "mxnet"}
EXTRAS_LINE = "# leg-extras:"
STAMP = ".leg-stamp"
SNAPSHOT = "runtime-packages.json"


def venv_for(leg: Path) -> Path:
    """``runtimes/dbr-15.4-ml.txt`` -> ``<repo>/.venv-dbr-15.4-ml``."""
    return ROOT / f".venv-{leg.stem}"


def extras_for(leg: Path) -> str:
    """The extras a user of ``leg``'s runtime installs: its ``# leg-extras: a,b`` line, else ``EXTRAS``."""
    for line in leg.read_text().splitlines():
        if line.startswith(EXTRAS_LINE):
            return line[len(EXTRAS_LINE):].strip().replace(" ", "")
    return EXTRAS


def packages(python: Path) -> dict[str, str]:
    """``{normalised name: version}`` of what ``python`` has installed, spark_hvd excluded."""
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                            text=True).stdout
    found = {lock.normalise(p["name"]): p["version"] for p in json.loads(listed)}
    found.pop(PROJECT, None)
    return found


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """One line per package of ``before`` that ``after`` lacks or has at another version (additions are fine)."""
    lines = []
    for name, version in sorted(before.items()):
        now = after.get(name)
        if now != version:
            lines.append(f"  {name}: {version} -> {now or 'removed'}")
    return lines


def pip(python: Path, *args: str) -> None:
    """``python -m pip install ARGS``, echoed, raising on failure."""
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def build_runtime(leg: Path, venv: Path, base_python: str) -> dict[str, str]:
    """The runtime's virtualenv (reused while the leg file's pins are unchanged) and its package snapshot."""
    pins = "".join(f"{name}=={version}\n" for name, version in sorted(lock.read_lock(leg).items()))
    digest = hashlib.sha256(pins.encode()).hexdigest()
    python = venv / "bin" / "python"
    if (venv / STAMP).is_file() and (venv / STAMP).read_text() == digest:
        print(f"leg: reusing {venv.name} (built from this {leg.name})")
        return json.loads((venv / SNAPSHOT).read_text())
    start = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    pip(python, "-q", "-r", str(leg))
    snapshot = packages(python)
    (venv / SNAPSHOT).write_text(json.dumps(snapshot, indent=1, sort_keys=True) + "\n")
    (venv / STAMP).write_text(digest)
    print(f"leg: built {venv.name} from {leg.name} in {time.monotonic() - start:.0f} s ({len(snapshot)} packages)")
    return snapshot


def check_unchanged(python: Path, snapshot: dict[str, str], step: str, before: dict[str, str]) -> None:
    """Exit naming every runtime package that ``step`` changed; else say what it added to ``before``."""
    now = packages(python)
    diff = changed(snapshot, now)
    if diff:
        sys.exit(f"leg: {step} changed the runtime's packages:\n" + "\n".join(diff)
                 + "\nspark_hvd must install into a runtime without replacing its packages (issue 38): widen the "
                   "range in setup.cfg that forced each change.")
    added = sorted(now.keys() - before.keys())
    print(f"leg: {step}: no runtime package changed ({len(snapshot)} checked); added: {', '.join(added) or 'none'}")


def check_imports(python: Path, installed: dict[str, str]) -> None:
    """Exit naming the frameworks ``installed`` in the leg (the runtime's and those spark_hvd's extras added) that
    do not import in the leg's interpreter, with the error."""
    broken = []
    for dist, module in FRAMEWORKS.items():
        if dist in installed:
            proc = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, cwd="/")
            if proc.returncode:
                broken.append(f"  import {module}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    if broken:
        sys.exit("leg: frameworks of the leg do not import (the tests would skip, not fail):\n" + "\n".join(broken))
    print(f"leg: {', '.join(FRAMEWORKS[d] for d in FRAMEWORKS if d in installed)} import")


def run_subset(python: Path, pytest_args: list[str]) -> int:
    """``pytest -m compat`` with the leg's interpreter everywhere; exit code 5 (nothing selected) is a failure."""
    env = dict(os.environ, PYSPARK_PYTHON=str(python), PYSPARK_DRIVER_PYTHON=str(python))
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("VIRTUAL_ENV", None)
    cmd = [str(python), "-m", "pytest", "-m", "compat", "-p", "no:cacheprovider", "--durations=15", *pytest_args]
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    if code == 5:
        print("leg: no test is marked compat: the subset is empty (mark tests with @pytest.mark.compat)",
              file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("leg", type=Path, help="a leg file, e.g. runtimes/dbr-15.4-ml.txt")
    parser.add_argument("--extras", help=f"spark_hvd's extras to install (default: the leg file's "
                                         f"'{EXTRAS_LINE}' line, else {EXTRAS})")
    parser.add_argument("--python", default="python3.11", help="the interpreter the virtualenv is made from")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    leg = args.leg.resolve()
    venv = venv_for(leg)
    python = venv / "bin" / "python"

    extras = args.extras or extras_for(leg)
    snapshot = build_runtime(leg, venv, args.python)
    start = time.monotonic()
    before = packages(python)
    pip(python, "-q", "-e", f".[{extras}]")
    check_unchanged(python, snapshot, f"pip install -e '.[{extras}]'", before)
    constraints = venv / "runtime-constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(snapshot.items())))
    before = packages(python)
    pip(python, "-q", "-c", str(constraints), *TEST_TOOLS)
    check_unchanged(python, snapshot, "installing the test tools", before)
    print(f"leg: spark_hvd and the test tools installed in {time.monotonic() - start:.0f} s", flush=True)
    check_imports(python, packages(python))
    return run_subset(python, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
