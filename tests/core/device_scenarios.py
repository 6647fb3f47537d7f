"""Rank-side scenarios of the device path (``spark_hvd.core.device``), written once for every device.

``device`` is ``"cpu"`` with ``SPARK_HVD_DEVICE_BACKEND=gloo`` (the CPU stand-in for NCCL, on every CI run) and
``"cuda"`` on a GPU host (NCCL). Torch tensors on ``device`` go down the device path; every result is checked
against numpy on the same random data (every rank draws every rank's data from the same seeds).
"""

from __future__ import annotations

import numpy as np
import test_engine_scenarios as sc
import torch

import spark_hvd.core as core
import spark_hvd.torch as hvd
from spark_hvd.core.reduce import reference_reduce

ReduceOp = core.ReduceOp


def _on(arr: np.ndarray, device: str) -> torch.Tensor:
    return torch.from_numpy(np.array(arr, copy=True)).to(device)  # never the numpy data itself


def _back(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def collectives(device: str, seed: int = 3) -> dict:
    """allreduce (every op on float32/64, SUM on the other dtypes, bfloat16), fused grouped allreduce, ragged
    allgather, broadcast, alltoall, reducescatter: device tensors against numpy. Returns counts and stats."""
    n, r = hvd.size(), hvd.rank()
    engine = core.get_engine()
    before = engine.stats["device_collectives"]
    checked = 0
    for di, dtype in enumerate(sc.DTYPES):
        for oi, op in enumerate(ReduceOp):
            if dtype not in (np.float32, np.float64) and op is not ReduceOp.SUM:
                continue
            datas = [sc._data(seed * 100 + di * 10 + oi, q, (5 + di, 3), dtype) for q in range(n)]
            t = _on(datas[r], device)
            out = hvd.allreduce_(t, name=f"dev.ar.{dtype.__name__}.{op.value}", op=op)
            assert out is t and t.device.type == device
            sc._check(_back(t), reference_reduce(datas, op), f"device allreduce {dtype.__name__} {op.value}")
            checked += 1
    # int16: NCCL has no int16 reduction, so the group widens it to int64
    datas = [sc._data(seed + 6, q, (11,), np.int16) for q in range(n)]
    t = _on(datas[r], device)
    hvd.allreduce_(t, name="dev.int16", op=ReduceOp.SUM)
    sc._check(_back(t), reference_reduce(datas, ReduceOp.SUM), "device allreduce int16")
    # bfloat16 (reduced in float32, rounded once)
    datas = [sc._data(seed + 7, q, (40,), np.float32) for q in range(n)]
    t = _on(datas[r], device).to(torch.bfloat16)
    hvd.allreduce_(t, name="dev.bf16", op=ReduceOp.SUM)
    want = sum(torch.from_numpy(d).to(torch.bfloat16).float() for d in datas)
    np.testing.assert_allclose(_back(t.float()), want.numpy(), rtol=1e-2, atol=1e-2)
    # prescale / postscale
    datas = [sc._data(seed + 8, q, (33,), np.float64) for q in range(n)]
    t = _on(datas[r], device)
    hvd.allreduce_(t, name="dev.scaled", op=ReduceOp.SUM, prescale_factor=0.5, postscale_factor=3.0)
    sc._check(_back(t), reference_reduce(datas, ReduceOp.SUM) * 1.5, "device scaled allreduce")
    # a grouped allreduce of 12 tensors: fused into one collective on the device
    fused_before = engine.stats["fused_collectives"]
    datas = [[sc._data(seed + 9, q * 100 + i, (i + 1, 2), np.float32) for i in range(12)] for q in range(n)]
    ts = [_on(a, device) for a in datas[r]]
    hvd.grouped_allreduce_(ts, name="dev.group", op=ReduceOp.AVERAGE)
    for i, t in enumerate(ts):
        sc._check(_back(t), reference_reduce([datas[q][i] for q in range(n)], ReduceOp.AVERAGE), f"group {i}")
    fused = engine.stats["fused_collectives"] - fused_before
    # allgather with a first dimension that differs by rank
    datas = [sc._data(seed + 10, q, (q + 1, 4), np.float32) for q in range(n)]
    got = hvd.allgather(_on(datas[r], device), name="dev.gather")
    assert got.device.type == device
    sc._check(_back(got), np.concatenate(datas), "device allgather")
    # broadcast from the last rank
    datas = [sc._data(seed + 11, q, (6, 2), np.int64) for q in range(n)]
    t = _on(datas[r], device)
    hvd.broadcast_(t, root_rank=n - 1, name="dev.bcast")
    sc._check(_back(t), datas[n - 1], "device broadcast")
    # alltoall: rank q sends q + i + 1 rows to rank i
    datas = [sc._data(seed + 12, q, (sum(q + i + 1 for i in range(n)), 3), np.float32) for q in range(n)]
    splits = [r + i + 1 for i in range(n)]
    out, recv = hvd.alltoall(_on(datas[r], device), splits=splits, name="dev.a2a")
    want = np.concatenate([datas[q][sum(q + i + 1 for i in range(r)):][:q + r + 1] for q in range(n)])
    sc._check(_back(out), want, "device alltoall")
    assert recv.tolist() == [q + r + 1 for q in range(n)]
    # reducescatter of 2n + 1 rows
    datas = [sc._data(seed + 13, q, (2 * n + 1, 3), np.float64) for q in range(n)]
    part = hvd.reducescatter(_on(datas[r], device), name="dev.rs", op=ReduceOp.SUM)
    full = reference_reduce(datas, ReduceOp.SUM)
    start = 2 * r + min(r, 1)
    sc._check(_back(part), full[start:start + 2 + (1 if r < 1 else 0)], "device reducescatter")
    return {"checked": checked, "fused": fused, "device_collectives": engine.stats["device_collectives"] - before}


def host_arrays_keep_the_ring(seed: int = 4) -> None:
    """numpy arrays in the same job still go to the ring (the backend), next to the device path."""
    n, r = core.size(), core.rank()
    datas = [sc._data(seed, q, (17,), np.float64) for q in range(n)]
    buf = datas[r].copy()
    before = core.get_engine().stats["device_collectives"]
    core.allreduce(buf, name="host.ar", op=ReduceOp.SUM)
    sc._check(buf, reference_reduce(datas, ReduceOp.SUM), "host allreduce beside the device path")
    assert core.get_engine().stats["device_collectives"] == before


def mixed_devices(device: str) -> str:
    """One name on the device on rank 0 and in host memory elsewhere: a TensorMismatchError naming both."""
    if hvd.rank() == 0:
        handle = hvd.allreduce_async_(_on(np.ones(4, np.float32), device), name="mixed")
        wait = lambda: hvd.synchronize(handle)  # noqa: E731
    else:
        handle = core.allreduce_async(np.ones(4, np.float32), name="mixed")
        wait = lambda: core.synchronize(handle)  # noqa: E731
    try:
        wait()
    except core.TensorMismatchError as exc:
        return str(exc)
    raise AssertionError("a tensor on the device on one rank and in host memory on another was reduced")


def join_with_device_tensors(device: str, seed: int = 6) -> int:
    """The last rank joins at once; the others allreduce device tensors (it contributes zeros on its device)."""
    n, r = hvd.size(), hvd.rank()
    if r == n - 1:
        return hvd.join()
    datas = [sc._data(seed, q, (9,), np.float32) for q in range(n)]
    t = _on(datas[r], device)
    hvd.allreduce_(t, name="dev.joined", op=ReduceOp.SUM)
    sc._check(_back(t), reference_reduce(datas[:n - 1], ReduceOp.SUM), "device allreduce with a joined rank")
    return hvd.join()
