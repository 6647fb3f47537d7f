"""Rank-side scenarios of the device path (``spark_hvd.core.engine.device``), written once for every device.

``device`` is ``"cpu"`` with ``SPARK_HVD_DEVICE_BACKEND=gloo`` (the CPU stand-in for NCCL, on every CI run) and
``"cuda"`` on a GPU host (NCCL). Torch tensors on ``device`` go down the device path; every result is checked
against numpy on the same random data (every rank draws every rank's data from the same seeds).
"""

from __future__ import annotations

import numpy as np
import torch

import helpers.engine_scenarios as sc
import spark_hvd.core as core
import spark_hvd.torch as hvd
from spark_hvd.core.backend import rank_rows
from spark_hvd.core.reduce import ELEMENTWISE_OPS, reference_reduce

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
        for oi, op in enumerate(ELEMENTWISE_OPS):
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


_DATA_KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")


def _scopes(sets: list, with_global: bool) -> list[tuple]:
    """``(process_set, members)`` of the whole job (``with_global``) and of each of ``sets`` this rank is in."""
    everyone = [(hvd.global_process_set, list(range(hvd.size())))] if with_global else []
    return everyone + [(ps, ps.ranks) for ps in sets if hvd.rank() in ps.ranks]


def _interleaved(scopes: list[tuple], device: str, seed: int) -> None:
    """Every collective on device tensors, submitted on every scope of this rank before any is waited for (the
    whole job's group and the sets' own groups at work at once), each against numpy over the scope's members."""
    r = hvd.rank()
    started = []  # (handle, check(result))
    for ps, members in scopes:
        me, k, si, tag = members.index(r), len(members), ps.process_set_id, f"{seed}.{ps.process_set_id}"

        def data(what: int, shape: tuple, dtype, ranks: list[int] = members, si: int = si) -> dict:
            return {q: sc._data(seed * 1000 + si * 100 + what, q, shape, dtype) for q in ranks}

        for what, op, dtype in ((1, ReduceOp.SUM, np.float64), (2, ReduceOp.AVERAGE, np.float32)):
            d = data(what, (5, 3), dtype)
            t = _on(d[r], device)
            want = reference_reduce([d[q] for q in members], op)
            started.append((hvd.allreduce_async_(t, name=f"ps.ar{what}.{tag}", op=op, process_set=ps),
                            lambda out, t=t, want=want, tag=tag: sc._check(_back(t), want, f"allreduce {tag}")))
        groups = [data(4 + i, (i + 1, 2), np.float32) for i in range(6)]
        ts = [_on(g[r], device) for g in groups]
        wants = [reference_reduce([g[q] for q in members], ReduceOp.AVERAGE) for g in groups]
        started.append((hvd.grouped_allreduce_async_(ts, name=f"ps.group.{tag}", op=ReduceOp.AVERAGE, process_set=ps),
                        lambda out, ts=ts, wants=wants, tag=tag: [sc._check(_back(t), w, f"grouped {tag}")
                                                                   for t, w in zip(ts, wants, strict=True)]))
        rows = {q: members.index(q) + 1 for q in members}  # a first dimension that differs by rank
        d = {q: sc._data(seed * 1000 + si * 100 + 20, q, (rows[q], 4), np.float32) for q in members}
        want = np.concatenate([d[q] for q in members])
        started.append((hvd.allgather_async(_on(d[r], device), name=f"ps.gather.{tag}", process_set=ps),
                        lambda out, want=want, tag=tag: sc._check(_back(out), want, f"allgather {tag}")))
        # root_rank is a GLOBAL rank: the last rank for the job, rank 1 (set rank 1 of [0, 1], 0 of [1, 2]) for sets
        root = hvd.size() - 1 if ps.process_set_id == 0 else (1 if 1 in members else members[0])
        d = data(21, (6, 2), np.int64)
        t = _on(d[r], device)
        started.append((hvd.broadcast_async_(t, root_rank=root, name=f"ps.bcast.{tag}", process_set=ps),
                        lambda out, t=t, want=d[root], tag=tag: sc._check(_back(t), want, f"broadcast {tag}")))
        d = {q: sc._data(seed * 1000 + si * 100 + 22, q, (sum(members.index(q) + j + 1 for j in range(k)), 3),
                         np.float32) for q in members}
        want = np.concatenate([d[q][sum(i + j + 1 for j in range(me)):][:i + me + 1]
                               for i, q in enumerate(members)])
        splits = [me + j + 1 for j in range(k)]
        started.append((hvd.alltoall_async(_on(d[r], device), splits=splits, name=f"ps.a2a.{tag}", process_set=ps),
                        lambda out, want=want, k=k, me=me, tag=tag: (
                            sc._check(_back(out[0]), want, f"alltoall {tag}"),
                            _same(out[1].tolist(), [i + me + 1 for i in range(k)], f"alltoall splits {tag}"))))
        d = data(23, (2 * k + 1, 3), np.float64)
        want = reference_reduce([d[q] for q in members], ReduceOp.SUM)[rank_rows(2 * k + 1, k, me)]
        started.append((hvd.reducescatter_async(_on(d[r], device), name=f"ps.rs.{tag}", op=ReduceOp.SUM,
                                                process_set=ps),
                        lambda out, want=want, tag=tag: sc._check(_back(out), want, f"reducescatter {tag}")))
    for handle, check in started:
        check(hvd.synchronize(handle))


def _same(got: object, want: object, what: str) -> None:
    assert got == want, f"{what}: {got} != {want}"


def _device_counts(engine: core.Engine) -> dict[str, int]:
    return {k: engine.stats[k] for k in ("device_collectives", "allreduce_tensors", "fused_collectives",
                                         *(f"{kind}_collectives" for kind in _DATA_KINDS))}


def process_sets(device: str, seed: int = 31, with_global: bool = True) -> dict:
    """Process sets [0, 1] and [1, 2] (at N=2: [0] and [1]) beside the whole job, every collective interleaved on
    device tensors, against numpy: each set's tensors go through a device group of its own members, opened at its
    first device collective (a set used only for host arrays opens none); removing a set closes its group and
    re-adding the ranks opens a new one; a tensor on the device on one member and in host memory on another names
    both (global) ranks. ``with_global=False``: the whole job reduces no device tensor (two ranks sharing one GPU,
    each in a one-rank set, as NCCL allows no two ranks of one communicator on one GPU). Returns what
    ``check_process_sets`` asserts on every rank."""
    n, r = hvd.size(), hvd.rank()
    a = hvd.add_process_set([0, 1] if n > 2 else [0])
    b = hvd.add_process_set([1, 2] if n > 2 else [1])
    host_only = hvd.add_process_set([0, 2]) if n > 2 else None  # at N=2 every other set is taken
    mine = [ps for ps in (a, b) if r in ps.ranks]
    engines = {ps.process_set_id: core.get_engine(ps) for ps in mine}
    report: dict = {"lazy": all(not e.device_groups() for e in engines.values())}
    before = {i: _device_counts(e) for i, e in engines.items()}
    _interleaved(_scopes([a, b], with_global), device, seed)
    report["through_device"] = {}
    for i, e in engines.items():
        delta = {k: v - before[i][k] for k, v in _device_counts(e).items()}
        group = e.device_groups()[device]
        report["through_device"][i] = {
            # every data collective of the set ran on its device group, none on its ring
            "all": delta["device_collectives"] == sum(delta[f"{kind}_collectives"] for kind in _DATA_KINDS),
            "kinds": all(delta[f"{kind}_collectives"] >= 1 for kind in _DATA_KINDS),
            "tensors": delta["allreduce_tensors"], "fused": delta["fused_collectives"],
            "group": (group.rank, group.size, list(group.scope.ranks), group.scope.process_set)}
    if host_only is not None and host_only.included():
        x = sc._data(seed, r, (4,), np.float64)
        core.allreduce(x, op=ReduceOp.SUM, process_set=host_only)
        report["host_only_opens_nothing"] = not core.get_engine(host_only).device_groups()
    if n > 2 and r in b.ranks:  # one name on the device on rank 1 and in host memory on rank 2
        ones = np.ones(3, np.float32)
        handle = (hvd.allreduce_async_(_on(ones, device), name="ps.mixed", process_set=b) if r == 1
                  else core.allreduce_async(ones, name="ps.mixed", process_set=b))
        try:
            hvd.synchronize(handle) if r == 1 else core.synchronize(handle)
            report["mixed"] = "reduced"
        except core.TensorMismatchError as exc:
            report["mixed"] = str(exc)
    old = core.get_engine(a).device_groups()[device] if r in a.ranks else None
    removed = hvd.remove_process_set(a)
    report["removed_closes"] = removed and (old is None or old.closed)
    again = hvd.add_process_set(list(a.ranks))
    _interleaved(_scopes([again, b], with_global), device, seed + 1)
    if r in again.ranks:
        report["new_group"] = core.get_engine(again).device_groups()[device] is not old
    report["ids"] = [a.process_set_id, b.process_set_id, again.process_set_id]
    for ps in (again, b, host_only):
        if ps is not None:
            hvd.remove_process_set(ps)
    return report


def check_process_sets(reports: list[dict], device: str) -> None:
    """Assert what ``process_sets`` reported on every rank (``reports`` by rank)."""
    n = len(reports)
    members = {1: [0, 1], 2: [1, 2]} if n > 2 else {1: [0], 2: [1]}
    for r, sets in enumerate(reports):
        assert sets["lazy"], f"rank {r}: a set's device group was opened before its first device collective"
        assert sets["removed_closes"] and sets["ids"][0] is None
        mine = {i: m for i, m in members.items() if r in m}
        assert set(sets["through_device"]) == set(mine)
        for i, counts in sets["through_device"].items():
            # the set's own group (its members' ranks, the set's rank of this rank), and nothing on its ring
            assert counts["group"] == (mine[i].index(r), len(mine[i]), mine[i], i), counts
            assert counts["all"] and counts["kinds"] and counts["tensors"] == 8, counts
        if r in members[1]:
            assert sets["new_group"]
        if n > 2:
            assert sets["ids"][1:] == [2, 4]
            if r != 1:  # the members of [0, 2], which reduced host arrays on it
                assert sets["host_only_opens_nothing"]
            if r in (1, 2):
                assert (f"tensor 'ps.mixed' in process set 2 (ranks [1, 2]) is on {device} on ranks [1]; on host "
                        "memory on ranks [2]") in sets["mixed"], sets["mixed"]
