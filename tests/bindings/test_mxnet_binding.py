"""spark_hvd.mxnet on two ranks (spark-hvd-run): every collective against numpy on random data for every dtype, in
place and not; a Gluon model trained with DistributedTrainer (SGD with momentum, Adam; groups, predivide, fp16) and
with DistributedOptimizer equal to one process on the combined batches; broadcast_parameters (Gluon, dicts of
NDArrays, deferred initialisation); the in-place forms working in the NDArray's own memory; errors. One launch runs
every check (tests/bindings/scripts/mxnet_worker.py); each check is one test here. Skipped where mxnet does not
import (it needs numpy < 1.24: docs/mxnet.md).

``test_mxnet_zero_np2``: DistributedTrainer's sharded update (spark_hvd/mxnet/zero.py), its own launch
(scripts/mxnet_zero_worker.py, ~10 s): SGD with momentum and Adam with per-parameter lr_mult / wd_mult, weight
decay, clip_gradient and a learning-rate scheduler equal to one process on the combined batches and to the
allreduce path; save_states / load_states in Gluon's format both ways; the fallback where the update would not be
exact; stale gradients. Not in the compatibility subset (the legs' time): run it where MXNet imports, e.g.
``.venv-dbr-15.4-ml/bin/python -m pytest tests/bindings/test_mxnet_binding.py -k zero`` after ``make leg-floor``."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker
from helpers.mxnet_env import mxnet_skip_reason

if (_reason := mxnet_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

CHECKS = [
    "allreduce_every_op_and_dtype",
    "adasum",
    "grouped_allreduce_one_and_mixed_dtypes",
    "allgather_ragged_every_dtype",
    "broadcast_every_dtype",
    "alltoall_with_and_without_splits",
    "reducescatter_sum_average_uneven",
    "compression_fp16_allreduce",
    "in_place_forms_use_the_ndarray_memory",
    "mx_np_arrays_come_back_as_mx_np_arrays",
    "objects_barrier_join",
    "argument_errors_name_the_rank",
    "mismatch_raises_runtime_error_naming_ranks",
    "trainer_matches_single_process_on_combined_batches",
    "trainer_options_groups_predivide_fp16",
    "distributed_optimizer_in_gluon_trainer",
    "trainer_waits_for_queued_reads_of_a_gradient",
    "broadcast_parameters_makes_ranks_equal",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_worker("mxnet_worker.py", 2, tmp_path_factory.mktemp("mxnet2"), timeout_s=300)


# The floor leg (make leg-floor) installs MXNet and runs these with the compatibility subset; elsewhere they skip.
@pytest.mark.compat
@pytest.mark.timeout(320)
@pytest.mark.parametrize("name", CHECKS)
def test_mxnet_np2(two_ranks, name):
    assert_check(two_ranks, name)


ZERO_CHECKS = [
    "sharded_matches_single_process_sgd_adam_mults_clip_scheduler",
    "save_and_load_states_in_gluon_format",
    "falls_back_where_not_exact",
    "stale_gradients_as_gluon",
]


@pytest.fixture(scope="module")
def sharded_job(tmp_path_factory):
    return launch_worker("mxnet_zero_worker.py", 2, tmp_path_factory.mktemp("mxzero"), timeout_s=240)


@pytest.mark.timeout(260)
@pytest.mark.parametrize("name", ZERO_CHECKS)
def test_mxnet_zero_np2(sharded_job, name):
    assert_check(sharded_job, name)
