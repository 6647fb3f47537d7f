"""spark_hvd.keras on Keras's JAX backend at two ranks (spark-hvd-run): collectives against numpy, an allreduce
inside jax.jit, and model.fit with DistributedOptimizer equal to one process on the combined batches. One
launch runs every check; each check is one test here."""

from __future__ import annotations

import pytest
from helpers.launch import assert_check, launch_worker

pytest.importorskip("jax")
pytest.importorskip("keras")

CHECKS = ["backend_is_jax", "collectives_against_numpy", "allreduce_inside_jit", "fit_matches_single_process"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return launch_worker("jax_worker.py", 2, tmp_path_factory.mktemp("jax2"), timeout_s=300)


@pytest.mark.slow  # two Keras-on-JAX ranks
@pytest.mark.timeout(320)
@pytest.mark.parametrize("name", CHECKS)
def test_keras_jax_np2(two_ranks, name):
    assert_check(two_ranks, name)
