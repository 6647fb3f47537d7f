"""The sharded update of spark_hvd.mxnet's DistributedTrainer (spark_hvd/mxnet/zero.py) on two ranks: SGD with
momentum and Adam with per-parameter lr_mult / wd_mult, weight decay, clip_gradient and a learning-rate scheduler
equal to one process on the combined batches (and to the allreduce path); save_states / load_states in Gluon's
format both ways; the fallback where the update would not be exact; stale gradients as Gluon handles them. One
launch runs every check (tests/bindings/scripts/mxnet_zero_worker.py, ~10 s); skipped where mxnet does not import.
Not in the compatibility subset (the legs' time): run it in an environment with MXNet, e.g.
``.venv-dbr-15.4-ml/bin/python -m pytest tests/bindings/test_mxnet_zero.py`` after ``make leg-floor``."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker
from helpers.mxnet_env import mxnet_skip_reason

if (_reason := mxnet_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

CHECKS = [
    "sharded_matches_single_process_sgd_adam_mults_clip_scheduler",
    "save_and_load_states_in_gluon_format",
    "falls_back_where_not_exact",
    "stale_gradients_as_gluon",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_worker("mxnet_zero_worker.py", 2, tmp_path_factory.mktemp("mxzero"), timeout_s=240)


@pytest.mark.timeout(260)
@pytest.mark.parametrize("name", CHECKS)
def test_mxnet_zero_np2(two_ranks, name):
    assert_check(two_ranks, name)
