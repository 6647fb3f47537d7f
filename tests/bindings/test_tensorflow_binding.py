"""spark_hvd.tensorflow on two ranks (spark-hvd-run): every collective against numpy on random data, eagerly, in
tf.function and in a TF1 graph; Horovod's gradients; a TF2 custom loop with DistributedGradientTape (eager and
tf.function) and DistributedOptimizer equal to one process on the combined batches; partial tapes, SyncBatchNorm,
join, process sets, elastic states. One launch runs every check (TensorFlow's import is slow); each check is one
test here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers.launch import assert_check, launch_worker

pytest.importorskip("tensorflow")

CHECKS = [
    "collectives_eager",
    "host_memory_without_copies",
    "collectives_tf_function",
    "collectives_tf1_graph_session",
    "tf1_graph_built_before_init",
    "indexed_slices_allreduce",
    "gradients_eager_and_tf_function",
    "training_tape_matches_single_process_eager",
    "training_tape_matches_single_process_tf_function",
    "distributed_optimizer_keras_in_tf_loop",
    "partial_tape_local_layers",
    "sync_batch_norm_matches_whole_batch",
    "objects_join_barrier_ops_process_set",
    "mismatch_raises_failed_precondition",
    "elastic_tensorflow_state",
    "device_path_dlpack_gloo_stand_in",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_worker("tf_worker.py", 2, tmp_path_factory.mktemp("tf2"), timeout_s=400)


@pytest.mark.compat
@pytest.mark.slow  # two TensorFlow ranks
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", CHECKS)
def test_tensorflow_np2(two_ranks, name):
    assert_check(two_ranks, name)


@pytest.mark.slow  # a fresh interpreter imports TensorFlow
def test_import_loads_no_keras_binding():
    """``import spark_hvd.tensorflow`` loads no ``spark_hvd.keras`` (its backend switch could import torch or raise
    ImportError): what the two bindings share is in ``spark_hvd._keras_common``."""
    code = "import sys, spark_hvd.tensorflow; print(sorted(m for m in sys.modules if m.startswith('spark_hvd.keras')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
