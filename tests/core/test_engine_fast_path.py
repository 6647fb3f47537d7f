"""The user's fast path: rounds run by the waiting caller, cache hits negotiated by one small allreduce, and
speculative rounds (negotiation and data in one collective), checked against numpy while the ranks differ in
what they have queued."""

from __future__ import annotations

import threading
import time

import helpers.engine_scenarios as sc
import numpy as np
import pytest
from helpers.ranks import run_ranks

import spark_hvd.core as core
from spark_hvd.core.backends.local_backend import LocalBackend
from spark_hvd.core.engine.engine import Engine
from spark_hvd.core.reduce import reference_reduce
from spark_hvd.core.settings import Settings

ReduceOp = core.ReduceOp


def _blocking(name: str, seed: int, shape: tuple[int, ...], dtype, op: ReduceOp, **scale: float) -> None:
    n, r = core.size(), core.rank()
    datas = [sc._data(seed, q, shape, dtype) for q in range(n)]
    buf = datas[r].copy()
    core.allreduce(buf, name=name, op=op, **scale)
    want = reference_reduce([d * scale.get("prescale", 1.0) for d in datas], op) * scale.get("postscale", 1.0)
    sc._check(buf, want.astype(dtype), f"{name} {op.value}")


def _another_tensor_first_on_rank_0(armed: str, other: str, seed: int, shape: tuple[int, ...]) -> None:
    """Rank 0 submits ``other`` before the armed tensor's blocking call, the other ranks after it: the armed
    speculation misses on every rank, and both tensors still reduce to numpy's sums."""
    n, r = core.size(), core.rank()
    datas = [sc._data(seed, q, shape, np.float32) for q in range(n)]
    mine = datas[r].copy()
    if r == 0:
        handle = core.allreduce_async(mine, name=other, op=ReduceOp.SUM)
        _blocking(armed, seed + 1, shape, np.float32, ReduceOp.SUM)
        handle.wait()
    else:
        _blocking(armed, seed + 1, shape, np.float32, ReduceOp.SUM)
        core.allreduce(mine, name=other, op=ReduceOp.SUM)
    sc._check(mine, reference_reduce(datas, ReduceOp.SUM), other)


def _fast_path_job(seed: int) -> dict:
    core.init()
    try:
        n, r = core.size(), core.rank()
        engine = core.get_engine()
        # 1. a steady loop of blocking calls: after two clean fast rounds, one speculative collective each
        for i in range(12):
            _blocking("steady", seed + i, (33,), np.float32, ReduceOp.SUM)
        for i in range(6):
            _blocking("scaled", seed + 50 + i, (5, 4), np.float64, ReduceOp.AVERAGE, prescale=0.5, postscale=3.0)
        for i in range(6):
            _blocking("half", seed + 70 + i, (9,), np.float16, ReduceOp.SUM)
        steady = dict(engine.stats)
        # on one host's shared memory the small tensor's speculation carries its flag in band (ahead of the data
        # in the slot: no staging), and so do the barriers of osu_allreduce's loop, one collective each
        in_band = engine.backend.agrees_small(np.dtype(np.float32), ReduceOp.SUM) > 0
        assert in_band == (engine.backend.transport == "shm"), engine.backend.transport
        assert engine._spec is not None and engine._spec.in_band == in_band, engine._spec
        for i in range(8):
            core.barrier()
            _blocking("steady", seed + 80 + i, (33,), np.float32, ReduceOp.SUM)
        loop = {k: v - steady.get(k, 0) for k, v in engine.stats.items()}
        assert loop["barrier_collectives"] == 8 and loop["allreduce_tensors"] == 8, loop
        assert loop["speculative_rounds"] - loop.get("speculation_misses", 0) >= 12, loop  # (learning: a few misses)
        # 2. the ranks differ in what they queue while speculation is armed for 'steady'
        for i in range(8):
            _blocking("steady", seed + 100 + i, (33,), np.float32, ReduceOp.SUM)
        datas = {name: [sc._data(seed + 200 + k, q, (7,), np.float64) for q in range(n)]
                 for k, name in enumerate(("steady2", "extra"))}
        bufs = {name: d[r].copy() for name, d in datas.items()}
        if r == 0:  # both at once; the others one after the other, in the other order
            handles = [core.allreduce_async(bufs[name], name=name, op=ReduceOp.SUM) for name in ("steady2", "extra")]
            for h in handles:
                h.wait()
        else:
            core.allreduce(bufs["extra"], name="extra", op=ReduceOp.SUM)
            core.allreduce(bufs["steady2"], name="steady2", op=ReduceOp.SUM)
        for name, d in datas.items():
            sc._check(bufs[name], reference_reduce(d, ReduceOp.SUM), name)
        for i in range(4):  # a rank that arrives late, after the engines' heartbeat rounds met the armed round
            if r == n - 1 and i == 2:
                time.sleep(1.3)
            _blocking("steady", seed + 300 + i, (33,), np.float32, ReduceOp.SUM)
        # 3. a second thread submits asynchronously while the main thread runs blocking calls
        errors: list[BaseException] = []

        def side() -> None:
            try:
                for i in range(20):
                    d = [sc._data(seed + 400 + i, q, (11,), np.float32) for q in range(n)]
                    buf = d[r].copy()
                    core.allreduce_async(buf, name=f"side.{i % 3}", op=ReduceOp.MAX).wait()
                    sc._check(buf, reference_reduce(d, ReduceOp.MAX), "side thread")
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=side)
        thread.start()
        for i in range(20):
            _blocking("main", seed + 500 + i, (13,), np.float64, ReduceOp.SUM)
        thread.join(60)
        assert not thread.is_alive() and not errors, errors
        # 4. armed on 'lone': rank 0 submits another tensor before it, so the others' blocking calls, which
        # speculate on 'lone' alone in the calling thread, miss and negotiate
        for i in range(4):
            _blocking("lone", seed + 600 + i, (21,), np.float32, ReduceOp.SUM)
        misses = engine.stats["speculation_misses"]
        _another_tensor_first_on_rank_0("lone", "first", seed + 700, (21,))
        assert engine.stats["speculation_misses"] > misses, engine.stats
        # 5. a tensor too large to pack: at N=2 the speculation runs on the tensor itself, in place, and a miss
        # (a late rank's heartbeat round, another tensor first) must leave the submitting rank's data intact
        for i in range(4):
            _blocking("big", seed + 800 + i, (30000,), np.float32, ReduceOp.SUM)
        armed = engine._spec is not None and engine._spec.in_place
        assert armed == (n == 2), engine._spec  # with three ranks the fast round negotiates it
        misses = engine.stats["speculation_misses"]
        for i in range(3):
            if r == n - 1 and i == 1:
                time.sleep(1.3)
            _blocking("big", seed + 810 + i, (30000,), np.float32, ReduceOp.SUM)
        _another_tensor_first_on_rank_0("big", "second", seed + 820, (30000,))
        assert n > 2 or engine.stats["speculation_misses"] > misses, engine.stats
        stats = dict(engine.stats)
        return {"steady": steady, "stats": stats}
    finally:
        core.shutdown()


@pytest.mark.parametrize("n", [2, 3])
def test_fast_path_matches_numpy_while_ranks_queue_differently(n):
    env = {"SPARK_HVD_TIMEOUT": "60", "SPARK_HVD_CYCLE_TIME": "2"}
    results = run_ranks(_fast_path_job, n, env=env, args=(7 * n,), timeout=150)
    for res in results:
        steady, stats = res["steady"], res["stats"]
        # 24 blocking calls on 3 names: most rounds are speculative, the first of each name is a full round
        assert steady["speculative_rounds"] >= 12, steady
        assert steady["allreduce_tensors"] == 24, steady
        assert stats["speculation_misses"] >= 1, stats  # the ranks' different queues were seen and survived


class _RecordingBackend(LocalBackend):
    """A single rank that records which thread ran each collective."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        self.threads.append(threading.current_thread().name)
        super().allreduce(buf, op, bfloat16=bfloat16)

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        self.threads.append(threading.current_thread().name)
        return super().allgather(buf)


def test_blocking_allreduce_of_the_armed_tensor_is_one_collective_without_a_request():
    backend = _RecordingBackend()
    engine = Engine(backend, Settings(cycle_time_ms=50))
    enqueued: list[str] = []
    enqueue = engine.enqueue

    def spy(kind, buf=None, name=None, **kwargs):
        enqueued.append(name)
        return enqueue(kind, buf, name, **kwargs)

    engine.enqueue = spy
    try:
        rng = np.random.default_rng(3)
        scale = {"prescale": 0.5, "postscale": 3.0}
        # a full round that left nothing outstanding arms the speculation on 'w' (a loop's second call)
        engine.allreduce(rng.standard_normal((4, 3)), "w", op=ReduceOp.SUM, **scale)
        assert enqueued == ["w"]
        backend.threads.clear()
        for _ in range(5):
            data = rng.standard_normal((4, 3))
            buf = data.copy()
            assert engine.allreduce(buf, "w", op=ReduceOp.SUM, **scale) is buf
            np.testing.assert_allclose(buf, data * 0.5 * 3.0, rtol=1e-12)
        assert enqueued == ["w"], enqueued  # no request, no handle: the caller ran the collective itself
        assert backend.threads == [threading.current_thread().name] * 5, backend.threads
        # anything that differs from the armed tensor takes the negotiated path, and is still right
        for args, kwargs in [(((4, 3), "v"), {}), (((3, 4), "w"), {}), (((4, 3), "w"), {"op": ReduceOp.MAX}),
                             (((4, 3), "w"), {"postscale": 2.0})]:
            data = rng.standard_normal(args[0])
            buf = data.copy()
            engine.allreduce(buf, args[1], **{"op": ReduceOp.SUM, **kwargs})
            np.testing.assert_allclose(buf, data * kwargs.get("postscale", 1.0), rtol=1e-12)
        assert enqueued == ["w", "v", "w", "w", "w"], enqueued
    finally:
        engine.shutdown()


def test_blocking_calls_run_their_rounds_in_the_calling_thread():
    backend = _RecordingBackend()
    engine = Engine(backend, Settings(cycle_time_ms=50))
    try:
        deadline = time.monotonic() + 30
        while engine.stats["rounds"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread's start-up round (every rank's first round checks the settings)
        assert backend.threads == ["spark_hvd-engine-rank0"], backend.threads
        backend.threads.clear()
        for i in range(6):
            buf = np.full(4, float(i))
            assert engine.enqueue("allreduce", buf, "x", op=ReduceOp.SUM, start_engine=False).wait() is buf
            assert np.all(buf == i)
        # no hand-off: every collective ran in this thread. A new name: a flagged fast round and the data (every
        # rank's message was the same, so none travels), which arms speculation on it; then one collective per call
        assert set(backend.threads) == {threading.current_thread().name}, backend.threads
        assert len(backend.threads) == 2 + 5, backend.threads
        assert engine.stats["messages_skipped"] == 1, engine.stats
        assert engine.stats["speculative_rounds"] == 5 and engine.stats["rounds"] == 7, engine.stats
    finally:
        engine.shutdown()
