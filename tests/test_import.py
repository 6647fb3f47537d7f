"""The light layers stay light: ``import spark_hvd`` and the store/data layers pull in no torch, tensorflow, keras,
mxnet or pyspark at module level (DESIGN.md: heavy frameworks are imported where they are used)."""

import pkgutil
import subprocess
import sys

import pytest

import spark_hvd.core

#: every module of the core layer and its rooms, the torch.distributed ones included (they import torch only when used)
CORE_MODULES = ", ".join(m.name for m in pkgutil.walk_packages(spark_hvd.core.__path__, "spark_hvd.core."))


@pytest.mark.parametrize("modules", [
    "spark_hvd, spark_hvd._binding_common, spark_hvd.core, " + CORE_MODULES,
    "spark_hvd.store, spark_hvd.data, spark_hvd.data.reader, spark_hvd.data.prepare",
], ids=["spark_hvd", "store-and-data"])
def test_import_pulls_in_no_framework(modules):
    code = (
        f"import sys, {modules}\n"
        "heavy = [m for m in ('torch', 'tensorflow', 'keras', 'pyspark', 'mxnet') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import {modules} imported {out}"


def test_store_loads_no_core_module():
    """The store reaches spark_hvd's root error without loading the ring core (its engine, context, settings)."""
    code = ("import sys, spark_hvd.store\n"
            "print(','.join(sorted(m for m in sys.modules if m.startswith('spark_hvd.core'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import spark_hvd.store loaded {out}"
