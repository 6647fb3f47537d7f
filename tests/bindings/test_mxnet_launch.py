"""examples/mxnet_gluon.py launched the three ways a user launches a script: ``spark-hvd-run -np 2``, ``run(main)``
on two Spark tasks, and ``run("examples/mxnet_gluon.py")``; each time the ranks end with identical weights."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.mxnet_env import mxnet_skip_reason

# The floor leg (make leg-floor) installs MXNet and runs these with the compatibility subset; elsewhere they skip.
pytestmark = pytest.mark.compat

if (_reason := mxnet_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mxnet_gluon.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gluon_example_under_the_launcher():
    cmd = [sys.executable, "-m", "spark_hvd.runner", "-np", "2", "--timeout", "240", sys.executable, str(EXAMPLE),
           "--epochs", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "ranks=2 weights identical on every rank: True" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_gluon_example_under_spark_run(spark):
    """``run(main)`` (a function) and ``run(path)`` (the script as ``__main__``) on two Spark tasks."""
    import cloudpickle

    from spark_hvd.runner import run

    spec = importlib.util.spec_from_file_location("mxnet_gluon_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the tasks cannot import examples/
    results = run(module.main, args=(["--epochs", "2"],), num_proc=2, env={"OMP_NUM_THREADS": "1"})
    assert [r["rank"] for r in results] == [0.0, 1.0]
    assert all(r["same"] == 1.0 for r in results), results
    assert results[0]["accuracy"] > 0.9, results
    assert run(str(EXAMPLE), args=["--epochs", "1"], num_proc=2, env={"OMP_NUM_THREADS": "1"}) == [0, 0]
