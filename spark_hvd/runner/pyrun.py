"""``python -m spark_hvd.runner.pyrun train.py ARGS`` (or ``-m module ARGS``): run a Python program as
``python train.py ARGS`` would, with ``env://`` answered over the job's authenticated store
(``spark_hvd.core.torchrun.install``).

``spark-hvd-run`` starts a rank's ``python train.py ...`` this way when that ``python`` is the interpreter it
runs on (so spark_hvd is importable there); the program sees the same ``sys.argv`` and ``sys.path[0]``.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

from spark_hvd.core import torchrun


def wrap(argv: Sequence[str]) -> list[str]:
    """``argv`` started through this module when it is ``[this interpreter, script.py | -m module, ...]``."""
    argv = list(argv)
    if len(argv) < 2 or not (argv[1].endswith(".py") or (argv[1] == "-m" and len(argv) > 2)):
        return argv
    import shutil

    found = shutil.which(argv[0])
    if found is None or os.path.realpath(found) != os.path.realpath(sys.executable):
        return argv
    return [argv[0], "-m", __name__, *argv[1:]]


def launcher_python(argv: Sequence[str]) -> list[str]:
    """``argv`` with a bare ``python`` / ``python3`` replaced by this interpreter (the one spark_hvd is installed
    in), as ``spark-hvd-run`` runs local ranks; a note on stderr says so when PATH's one differs. A full path
    (``/usr/bin/python3``) is left as given."""
    import shutil

    argv = list(argv)
    if not argv or argv[0] not in ("python", "python3"):
        return argv
    found = shutil.which(argv[0])
    if found is None or os.path.realpath(found) != os.path.realpath(sys.executable):
        sys.stderr.write(f"spark-hvd-run: running {argv[0]!r} as the launcher's interpreter {sys.executable} "
                         f"(PATH's is {found or 'absent'}); give a full path to run another\n")
    return [sys.executable, *argv[1:]]


def main(argv: Sequence[str]) -> None:
    """Run ``argv`` (``script.py ARGS`` or ``-m module ARGS``) as ``__main__``."""
    torchrun.install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
