"""The single-copy (cross-memory attach) allreduce of two ranks, against numpy.

Protocol tests run the two members as threads of this process, each with its own ``ShmGroup`` over real /dev/shm
segments and its own ``CmaPair`` (``process_vm_readv`` on this process's own pid is the same system call);
tiny scratch blocks make every call run many blocks. Backend tests run two spawned ranks through
``RingBackend``: the threshold, fused arrays, and the fallback to the slot protocol when the probe fails.
"""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers.ranks import backend_from_env, on_threads, run_ranks, shm_groups

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.errors import CollectiveTimeoutError, PeerFailureError, TensorMismatchError
from spark_hvd.core.reduce import ELEMENTWISE_OPS, f32_to_bf16, reference_reduce
from spark_hvd.core.transport import shm_cma
from spark_hvd.core.transport.shm import shm_available

pytestmark = pytest.mark.skipif(not shm_available() or shm_cma._READV is None,
                                reason="no /dev/shm or no process_vm_readv here")

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bfloat16"]
OPS = list(ELEMENTWISE_OPS)


def _no_peers(operation: str) -> None:
    """Threads of one process: no TCP connections to check."""


def _pairs(block_bytes: int = 192, timeout_s: float = 20.0) -> list[shm_cma.CmaPair]:
    groups = shm_groups("cma", 2, timeout_s=timeout_s, block_bytes=4096, nslots=2)
    return [shm_cma.CmaPair(g, 0, block_bytes) for g in groups]


def _close(pairs: list[shm_cma.CmaPair]) -> None:
    for p in pairs:
        p.group.close()


def _data(seed: int, rank: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, n, DTYPES.index(dtype)])
    if dtype in ("int32", "int64", "uint8"):
        return rng.integers(1, 9, n).astype(dtype)
    values = (rng.random(n) * 2 - 0.7).astype(np.float32)
    if dtype == "bfloat16":
        return f32_to_bf16(values, np.empty(n, np.uint16))
    return values.astype(dtype)


def test_probe_reads_the_peer_and_a_dead_pid_is_named():
    pairs = _pairs()
    try:
        assert shm_cma.probe(pairs[0].group) is None
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        word = np.zeros(1, np.int64)
        with pytest.raises(PeerFailureError, match="rank 5 .*process is gone") as info:
            shm_cma.read_peer(child.pid, [(word.ctypes.data, 8)], [(word.ctypes.data, 8)], 5, "allreduce")
        assert info.value.rank == 5
    finally:
        _close(pairs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_matches_numpy_bit_for_bit(dtype):
    # sizes: one element, odd, one block less/more than a block (192 bytes), many blocks
    sizes = [1, 7, 191 // np.dtype("uint16" if dtype == "bfloat16" else dtype).itemsize, 97, 1001]
    pairs = _pairs()
    try:
        for n in sizes:
            for op in OPS:
                arrays = [_data(n, k, n, dtype) for k in range(2)]
                want = reference_reduce(arrays, op, dtype == "bfloat16")
                bufs = [a.copy() for a in arrays]
                on_threads(2, lambda k, bufs=bufs, op=op: pairs[k].allreduce([bufs[k]], op, dtype == "bfloat16",
                                                                     "allreduce", _no_peers))
                for k in range(2):
                    np.testing.assert_array_equal(bufs[k], want, err_msg=f"{dtype} {op} n={n} rank {k}")
    finally:
        _close(pairs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatter_and_allgather_halves_match_numpy_bit_for_bit(dtype):
    # ragged slices (rank 0 one element more, or none at all) across many blocks; the input is left unchanged
    pairs = _pairs()
    bf16 = dtype == "bfloat16"
    try:
        for n in (1, 7, 97, 1001):
            split = (n + 1) // 2
            for op in OPS:
                arrays = [_data(n, k, n, dtype) for k in range(2)]
                # AVERAGE sums (the caller divides)
                want = reference_reduce(arrays, ReduceOp.SUM if op is ReduceOp.AVERAGE else op, bf16)
                inputs = [a.copy() for a in arrays]
                outs = [np.empty(split, inputs[0].dtype), np.empty(n - split, inputs[0].dtype)]
                on_threads(2, lambda k, inputs=inputs, outs=outs, op=op, split=split: pairs[k].reducescatter(
                    inputs[k], outs[k], split * k, op, bf16, "reducescatter", _no_peers))
                np.testing.assert_array_equal(np.concatenate(outs), want, err_msg=f"{dtype} {op} n={n}")
                for k in range(2):
                    np.testing.assert_array_equal(inputs[k], arrays[k])
            raws = [np.zeros(n * 4, np.uint8) for _ in range(2)]
            bounds = [0, split * 4, n * 4]
            for k in range(2):
                raws[k][bounds[k]:bounds[k + 1]] = _data(n, k, 4 * n, "uint8")[:bounds[k + 1] - bounds[k]] + k
            want = np.concatenate([raws[0][:bounds[1]], raws[1][bounds[1]:]])
            on_threads(2, lambda k, raws=raws, bounds=bounds: pairs[k].allgather(raws[k], bounds, "allgather",
                                                                              _no_peers))
            for k in range(2):
                np.testing.assert_array_equal(raws[k], want, err_msg=f"allgather n={n} rank {k}")
    finally:
        _close(pairs)


def test_fused_pieces_and_buffer_reuse_right_after_return(monkeypatch):
    # the ordering rules: each member refills its buffers with new data as soon as allreduce returns and a
    # member sleeps at random between calls; a peer still reading (or an early write) would show in the sums.
    # The allgather reads 40 bytes per call here (READ_BYTES: in production a cap of the kernel's)
    monkeypatch.setattr(shm_cma, "READ_BYTES", 44)
    pairs = _pairs(block_bytes=64)
    lengths = [3, 1, 40, 17, 0, 64, 5]
    rounds = 30
    results: list[list[np.ndarray]] = [[], []]

    def member(k: int) -> None:
        segs = [np.empty(n, np.float64) for n in lengths]
        rnd = random.Random(k)
        for i in range(rounds):
            for j, s in enumerate(segs):
                s[...] = np.arange(s.size) + 1000 * i + 100 * j + k
            pairs[k].allreduce([s for s in segs if s.size], ReduceOp.SUM, False, "allreduce", _no_peers)
            results[k].append(np.concatenate(segs).copy())
            if rnd.random() < 0.3:
                time.sleep(0.001)

    try:
        on_threads(2, member)
        for i in range(rounds):
            want = np.concatenate([2 * (np.arange(n) + 1000 * i + 100 * j) + 1 for j, n in enumerate(lengths)])
            for k in range(2):
                np.testing.assert_array_equal(results[k][i], want, err_msg=f"round {i} rank {k}")
    finally:
        _close(pairs)


def test_compiled_and_python_loops_match_numpy_bit_for_bit_on_ragged_pieces(monkeypatch):
    # each rank cuts the same elements into different pieces (the blocks of 64 bytes end inside, at and across
    # their ends; an empty piece dropped): the compiled reduce-scatter (one call for every block) and the Python
    # loop give numpy's bits, for every dtype and op
    if shm_cma._CMA_REDUCE is None:
        pytest.skip("the compiled loop is not built here")
    pairs = _pairs(block_bytes=64)
    cuts = [[3, 1, 40, 17, 64, 5, 1], [70, 2, 2, 16, 33, 8]]  # 131 elements on both
    try:
        for dtype in DTYPES:
            bf16 = dtype == "bfloat16"
            for op in OPS:
                arrays = [_data(131, k, 131, dtype) for k in range(2)]
                want = reference_reduce(arrays, op, bf16)
                for compiled in (True, False):
                    monkeypatch.setattr(shm_cma, "COMPILED", compiled)
                    segs = [np.split(a.copy(), np.cumsum(cuts[k])[:-1]) for k, a in enumerate(arrays)]
                    on_threads(2, lambda k, segs=segs, op=op, bf16=bf16: pairs[k].allreduce(
                        segs[k], op, bf16, "allreduce", _no_peers))
                    for k in range(2):
                        np.testing.assert_array_equal(np.concatenate(segs[k]), want,
                                                      err_msg=f"{dtype} {op} compiled={compiled} rank {k}")
    finally:
        _close(pairs)


def test_an_absent_peer_times_out_naming_it():
    pairs = _pairs(timeout_s=0.3)
    try:
        with pytest.raises(CollectiveTimeoutError, match="rank 1 did not take part") as info:
            pairs[0].allreduce([np.ones(10, np.float32)], ReduceOp.SUM, False, "allreduce", _no_peers)
        assert info.value.rank == 1
    finally:
        _close(pairs)


def test_a_size_mismatch_is_named_and_too_many_arrays_are_not_taken():
    pairs = _pairs()
    errors: list[str] = []

    def mismatched(k: int) -> None:
        try:
            pairs[k].allreduce([np.ones(10 + k, np.float32)], ReduceOp.SUM, False, "allreduce", _no_peers)
        except TensorMismatchError as exc:
            errors.append(str(exc))

    try:
        on_threads(2, mismatched)
        assert sorted(errors) == ["allreduce: rank 0 allreduces 40 bytes, rank 1 44",
                                  "allreduce: rank 1 allreduces 44 bytes, rank 0 40"]
        assert not pairs[0].takes([np.ones(1, np.uint8)] * (shm_cma.MAX_SEGS + 1))
    finally:
        _close(pairs)


def _through_backend(seed: int, refuse_on: int | None) -> dict:
    """Allreduce sizes around the threshold (4 KiB here) and a fused call; digest of every result."""
    if refuse_on is not None:
        import os

        if int(os.environ["SPARK_HVD_RANK"]) == refuse_on:
            shm_cma.probe = lambda group: "refused by the test"
    be = backend_from_env()
    out: dict = {"cma": be._cma is not None}
    try:
        for n in (1023, 1024, 1025, 70_001):
            buf = _data(seed, be.rank, n, "float32")
            be.allreduce(buf, ReduceOp.AVERAGE)
            out[n] = hashlib.sha256(buf.tobytes()).hexdigest()
        fused = [_data(seed, be.rank, n, "int64") for n in (300, 1, 900)]
        be.allreduce_fused(fused, ReduceOp.MAX)
        out["fused"] = hashlib.sha256(np.concatenate(fused).tobytes()).hexdigest()
        for rows in (1025, 3, 20_001):  # reducescatter and allgather around the threshold, ragged
            mine = _data(seed, be.rank, rows * 2, "float32").reshape(rows, 2)
            out[f"rs{rows}"] = hashlib.sha256(be.reducescatter(mine, ReduceOp.SUM).tobytes()).hexdigest()
            out[f"ag{rows}"] = hashlib.sha256(be.allgather(mine[be.rank:]).tobytes()).hexdigest()
        many = [np.full(16, be.rank + i, np.int64) for i in range(shm_cma.MAX_SEGS + 1)]  # too many: the slots
        be.allreduce_fused(many, ReduceOp.SUM)
        out["many"] = [int(a.sum()) for a in many]
    finally:
        be.close()
    return out


@pytest.mark.parametrize("refuse_on,cma", [(None, "4096"), (1, "4096"), (None, "0")],
                         ids=["cma", "probe-refused", "off"])
def test_backend_threshold_fusion_and_fallback(refuse_on, cma):
    seed = 11
    results = run_ranks(_through_backend, 2, env={"SPARK_HVD_SHM": "1", "SPARK_HVD_SHM_CMA": cma,
                                                  "SPARK_HVD_TIMEOUT": "30"}, timeout=120, args=(seed, refuse_on))
    rs = {key: results[0].pop(key) + results[1].pop(key) for key in list(results[0]) if str(key).startswith("rs")}
    assert results[0] == results[1]  # identical bits on both ranks
    for rows in (1025, 3, 20_001):
        whole = [_data(seed, k, rows * 2, "float32").reshape(rows, 2) for k in range(2)]
        total = reference_reduce(whole, ReduceOp.SUM)
        mid = (rows + 1) // 2
        assert rs[f"rs{rows}"] == "".join(hashlib.sha256(p.tobytes()).hexdigest() for p in (total[:mid], total[mid:]))
        gathered = np.concatenate([whole[0], whole[1][1:]])
        assert results[0][f"ag{rows}"] == hashlib.sha256(gathered.tobytes()).hexdigest()
    assert results[0]["cma"] is (refuse_on is None and cma != "0")  # both fall back when either probe fails
    for n in (1023, 1024, 1025, 70_001):
        want = reference_reduce([_data(seed, k, n, "float32") for k in range(2)], ReduceOp.AVERAGE)
        assert results[0][n] == hashlib.sha256(want.tobytes()).hexdigest(), n
    fused = [np.concatenate([_data(seed, k, n, "int64") for n in (300, 1, 900)]) for k in range(2)]
    assert results[0]["fused"] == hashlib.sha256(np.maximum(*fused).tobytes()).hexdigest()
    assert results[0]["many"] == [16 * (2 * i + 1) for i in range(shm_cma.MAX_SEGS + 1)]
