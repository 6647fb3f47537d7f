"""Horovod compatibility of spark_hvd.torch at N=2 and N=3 (spark-hvd-run): Horovod's gradients through every
collective (against its backward definitions written out in numpy), grouped allgather/reducescatter, scaled
reducescatter, sparse gradients, bad-input errors, build queries, the timeline API. One launch per size runs every
check; each check is one test here."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.launch import assert_check, launch_worker

pytest.importorskip("torch")

CHECKS = [
    "grad_allgather",
    "grad_grouped_allgather",
    "grad_broadcast",
    "grad_alltoall",
    "grad_reducescatter",
    "grad_grouped_reducescatter",
    "grad_grouped_allreduce",
    "grouped_async_and_scaled_values",
    "sparse_allreduce_async",
    "bad_input_errors_keep_the_engine",
    "sparse_gradients_match_single_process",
    "broadcast_optimizer_state_zero_grads",
    "sync_batch_norm_matches_single_process",
    "build_queries",
    "start_stop_timeline",
    "join_rejects_all_but_allreduce",
    "init_after_failure",
]


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def ranks(request, tmp_path_factory):
    return launch_worker("torch_compat_worker.py", request.param, tmp_path_factory.mktemp(f"compat{request.param}"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHECKS)
def test_compat(ranks, name):
    assert_check(ranks, name)


def test_float16_scale_rounds_once():
    """A float16 buffer scaled by a factor is multiplied in float32 and rounded once (Horovod), not multiplied by
    the factor rounded to float16."""
    from spark_hvd.core.reduce import scale_inplace

    a = np.random.default_rng(0).uniform(-4, 4, 4913).astype(np.float16)
    for factor in (0.37, 1 / 3, 2.5e-3):
        b = a.copy()
        scale_inplace(b, factor)
        np.testing.assert_array_equal(b, (a.astype(np.float32) * np.float32(factor)).astype(np.float16))
