"""spark_hvd.keras under Keras mixed precision on two ranks (spark-hvd-run): ``mixed_bfloat16`` and
``mixed_float16`` fits against one process on the global batches, the ``LossScaleOptimizer`` reduced once per step
with its scale kept equal to one process's, an overflow on one rank skipping the step on every rank, and the refused
combinations. The worker script runs every check once per launch; each check is one test here."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker

pytest.importorskip("keras")
pytest.importorskip("tensorflow")

CHECKS = [
    "mixed_bfloat16_matches_single_process",
    "mixed_float16_loss_scale_matches_single_process",
    "overflow_on_one_rank_skips_the_step_everywhere",
    "refused_combinations",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_worker("keras_mixed_worker.py", 2, tmp_path_factory.mktemp("keras_mixed"), timeout_s=300)


@pytest.mark.slow
@pytest.mark.timeout(320)
@pytest.mark.parametrize("name", CHECKS)
def test_two_ranks(two_ranks, name):
    assert_check(two_ranks, name)
