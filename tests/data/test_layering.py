"""The store and data layers import no framework (and no pyspark) at module level."""

import subprocess
import sys


def test_store_and_data_import_no_framework():
    code = (
        "import sys, spark_hvd.store, spark_hvd.data, spark_hvd.data.reader, spark_hvd.data.prepare\n"
        "heavy = [m for m in ('torch', 'tensorflow', 'keras', 'pyspark') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"the store/data layers imported {out}"
