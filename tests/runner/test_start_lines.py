"""TensorFlow's start-up lines (written from C++ at import, whatever TF_CPP_MIN_LOG_LEVEL says) are dropped from a
rank's standard error while every other line passes, in order; the real standard error is back afterwards."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = r"""
import os, sys
from spark_hvd.runner.start_lines import dropped_start_lines
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
with dropped_start_lines():
    os.write(2, b"before\n")
    import tensorflow
    print("python line", file=sys.stderr, flush=True)
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")
    os.write(2, b"no newline at the end")
os.write(2, b"\nafter\n")
print("stdout untouched")
"""


@pytest.mark.slow  # fresh interpreters import TensorFlow
def test_tensorflow_start_lines_are_dropped_and_the_rest_passes():
    import spark_hvd

    plain = subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True, text=True, timeout=300,
                           env={"TF_CPP_MIN_LOG_LEVEL": "2", "PATH": "/usr/bin:/bin"})
    if "oneDNN custom operations are on" not in plain.stderr:
        pytest.skip("this TensorFlow writes no start-up lines to drop")
    root = spark_hvd.__path__[0].rsplit("/", 1)[0]
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "stdout untouched\n"
    assert out.stderr == "before\npython line\nno newline at the end\nafter\n", out.stderr


_RANK = r"""
import os, sys
from spark_hvd.runner.start_lines import quiet_imports
with quiet_imports():  # as a rank unpickles an estimator's payload (a Keras model imports TensorFlow)
    import tensorflow
print(os.environ["TF_CPP_MIN_LOG_LEVEL"], os.environ["GRPC_VERBOSITY"])
"""


@pytest.mark.slow  # fresh interpreters import TensorFlow
@pytest.mark.parametrize("user_level", [None, "0"])
def test_an_estimator_rank_imports_tensorflow_quietly_unless_the_user_set_the_level(user_level):
    import spark_hvd

    env = {"PYTHONPATH": spark_hvd.__path__[0].rsplit("/", 1)[0], "PATH": "/usr/bin:/bin",
           "SPARK_HVD_QUIET_FRAMEWORK_LOGS": "1"}
    if user_level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = user_level
    out = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    if user_level is None:
        assert out.stdout == "2 ERROR\n" and out.stderr == "", out.stderr
    else:  # the user's setting stands, and TensorFlow says what it says at that level
        assert out.stdout == "0 ERROR\n" and "cpu_feature_guard" in out.stderr, out.stderr
