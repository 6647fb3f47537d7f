"""spark_hvd.mxnet on two ranks (spark-hvd-run): every collective against numpy on random data for every dtype, in
place and not; a Gluon model trained with DistributedTrainer (SGD with momentum, Adam; groups, predivide, fp16) and
with DistributedOptimizer equal to one process on the combined batches; broadcast_parameters (Gluon, dicts of
NDArrays, deferred initialisation); the in-place forms working in the NDArray's own memory; errors. One launch runs
every check (tests/bindings/scripts/mxnet_worker.py); each check is one test here. Skipped where mxnet does not
import (it needs numpy < 1.24: docs/mxnet.md)."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker
from helpers.mxnet_env import mxnet_skip_reason

# The floor leg (make leg-floor) installs MXNet and runs these with the compatibility subset; elsewhere they skip.
pytestmark = pytest.mark.compat

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


@pytest.mark.timeout(320)
@pytest.mark.parametrize("name", CHECKS)
def test_mxnet_np2(two_ranks, name):
    assert_check(two_ranks, name)
