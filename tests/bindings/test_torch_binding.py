"""spark_hvd.torch on two ranks (spark-hvd-run) and on one: collectives against numpy, training against one
process, broadcasts, join. The worker script runs every check once per launch; each check is one test here."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker

pytest.importorskip("torch")

CHECKS = [
    "before_init_error",
    "collectives_float32",
    "collectives_float16",
    "collectives_bfloat16",
    "collectives_int64",
    "allreduce_in_place_changed_tensor",
    "allreduce_autograd",
    "objects_barrier",
    "train_matches_single_process",
    "train_grouped_matches_single_process",
    "backward_passes_per_step_2",
    "synchronize_clip_skip_synchronize",
    "fp16_compression_loss_within_5pct",
    "zero_grad_with_allreduce_in_flight",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "join_uneven_batches",
    "keras_torch_backend_fit",
]

# at size 1 (no launcher): the size-1 paths, not every feature again
QUICK_CHECKS = ["before_init_error", "collectives_float32", "collectives_bfloat16", "collectives_int64",
                "allreduce_autograd", "objects_barrier", "train_matches_single_process", "backward_passes_per_step_2",
                "broadcast_parameters", "broadcast_optimizer_state", "join_uneven_batches"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_worker("torch_worker.py", 2, tmp_path_factory.mktemp("torch2"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return launch_worker("torch_worker.py", 1, tmp_path_factory.mktemp("torch1"), quick=True)


@pytest.mark.compat
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHECKS)
def test_two_ranks(two_ranks, name):
    assert_check(two_ranks, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", QUICK_CHECKS)
def test_one_rank(one_rank, name):
    assert_check(one_rank, name)


def test_before_init_in_process():
    """In this (uninitialised) pytest process the error names init(); skipped if another test initialised."""
    import torch

    import spark_hvd.core
    import spark_hvd.torch as hvd

    if spark_hvd.core.is_initialized():
        pytest.skip("the core was initialised by another test in this process")
    with pytest.raises(hvd.NotInitializedError, match=r"call hvd\.init\(\) before using allreduce\(\)"):
        hvd.allreduce(torch.ones(2))
    with pytest.raises(hvd.NotInitializedError, match="init()"):
        hvd.size()
