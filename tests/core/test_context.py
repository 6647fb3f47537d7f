"""The process API at size 1 (LocalBackend, the real engine thread, no sockets)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import spark_hvd.core as core
from spark_hvd.core.reduce import ELEMENTWISE_OPS


@pytest.fixture
def single(monkeypatch):
    for var in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                "SPARK_HVD_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    core.shutdown()
    core.init()
    yield
    core.shutdown()


def test_not_initialized_errors():
    core.shutdown()
    assert not core.is_initialized()
    for call in (core.rank, core.size, core.local_rank, core.barrier, core.join, core.settings,
                 lambda: core.allreduce(np.ones(2)), lambda: core.allreduce_async(np.ones(2)),
                 lambda: core.broadcast_object(1), lambda: core.allgather_object(1)):
        with pytest.raises(core.NotInitializedError):
            call()


def test_init_is_idempotent_and_topology(single):
    engine = core.get_engine()
    core.init()
    assert core.get_engine() is engine
    assert core.is_initialized()
    assert (core.rank(), core.size(), core.local_rank(), core.local_size(), core.cross_rank(),
            core.cross_size()) == (0, 1, 0, 1, 0, 1)
    assert core.backend_name() == "local"
    assert isinstance(core.settings(), core.Settings)


def test_collectives_at_size_one(single):
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8):
        data = (rng.random(17) * 10).astype(dtype)
        buf = data.copy()
        for op in ELEMENTWISE_OPS:  # Adasum takes floats only (its own tests)
            assert core.allreduce(buf, op=op) is buf
            np.testing.assert_array_equal(buf, data)
    data = rng.random(10)
    buf = data.copy()
    core.allreduce(buf, op=core.Sum, prescale=2.0, postscale=0.25)
    np.testing.assert_allclose(buf, data * 0.5)
    data = rng.random((3, 4))
    out = core.allgather(data)
    assert out is not data and np.array_equal(out, data)
    b = data.copy()
    assert core.broadcast(b, 0) is b and np.array_equal(b, data)
    arr, splits = core.alltoall(np.arange(6))
    assert np.array_equal(arr, np.arange(6)) and splits == [6]
    assert np.array_equal(core.reducescatter(data, op=core.Sum), data)
    bufs = [rng.random(3), rng.random(5)]
    copies = [b.copy() for b in bufs]
    outs = core.grouped_allreduce(bufs, op=core.Sum)
    assert all(o is b and np.array_equal(o, c) for o, b, c in zip(outs, bufs, copies, strict=True))
    core.barrier()
    assert core.join() == 0
    assert core.broadcast_object({"a": [1, 2]}) == {"a": [1, 2]}
    assert core.allgather_object(("x", 3)) == [("x", 3)]


def test_async_handles_and_poll(single):
    bufs = [np.full(4, float(i)) for i in range(20)]
    handles = [core.allreduce_async(b, name=f"t{i}", op=core.Sum) for i, b in enumerate(bufs)]
    for i, h in enumerate(handles):
        assert core.synchronize(h) is bufs[i]
        assert core.poll(h)
    assert core.get_engine().stats["fused_collectives"] >= 1


def test_bfloat16_scaling(single):
    values = np.array([1.0, -2.5, 3.0, 0.0], dtype=np.float32)
    bits = (values.view(np.uint32) >> 16).astype(np.uint16)
    core.allreduce(bits, op=core.Sum, prescale=2.0, bfloat16=True)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(back, values * 2)
    with pytest.raises(TypeError, match="uint16"):
        core.allreduce(values, bfloat16=True)


def test_errors_name_the_tensor(single):
    with pytest.raises(ValueError, match="in place"):
        core.allreduce(np.arange(6.0)[::2], name="strided")
    with pytest.raises(ValueError, match="root_rank 3"):
        core.broadcast(np.ones(2), 3, name="b")
    with pytest.raises(TypeError, match="numpy"):
        core.allreduce([1.0, 2.0])
    with pytest.raises(TypeError, match="allreduce of 'cplx'.*complex"):
        core.allreduce(np.ones(3, np.complex64), name="cplx")
    assert np.array_equal(core.allreduce(np.ones(3)), np.ones(3))  # the engine is still fine


def test_shutdown_then_init_again(single):
    core.shutdown()
    with pytest.raises(core.NotInitializedError):
        core.size()
    core.init()
    assert core.size() == 1
    assert np.array_equal(core.allreduce(np.ones(3)), np.ones(3))


def test_import_stays_light():
    code = ("import sys, spark_hvd.core\n"
            "print(','.join(m for m in ('torch', 'tensorflow', 'pyspark', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
