"""``ShmGroup.allreduce``'s block pipeline (``spark_hvd.core.transport.shm``) on its own: members on threads of one
process, tiny blocks and few slots, so every path of ``_BlockAllreduce`` runs many times (two members straight
from the peer's slot, small blocks reduced in full, larger ones reduce-scattered and gathered; slots reused)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.transport.shm import shm_available
from tests.helpers.ranks import on_threads, shm_groups

pytestmark = pytest.mark.skipif(not shm_available(), reason="no /dev/shm here")


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MAX])
def test_block_allreduce_matches_numpy_over_many_blocks(size, op):
    # 256-byte blocks, 3 slots: 1001 float32 (+ a second array) are ~17 blocks, the last one short (small-block
    # path at 3 members); ``profile`` on the second call times copy-in and finish without changing the result
    groups = shm_groups(f"blocks{size}{op.name}", size)
    rng = np.random.default_rng(size)
    data = [[rng.integers(-50, 50, n).astype(np.float32) for n in (1001, 37)] for _ in range(size)]
    reduce = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MAX: np.maximum}[op]
    expected = []
    for i in range(2):
        total = data[0][i].copy()
        for k in range(1, size):
            total = reduce(total, data[k][i])
        expected.append(total / size if op is ReduceOp.AVERAGE else total)
    results: list = [None] * size

    def member(k: int) -> None:
        for call in range(2):
            groups[k].profile = {} if call else None
            segs = [a.copy() for a in data[k]]
            groups[k].allreduce(segs, op, False, "allreduce", lambda operation: None)
            results[k] = segs
        assert groups[k].profile["blocks"] > 10 and groups[k].profile["finish"] > 0

    try:
        on_threads(size, member)
    finally:
        for g in groups:
            g.close()
    for segs in results:
        for got, want in zip(segs, expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_barrier_returns_after_every_member_called_it_and_keeps_the_members_in_step():
    # member 2 arrives last, after setting ``late``: no member may leave the barrier before it; the allreduce after
    # it still matches numpy (the barrier, ``release`` included, used one sequence number on every member)
    groups = shm_groups("barrier3", 3)
    late = threading.Event()
    seen: list = [None] * 3
    results: list = [None] * 3

    def member(k: int) -> None:
        if k == 2:
            threading.Event().wait(0.2)
            late.set()
        groups[k].barrier("barrier", lambda operation: None)
        seen[k] = late.is_set()
        arr = np.full(5, k + 1, np.float32)
        groups[k].allreduce([arr], ReduceOp.SUM, False, "allreduce", lambda operation: None)
        results[k] = arr

    try:
        on_threads(3, member)
    finally:
        for g in groups:
            g.close()
    assert seen == [True] * 3
    for arr in results:
        np.testing.assert_array_equal(arr, np.full(5, 6, np.float32))


def test_release_gives_up_on_a_peer_that_has_not_finished():
    # a peer still short of this member's last collective (here: it never ran it) is waited for only briefly, and
    # release moves no counter
    from spark_hvd.core.transport.shm import IN, OUT

    groups = shm_groups("release2", 2)
    try:
        groups[0].seq += 1
        before = [list(g.ctrl[g.local][:OUT + 1]) for g in groups]
        groups[0].release()
        assert [list(g.ctrl[g.local][:OUT + 1]) for g in groups] == before
        assert groups[1].ctrl[1][OUT] < groups[0].seq and groups[0].ctrl[0][IN] == 0
    finally:
        for g in groups:
            g.close()


_SMALL_CASES = [  # (dtype, op, bfloat16): every kernel family the compiled small path takes, and one it does not
    (np.float32, ReduceOp.SUM, False), (np.float32, ReduceOp.AVERAGE, False), (np.float32, ReduceOp.MIN, False),
    (np.float64, ReduceOp.MAX, False), (np.float32, ReduceOp.PRODUCT, False), (np.float16, ReduceOp.AVERAGE, False),
    (np.uint16, ReduceOp.SUM, True), (np.uint16, ReduceOp.AVERAGE, True), (np.int32, ReduceOp.AVERAGE, False),
    (np.int8, ReduceOp.PRODUCT, False), (np.uint64, ReduceOp.SUM, False), (np.bool_, ReduceOp.MAX, False),
]


def _small_inputs(size: int) -> list[list[np.ndarray]]:
    """Per member, one array per case: random values with NaNs among the floats, bfloat16 as raw uint16 bits."""
    rng = np.random.default_rng(7 + size)
    inputs = []
    for _ in range(size):
        arrays = []
        for dtype, _op, bfloat16 in _SMALL_CASES:
            if bfloat16:
                arr = (rng.standard_normal(200).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
            elif np.dtype(dtype).kind == "f":
                arr = (rng.standard_normal(200) * 3).astype(dtype)
                arr[rng.integers(0, 200, 5)] = np.nan
            else:
                arr = rng.integers(0, 2 if dtype is np.bool_ else 9, 200).astype(dtype)
            arrays.append(arr)
        inputs.append(arrays)
    return inputs


@pytest.mark.parametrize("size", [2, 3])
def test_compiled_small_path_gives_the_python_paths_bits(size, monkeypatch):
    # the same small allreduces (one array of one block) through ``_ringloop.shm_small`` and through the Python path,
    # every member in step: identical bits, and equal to numpy's rank-order reduction; more calls than slots (slot
    # reuse), and member 1 arrives 5 ms late once, past the compiled wait's budget (the wait goes on in Python)
    from spark_hvd.core.reduce import reference_reduce
    from spark_hvd.core.transport import ringloop, shm

    if not ringloop.BUILT:
        pytest.skip("the compiled loop is not built here")
    inputs = _small_inputs(size)
    got: dict[bool, list] = {}
    for compiled in (True, False):
        monkeypatch.setattr(shm, "COMPILED_SMALL", compiled)
        # 8 KiB blocks: small_bytes 2 KiB, so every case (at most 1600 bytes) takes the small path
        groups = shm_groups(f"small{size}{int(compiled)}", size, block_bytes=8192)
        assert all((g.layout is not None) is compiled for g in groups)
        results: list = [None] * size

        def member(k: int, groups: list = groups, results: list = results) -> None:
            out = []
            for i, (arr, (_dtype, op, bfloat16)) in enumerate(zip(inputs[k], _SMALL_CASES, strict=True)):
                if k == 1 and i == 4:
                    threading.Event().wait(0.005)
                work = arr.copy()
                with np.errstate(all="ignore"):
                    groups[k].allreduce([work], op, bfloat16, "allreduce", lambda operation: None)
                out.append(work)
            results[k] = out

        try:
            on_threads(size, member)
        finally:
            for g in groups:
                g.close()
        got[compiled] = results
    for k in range(size):
        for i, (_dtype, op, bfloat16) in enumerate(_SMALL_CASES):
            assert got[True][k][i].tobytes() == got[False][k][i].tobytes(), (k, _SMALL_CASES[i])
            if op in (ReduceOp.MIN, ReduceOp.MAX):  # which NaN a member keeps depends on its order: values only
                continue
            with np.errstate(all="ignore"):
                want = reference_reduce([inputs[m][i] for m in range(size)], op, bfloat16)
            np.testing.assert_array_equal(got[True][k][i], want, err_msg=str(_SMALL_CASES[i]))
