"""``import spark_hvd`` stays light: no torch, tensorflow or pyspark."""

import subprocess
import sys


def test_import_spark_hvd_pulls_in_no_framework():
    code = (
        "import sys, spark_hvd, spark_hvd.core\n"
        "heavy = [m for m in ('torch', 'tensorflow', 'keras', 'pyspark') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import spark_hvd imported {out}"
