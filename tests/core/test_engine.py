"""The engine on the built-in ring backend at N = 1..4 (spawned ranks), plus in-process engine checks."""

from __future__ import annotations

import json
import os
import signal

import helpers.engine_scenarios as sc
import numpy as np
import pytest
from helpers.ranks import RankDied, run_ranks

import spark_hvd.core as core
from spark_hvd.core.backends.local_backend import LocalBackend
from spark_hvd.core.engine.engine import Engine
from spark_hvd.core.settings import Settings

FAST = {"SPARK_HVD_TIMEOUT": "60", "SPARK_HVD_CYCLE_TIME": "5"}


def _ring_job() -> dict:
    core.init()
    try:
        n = core.size()
        assert core.backend_name() == ("local" if n == 1 else "ring")
        report = {"checked": sc.collectives(seed=30 + n, full_matrix=n <= 2)}
        sc.different_orders(seed=n)
        report["partial"] = sc.cached_partial_rounds()
        report["fusion"] = sc.fusion()
        report["fusion_again"] = sc.fusion()
        if n > 1:
            report["mismatch"] = sc.mismatch()
        report["join"] = sc.join_uneven()
        if n > 1:
            report["join_other_ops"] = sc.join_other_ops()
        return report
    finally:
        core.shutdown()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_engine_on_ring(n, monkeypatch, tmp_path):
    if n == 1:  # a job of one rank uses no sockets: run it in this process
        for var in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
            monkeypatch.delenv(var, raising=False)
        for var, value in FAST.items():
            monkeypatch.setenv(var, value)
        core.shutdown()
        reports = [_ring_job()]
    else:
        env = dict(FAST)
        if n == 2:  # and a timeline per rank
            env["SPARK_HVD_TIMELINE"] = str(tmp_path / "timeline-{rank}.json")
        reports = run_ranks(_ring_job, n, env=env, timeout=170)
        if n == 2:
            for r in range(2):
                with open(tmp_path / f"timeline-{r}.json", encoding="utf-8") as f:
                    events = json.load(f)
                assert {"NEGOTIATE", "ALLREDUCE", "ALLGATHER", "BROADCAST"} <= {e["name"] for e in events}
                assert {e["pid"] for e in events} == {r}
    for report in reports:
        assert report["checked"] >= (27 if n <= 2 else 14)
        first, again = report["fusion"], report["fusion_again"]
        assert first["allreduce_tensors"] == again["allreduce_tensors"] == 100
        # fused: far fewer collectives than tensors (they may arrive in a few rounds on a loaded machine)
        assert first["allreduce_collectives"] <= 25, first
        assert again["allreduce_collectives"] <= 25, again
        # the second pass over the same names is answered from the response cache
        assert again["cache_hits"] == 100, again
        assert report["partial"]["cache_hits"] == 40  # the second and third passes are sent as cache ids
        assert report["join"] == n - 1
        if n > 1:
            assert len(report["mismatch"]) == 3
            assert report["join_other_ops"] in range(1, n)  # whichever of ranks 1.. joined last
            assert f"ranks [{n - 1}]" in report["mismatch"][0] or "rank" in report["mismatch"][0]
    assert all(r["fusion"] == reports[0]["fusion"] for r in reports), "ranks disagree on the fusion plan"


def _stall_job() -> str:
    core.init()
    try:
        return sc.stall()
    finally:
        core.shutdown()


def test_stall_warning_names_tensor_and_missing_ranks():
    env = dict(FAST, SPARK_HVD_STALL_CHECK_TIME="0.5")
    messages = run_ranks(_stall_job, 2, env=env, timeout=120)
    assert "'lonely'" in messages[0]
    assert "ranks [0]" in messages[0] and "ranks [1]" in messages[0], messages[0]


def _killed_peer_job() -> str:
    core.init()
    buf = np.ones(4)
    core.allreduce(buf, name="before", op=core.Sum)
    assert np.all(buf == core.size())
    if core.rank() == core.size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    handles = [core.allreduce_async(np.ones(1000), name=f"after.{i}") for i in range(3)]
    errors = []
    for h in handles:
        try:
            core.synchronize(h)
        except core.PeerFailureError as exc:
            errors.append(exc)
    assert len(errors) == 3, errors
    try:
        core.allreduce(np.ones(2), name="later")
    except core.PeerFailureError as exc:
        errors.append(exc)
    else:
        raise AssertionError("a call after the failure did not raise")
    core.shutdown()
    return f"{errors[0].rank}|{errors[-1].rank}|{errors[0]}"


def test_sigkilled_rank_fails_the_others_with_its_name():
    results = run_ranks(_killed_peer_job, 3, env={"SPARK_HVD_TIMEOUT": "10", "SPARK_HVD_CYCLE_TIME": "5"},
                        timeout=90, allow_death={2})
    assert isinstance(results[2], RankDied)
    for r in (0, 1):
        first, last, message = results[r].split("|", 2)
        assert first == "2" and last == "2", results[r]
        assert "2" in message


class _PackingLocalBackend(LocalBackend):
    """A single rank whose engine packs a fusion buffer, as it does for the TCP ring, MPI and torch."""

    fuses_in_place = False


def test_fusion_threshold_splits_groups():
    settings = Settings(fusion_threshold=1024, cycle_time_ms=50)
    engine = Engine(_PackingLocalBackend(), settings)
    try:
        bufs = [np.full(50, float(i), np.float32) for i in range(40)]  # 200 bytes each
        handles = [engine.enqueue("allreduce", b, f"t{i}") for i, b in enumerate(bufs)]
        for i, h in enumerate(handles):
            assert h.wait() is bufs[i]
            assert np.all(bufs[i] == i)
        assert engine.stats["allreduce_tensors"] == 40
        assert engine.stats["allreduce_collectives"] >= 8  # at most 5 tensors of 200 B per 1024 B group
        assert engine.stats["fused_collectives"] >= 1
    finally:
        engine.shutdown()


def test_in_place_backend_gets_a_whole_round_in_one_collective():
    engine = Engine(LocalBackend(), Settings(fusion_threshold=1024, cycle_time_ms=50))
    try:
        bufs = [np.full(50, float(i), np.float32) for i in range(40)]  # 8000 bytes: past the 1024-byte threshold
        handles = [engine.enqueue("allreduce", b, f"t{i}") for i, b in enumerate(bufs)]
        for i, h in enumerate(handles):
            assert h.wait() is bufs[i] and np.all(bufs[i] == i)
        # one collective per round (normally one round), not one per 1024 bytes as with a packing backend
        stats = dict(engine.stats)
        assert stats["allreduce_collectives"] <= stats["rounds"] and stats["allreduce_collectives"] < 8, stats
    finally:
        engine.shutdown()


def test_response_cache_capacity_zero_sends_full_requests():
    engine = Engine(LocalBackend(), Settings(cache_capacity=0))
    try:
        for _ in range(3):
            engine.enqueue("allreduce", np.ones(3), "same").wait()
        assert engine.stats["cache_hits"] == 0 and engine.stats["full_requests"] == 3
    finally:
        engine.shutdown()
    engine = Engine(LocalBackend(), Settings(cache_capacity=4))
    try:
        for _ in range(3):
            engine.enqueue("allreduce", np.ones(3), "same").wait()
        assert engine.stats["cache_hits"] == 2
        engine.enqueue("allreduce", np.ones(4), "same").wait()  # new shape: a full request again
        assert engine.stats["full_requests"] == 2
    finally:
        engine.shutdown()


def test_duplicate_pending_name_is_rejected():
    engine = Engine(LocalBackend(), Settings(cycle_time_ms=200))
    try:
        h = engine.enqueue("allreduce", np.ones(3), "dup")
        with pytest.raises(ValueError, match="'dup' is already pending"):
            engine.enqueue("allreduce", np.ones(3), "dup")
        h.wait()
    finally:
        engine.shutdown()
    with pytest.raises(core.ShutdownError):
        engine.enqueue("allreduce", np.ones(3), "x")


def _idle_job() -> dict:
    import resource
    import time

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    core.init()
    try:
        # 1. nobody has work: the engines sleep (heartbeat rounds only)
        core.barrier()
        c0, t0 = cpu(), time.monotonic()
        time.sleep(1.5)  # the idle period under test, not a synchronisation
        idle = (cpu() - c0) / (time.monotonic() - t0)
        # 2. rank 0 "validates" for 2 timeouts while rank 1 waits in an allreduce: no timeout, little CPU
        buf = np.full(3, float(core.rank() + 1))
        c0, t0 = cpu(), time.monotonic()
        if core.rank() == 0:
            time.sleep(2 * core.settings().timeout_s)
        core.allreduce(buf, name="after_validation", op=core.Sum)
        waiting = (cpu() - c0) / (time.monotonic() - t0)
        assert np.all(buf == 3.0)
        return {"idle": idle, "waiting": waiting}
    finally:
        core.shutdown()


def test_idle_engine_sleeps_and_long_idle_peer_does_not_time_out():
    # a short timeout, as the test is about waiting twice as long; not 1 s: the rendezvous at init() waits for the
    # other process to start with the same timeout, which a loaded machine's process start can exceed
    results = run_ranks(_idle_job, 2, env={"SPARK_HVD_TIMEOUT": "3"}, timeout=90)
    for r in results:
        # CPU seconds per wall second of the whole rank process (generous bounds for a loaded machine)
        assert r["idle"] < 0.1, results
        assert r["waiting"] < 0.3, results


def _early_shutdown_job() -> str:
    core.init()
    if core.rank() == 1:
        core.shutdown()
        return "left"
    try:
        core.allreduce(np.ones(3), name="never")
    except core.ShutdownError as exc:
        message = str(exc)
    else:
        raise AssertionError("allreduce succeeded although rank 1 had shut down")
    try:
        core.allreduce(np.ones(3), name="later")
    except core.ShutdownError:
        pass
    else:
        raise AssertionError("a later call did not raise")
    core.shutdown()
    return message


def test_peer_shutdown_fails_pending_and_later_calls_naming_it():
    results = run_ranks(_early_shutdown_job, 2, env=FAST, timeout=60)
    assert results[1] == "left"
    assert "rank 1 shut down" in results[0], results[0]


def test_engine_packing_sends_large_tensors_alone():
    from test_timeline import PackingBackend

    engine = Engine(PackingBackend(), Settings(cycle_time_ms=50))
    try:
        big = np.ones(2 * 1024 * 1024, np.float32)  # 8 MiB
        small = [np.full(10, float(i), np.float32) for i in range(3)]
        handles = [engine.enqueue("allreduce", big, "big")]
        handles += [engine.enqueue("allreduce", b, f"small.{i}") for i, b in enumerate(small)]
        for h in handles:
            h.wait()
        assert np.all(big == 1) and all(np.all(b == i) for i, b in enumerate(small))
        assert engine.stats["allreduce_tensors"] == 4
        assert engine.stats["allreduce_collectives"] == 2  # the big one alone, the small ones fused
        assert engine.stats["fused_collectives"] == 1
    finally:
        engine.shutdown()


def _different_settings_job() -> str:
    core.init()
    try:
        core.allreduce(np.ones(2), name="x")
    except core.SparkHvdError as exc:
        return str(exc)
    finally:
        core.shutdown()
    return "no error"


def test_ranks_with_different_fusion_settings_fail_clearly():
    results = run_ranks(_different_settings_job, 2, env=lambda r: {"SPARK_HVD_FUSION_THRESHOLD": str(1024 * (r + 1))},
                        timeout=60)
    for message in results:
        assert "rank 0: fusion_threshold=1024" in message and "rank 1: fusion_threshold=2048" in message, message
