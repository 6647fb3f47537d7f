"""spark_hvd.keras (Keras 3, TensorFlow) on two ranks (spark-hvd-run) and on one: collectives against numpy in eager
mode and in tf.function, model.fit against one process, one grouped collective per step, callbacks, save/load, join.
The worker script runs every check once per launch; each check is one test here."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker

pytest.importorskip("keras")
pytest.importorskip("tensorflow")

CHECKS = [
    "before_init_error",
    "collectives_float32_eager",
    "collectives_float16_eager",
    "collectives_bfloat16_eager",
    "collectives_int64_eager",
    "collectives_float32_tf_function",
    "collectives_bfloat16_tf_function",
    "objects_barrier",
    "fit_matches_single_process",
    "one_grouped_collective_per_step",
    "backward_passes_per_step_2",
    "horovod_optimizer_arguments",
    "fp16_compression_loss_within_5pct",
    "broadcast_callback_and_metric_average",
    "broadcast_callback_optimizer_state",
    "lr_warmup",
    "lr_schedule_best_checkpoint_local_variables",
    "partial_distributed_optimizer",
    "save_and_load_model",
    "join_uneven_batches",
    "compute_gradients_reduced_once",
    "compute_gradients_backward_passes_3_average_False",
    "compute_gradients_backward_passes_3_average_True",
    "elastic_keras_state_sync_snapshots",
]

# at size 1 (no launcher): the size-1 paths, not every feature again
QUICK_CHECKS = ["before_init_error", "collectives_float32_eager", "collectives_bfloat16_eager",
                "collectives_float32_tf_function", "objects_barrier", "fit_matches_single_process",
                "save_and_load_model"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_worker("keras_worker.py", 2, tmp_path_factory.mktemp("keras2"), timeout_s=400)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return launch_worker("keras_worker.py", 1, tmp_path_factory.mktemp("keras1"), timeout_s=300, quick=True)


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", CHECKS)
def test_two_ranks(two_ranks, name):
    assert_check(two_ranks, name)


@pytest.mark.slow
@pytest.mark.timeout(320)
@pytest.mark.parametrize("name", QUICK_CHECKS)
def test_one_rank(one_rank, name):
    assert_check(one_rank, name)
