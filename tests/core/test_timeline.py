"""SPARK_HVD_TIMELINE writes a Chrome-trace JSON with negotiation, wait, fusion copies and collectives."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

import spark_hvd.core as core
from spark_hvd.core.backend import Backend, ReduceOp
from spark_hvd.core.engine.engine import Engine
from spark_hvd.core.engine.timeline import Timeline, timeline_path
from spark_hvd.core.settings import Settings


class PackingBackend(Backend):
    """A size-1 backend that keeps Backend's default allreduce_fused, so the engine packs the fusion buffer."""

    name = "packing"
    rank, size, local_rank, local_size, cross_rank, cross_size = 0, 1, 0, 1, 0, 1

    def allreduce(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> None:
        pass

    def allgather(self, buf: np.ndarray) -> np.ndarray:
        return buf.copy()

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        pass

    def alltoall(self, buf: np.ndarray, splits: Sequence[int] | None = None) -> tuple[np.ndarray, list[int]]:
        return buf.copy(), [len(buf)]

    def reducescatter(self, buf: np.ndarray, op: ReduceOp, *, bfloat16: bool = False) -> np.ndarray:
        return buf.copy()

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


def _events(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        events = json.load(f)
    assert isinstance(events, list)
    return events


def test_timeline_has_every_activity(tmp_path):
    path = tmp_path / "timeline.json"
    engine = Engine(PackingBackend(), Settings(timeline=str(path), cycle_time_ms=20))
    bufs = [np.full(10, float(i), np.float32) for i in range(5)]
    handles = [engine.enqueue("allreduce", b, f"grad.{i}") for i, b in enumerate(bufs)]
    for h in handles:
        h.wait()
    engine.enqueue("allgather", np.ones((2, 2)), "gathered").wait()
    engine.enqueue("broadcast", np.ones(3), "bcast", root=0).wait()
    engine.shutdown()
    events = _events(path)
    names = {(e.get("args", {}).get("name") if e["ph"] == "M" else e["name"]) for e in events}
    for activity in ("WAIT_FOR_NEGOTIATION", "NEGOTIATE", "MEMCPY_IN_FUSION_BUFFER", "ALLREDUCE",
                     "MEMCPY_OUT_FUSION_BUFFER", "ALLGATHER", "BROADCAST", "ROUND"):
        assert activity in names, activity
    rows = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    for tensor in ("grad.0", "grad.4", "gathered", "bcast"):
        assert tensor in rows
    grad0 = [e for e in events if e["ph"] == "X" and e["tid"] == rows["grad.0"]]
    assert [e["name"] for e in grad0] == ["WAIT_FOR_NEGOTIATION", "NEGOTIATE", "MEMCPY_IN_FUSION_BUFFER",
                                          "ALLREDUCE", "MEMCPY_OUT_FUSION_BUFFER"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["pid"] == 0 for e in grad0)
    starts = [e["ts"] for e in grad0]
    assert starts == sorted(starts)


def test_timeline_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "env-timeline.json"
    for var in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPARK_HVD_TIMELINE", str(path))
    core.shutdown()
    core.init()
    try:
        core.allreduce(np.ones(4), name="w")
    finally:
        core.shutdown()
    events = _events(path)
    assert any(e["name"] == "ALLREDUCE" for e in events)


def test_timeline_path_per_rank():
    assert timeline_path("/x/t.json", 0) == "/x/t.json"
    assert timeline_path("/x/t.json", 1) is None
    assert timeline_path("/x/t-{rank}.json", 3) == "/x/t-3.json"


def test_unclosed_timeline_is_still_valid_after_adding_bracket(tmp_path):
    path = tmp_path / "partial.json"
    tl = Timeline(str(path), 0)
    tl.event("t", "ALLREDUCE", 1.0, 2.0)
    tl.flush()
    text = path.read_text()
    assert json.loads(text.rstrip().rstrip(",") + "]")  # what a trace viewer does with an unfinished array
    tl.close()
    tl.close()
    assert len(_events(path)) == 4  # process and engine-row names, the tensor row name, the event
