"""The engine on the torch.distributed (gloo) backend, two spawned ranks meeting through the KV rendezvous.

Mismatch errors and the full dtype x op matrix are covered on the ring and MPI backends (same engine).
"""

from __future__ import annotations

import helpers.engine_scenarios as sc
import pytest
from helpers.ranks import run_ranks

pytest.importorskip("torch")


def _torch_job() -> dict:
    import spark_hvd.core as core

    core.init()
    try:
        assert core.backend_name() == "torch"
        report = {"checked": sc.collectives(seed=21, full_matrix=False)}
        sc.different_orders(seed=4, count=8)
        report["fusion"] = sc.fusion()
        report["join"] = sc.join_uneven()
        report["local"] = (core.local_rank(), core.local_size(), core.cross_size())
        return report
    finally:
        core.shutdown()


def test_engine_on_torch_gloo_np2():
    env = {"SPARK_HVD_BACKEND": "torch", "SPARK_HVD_TIMEOUT": "60", "SPARK_HVD_CYCLE_TIME": "5"}
    reports = run_ranks(_torch_job, 2, env=env, timeout=150)
    for rank, report in enumerate(reports):
        assert report["checked"] >= 14
        assert report["fusion"]["allreduce_tensors"] == 100
        assert report["fusion"]["allreduce_collectives"] <= 25
        assert report["join"] == 1
        assert report["local"] == (rank, 2, 1)
