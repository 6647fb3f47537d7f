"""spark_hvd: distributed deep learning on Spark over a ring-allreduce core (configuration in setup.cfg).

The one thing setup.cfg cannot say: the optional compiled ring loop, ``spark_hvd.core.transport._ringloop``.

- Declared only when its source is in the tree, so a checkout without it installs as pure Python.
- ``optional=True``: a failed compile or link (no gcc, no Python headers) prints a warning and the install goes
  on; ``spark_hvd.core`` then imports no ``_ringloop`` and runs its Python loop. It links no library of its own:
  frames are tagged by the ``cryptography`` package the Python loop uses, or by the system's libcrypto, loaded at
  run time where it is found.
- ``pip install -e .`` (PEP 660, what ``make setup`` runs) builds it in place: the ``.so`` lands beside the
  ``.c`` in spark_hvd/core/transport/, where the editable install imports it from. Each install compiles afresh (pip
  builds in a new temporary directory) and first deletes the ``.so`` in place, so a ``.c`` that no longer
  compiles leaves the Python loop running, never the last good build of older source.
- ``SPARK_HVD_PURE=1`` leaves it out on purpose: ``SPARK_HVD_PURE=1 python -m build`` makes a pure-Python
  ``py3-none-any`` wheel that installs on every platform and Python (the Python loop), beside an sdist that
  compiles the fast loop where it is installed with a compiler. Without it, ``python -m build --wheel`` makes a
  wheel for this platform and Python only (``cp311-cp311-linux_x86_64``) when the compile succeeds.
- ``-O2 -ffp-contract=off`` after Python's own flags (its ``-O3`` overridden): no ``-march=native``, no
  ``-ffast-math``, no fused multiply-add, so the sums are bitwise IEEE and the ``.so`` runs on every host.
"""

import os
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
RINGLOOP = "spark_hvd/core/transport/_ringloop.c"


class FreshInplaceBuildExt(build_ext):
    """``build_ext`` that removes an in-place ``.so`` before building, so a failed build leaves none behind."""

    def run(self) -> None:
        if self.inplace:  # pip install -e (editable mode sets it)
            for ext in self.extensions:
                (ROOT / self.get_ext_filename(self.get_ext_fullname(ext.name))).unlink(missing_ok=True)
        super().run()


ext_modules = []
if (ROOT / RINGLOOP).is_file() and os.environ.get("SPARK_HVD_PURE", "") not in ("1", "true", "yes"):
    ext_modules.append(Extension(
        "spark_hvd.core.transport._ringloop",
        sources=[RINGLOOP],
        extra_compile_args=["-O2", "-ffp-contract=off"],
        optional=True,
    ))

setup(ext_modules=ext_modules, cmdclass={"build_ext": FreshInplaceBuildExt})
