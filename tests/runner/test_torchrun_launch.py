"""``spark-hvd-run -np 2 python script.py``: torchrun's variables, and ``env://`` over the launcher's
authenticated KV service (the command starts through ``spark_hvd.runner.pyrun``), beside the Horovod API."""

from __future__ import annotations

import json
import os
import sys

from spark_hvd.runner import run_local
from spark_hvd.runner.pyrun import wrap

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def test_a_python_script_meets_over_the_launchers_store(tmp_path):
    script = os.path.join(SCRIPTS, "torchrun_report.py")
    result = run_local([sys.executable, script, "--dir", str(tmp_path)], np=2, capture=True, timeout=300)
    assert result.returncode == 0, "\n".join(result.stderr[-30:])
    for r in (0, 1):
        rep = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rep["argv"] == ["--dir", str(tmp_path)] and rep["name"] == "__main__"
        assert rep["dist"] == [r, 2] and rep["hvd"] == [r, 2, r]
        assert rep["env"]["LOCAL_RANK"] == str(r) and rep["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert rep["dist_sum"] == rep["hvd_sum"] == 3.0
        assert rep["store"] == "KVTorchStore"


def test_only_this_interpreters_python_scripts_are_wrapped():
    assert wrap([sys.executable, "t.py", "-x"]) == [sys.executable, "-m", "spark_hvd.runner.pyrun", "t.py", "-x"]
    assert wrap([sys.executable, "-m", "pkg.mod"])[:3] == [sys.executable, "-m", "spark_hvd.runner.pyrun"]
    assert wrap([sys.executable, "-c", "print(1)"]) == [sys.executable, "-c", "print(1)"]
    assert wrap(["bash", "t.py"]) == ["bash", "t.py"]
