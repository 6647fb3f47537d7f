"""The runnable examples a new user meets first: ``make demo`` (examples/demo.py) and the Horovod-style scripts.

Each runs as a user would run it, in a subprocess, and is checked on what it prints. (examples/horovod_torch.py
and its timeline run in notebooks/horovod_api.ipynb, tested by tests/test_notebooks.py.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
LAUNCHER = [sys.executable, "-m", "spark_hvd.runner"]


def _run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n" \
                                 f"stderr:\n{proc.stderr[-3000:]}"
    return proc


def test_demo_help():
    proc = _run([sys.executable, str(EXAMPLES / "demo.py"), "--help"], timeout=120)
    assert "--epochs" in proc.stdout


@pytest.mark.slow
def test_demo_runs_and_prints_the_summary(tmp_path: Path):
    """``make demo`` in short: one epoch; the Keras part runs where KerasEstimator exists."""
    proc = _run([sys.executable, str(EXAMPLES / "demo.py"), "--epochs", "1", "--keep", str(tmp_path)], timeout=900)
    out = proc.stdout
    assert re.search(r"torch: holdout accuracy 0\.\d+", out), out
    summary = [line for line in out.splitlines() if line.startswith("SUMMARY")]
    assert len(summary) == 1 and "save/load ok" in summary[0], out
    assert (tmp_path / "torch_pipeline" / "metadata").exists()


@pytest.mark.slow
def test_horovod_keras_example_two_ranks():
    pytest.importorskip("keras")
    proc = _run([*LAUNCHER, "-np", "2", "--timeout", "600", sys.executable, str(EXAMPLES / "horovod_keras.py"),
                 "--epochs", "2"], timeout=700)
    assert "ranks=2 weights identical on every rank: True" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_spark_submit_command_of_the_readme():
    """README: ``spark-submit --master 'local[2]' examples/spark_submit_train.py`` (with this venv's Python)."""
    spark_submit = Path(sys.executable).parent / "spark-submit"
    if not spark_submit.exists():
        pytest.skip("no spark-submit next to this Python (pyspark not installed here)")
    proc = _run([str(spark_submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                 str(EXAMPLES / "spark_submit_train.py")], timeout=900,
                PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    assert proc.stdout.rstrip().splitlines()[-1] == "OK", proc.stdout[-3000:]


@pytest.mark.slow
def test_tensorflow_loop_example_two_ranks():
    """docs/tensorflow.md's script under the launcher."""
    pytest.importorskip("tensorflow")
    proc = _run([*LAUNCHER, "-np", "2", "--timeout", "500", sys.executable, str(EXAMPLES / "tensorflow_loop.py"),
                 "--steps", "40"], timeout=600)
    assert "ranks=2 weights identical on every rank: True" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_tensorflow_loop_example_under_spark_run(spark):
    """The same script's ``main`` on two Spark tasks through ``spark_hvd.runner.run``."""
    pytest.importorskip("tensorflow")
    import importlib.util

    import cloudpickle

    from spark_hvd.runner import run

    spec = importlib.util.spec_from_file_location("tensorflow_loop_example", EXAMPLES / "tensorflow_loop.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the tasks cannot import examples/
    results = run(module.main, args=(["--steps", "40"],), num_proc=2, env={"OMP_NUM_THREADS": "1"})
    assert [r["rank"] for r in results] == [0.0, 1.0]
    assert all(r["same"] == 1.0 for r in results), results
    assert results[0]["accuracy"] > 0.5, results
