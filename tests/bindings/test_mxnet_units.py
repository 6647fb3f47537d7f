"""spark_hvd.mxnet in one process (a job of one rank): NDArray views and the copies they avoid, the optimizer
wrapper's attributes, groups, compression, argument checks, the Module API. Skipped where mxnet does not import."""

from __future__ import annotations

import ctypes
import warnings

import numpy as np
import pytest
from helpers.mxnet_env import mxnet_skip_reason

# The floor leg (make leg-floor) installs MXNet and runs these with the compatibility subset; elsewhere they skip.
pytestmark = pytest.mark.compat

if (_reason := mxnet_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

warnings.filterwarnings("ignore", category=DeprecationWarning)
import mxnet as mx  # noqa: E402
from mxnet.base import _LIB, check_call  # noqa: E402

import spark_hvd.core as core  # noqa: E402
import spark_hvd.mxnet as hvd  # noqa: E402
from spark_hvd.mxnet import ndarray as nda  # noqa: E402
from spark_hvd.mxnet.optimizer import split_groups  # noqa: E402

MXNET2 = int(mx.__version__.split(".")[0]) >= 2  # the 2.0 beta: Gluon takes mx.np arrays, update() takes lists
gluon_ones = (lambda shape: mx.np.ones(shape)) if MXNET2 else (lambda shape: mx.nd.ones(shape))


@pytest.fixture
def single(monkeypatch):
    for var in ("SPARK_HVD_RANK", "SPARK_HVD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                "SPARK_HVD_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    core.shutdown()
    hvd.init()
    yield
    hvd.shutdown()


def _pointer(nd: mx.nd.NDArray) -> int:
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    return int(ptr.value)


def test_views_are_the_ndarray_memory():
    x = mx.nd.arange(12).reshape((3, 4))
    w = nda.write_view(x)
    assert w.ctypes.data == _pointer(x) and w.shape == (3, 4) and w.dtype == np.float32
    w *= 2  # writes land in the NDArray
    np.testing.assert_array_equal(x.asnumpy(), np.arange(12).reshape(3, 4) * 2)
    r = nda.read_view(x)
    assert not r.flags.writeable and r.ctypes.data == _pointer(x)
    s = x[1:2]  # a slice is a view with an offset
    assert nda.write_view(s).ctypes.data == _pointer(x) + 4 * 4


def test_a_view_waits_for_queued_writes():
    a = mx.nd.random.uniform(shape=(300, 300))
    b = mx.nd.dot(a, a)  # queued
    np.testing.assert_allclose(nda.read_view(b), a.asnumpy() @ a.asnumpy(), rtol=1e-4)


def test_small_arrays_used_again_keep_their_view():
    x = mx.nd.ones((8,))
    first = nda.write_view(x)
    assert id(x) not in nda._VIEWS
    second = nda.write_view(x)
    assert id(x) in nda._VIEWS and nda.write_view(x) is second
    assert first.ctypes.data == second.ctypes.data
    big = mx.nd.ones((1 << 15,))  # 128 KiB: over _VIEW_MAX_BYTES
    nda.write_view(big)
    nda.write_view(big)
    assert id(big) not in nda._VIEWS


def test_results_take_the_buffer_without_a_copy():
    buf = np.arange(6, dtype=np.float32)
    out = nda.to_ndarray(buf, mx.cpu(0))
    assert _pointer(out) == buf.ctypes.data
    del buf
    np.testing.assert_array_equal((out * 2).asnumpy(), np.arange(6) * 2)  # the NDArray keeps the memory alive
    other = nda.to_ndarray(np.ones(3, np.float32), mx.cpu(1))  # another CPU context: copied there
    assert other.context == mx.cpu(1)


def test_size_one_collectives_and_errors(single):
    x = mx.nd.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(hvd.allreduce(x).asnumpy(), [1, 2, 3])
    np.testing.assert_array_equal(hvd.allgather(x).asnumpy(), [1, 2, 3])
    assert hvd.size() == 1 and hvd.rank() == 0 and hvd.is_initialized()
    with pytest.raises(hvd.CollectiveArgumentError, match="dtype bool"):
        hvd.allreduce(mx.nd.zeros((2,), dtype="bool"))
    with pytest.raises(ValueError, match="op must be one of"):
        hvd.reducescatter(x, op=hvd.Min)
    with pytest.raises(ValueError, match="either op= or the deprecated average="):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_not_initialized_names_the_call():
    core.shutdown()
    with pytest.raises(hvd.NotInitializedError, match=r"allreduce_\(\)"):
        hvd.allreduce_(mx.nd.ones((2,)))


def test_split_groups_as_horovod():
    assert split_groups(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_groups(list(range(2)), 5) == [[0], [1]]
    assert split_groups([], 2) == []


def test_compression_fp16_as_horovod():
    for dtype in ("float16", "float32", "float64"):
        t = mx.nd.ones((3, 2), dtype=dtype)
        sent, ctx = hvd.Compression.fp16.compress(t)
        assert sent.dtype == np.float16
        assert hvd.Compression.fp16.decompress(sent, ctx).dtype == t.dtype
    for dtype in ("uint8", "int8", "int32", "int64"):
        t = mx.nd.ones((3,), dtype=dtype)
        assert hvd.Compression.fp16.compress(t)[0] is t


def test_distributed_optimizer_passes_attributes_to_the_wrapped_one(single):
    inner = mx.optimizer.SGD(learning_rate=0.5)
    opt = hvd.DistributedOptimizer(inner)
    opt.rescale_grad = 0.25  # what gluon.Trainer.step does
    assert inner.rescale_grad == 0.25 and opt.learning_rate == 0.5
    w, g = mx.nd.ones((2,)), mx.nd.ones((2,))
    if MXNET2:
        opt.update([0], [w], [g], [opt.create_state(0, w)])
    else:
        opt.update(0, w, g, opt.create_state(0, w))
    np.testing.assert_allclose(w.asnumpy(), 1 - 0.5 * 0.25)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(inner, gradient_predivide_factor=0)


def test_trainer_states_save_and_load_with_either_wrapper(single, tmp_path):
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    for i, trainer in enumerate([
            mx.gluon.Trainer(net.collect_params(), hvd.DistributedOptimizer(mx.optimizer.SGD(momentum=0.9)),
                             kvstore=None),
            hvd.DistributedTrainer(net.collect_params(), "adam")]):
        with mx.autograd.record():
            loss = net(gluon_ones((2, 3))).sum()
        loss.backward()
        trainer.step(2)
        trainer.save_states(str(tmp_path / f"states{i}"))
        trainer.load_states(str(tmp_path / f"states{i}"))
        assert isinstance(trainer._optimizer, hvd.DistributedOptimizer) == (i == 0)
        trainer.step(2, ignore_stale_grad=True)


def test_trainer_unwraps_a_distributed_optimizer(single):
    net = mx.gluon.nn.Dense(2, in_units=3)
    net.initialize()
    with pytest.warns(UserWarning, match="unwrapped"):
        trainer = hvd.DistributedTrainer(net.collect_params(), hvd.DistributedOptimizer(mx.optimizer.SGD()))
    assert type(trainer._optimizer) is mx.optimizer.SGD
    with pytest.raises(ValueError, match="prefix"):
        hvd.DistributedTrainer(net.collect_params(), "sgd", prefix=3)


@pytest.mark.skipif(MXNET2, reason="MXNet 2 has no Module API")
def test_module_api_with_distributed_optimizer(single):
    """Horovod's MXNet Module recipe: ``Module.fit(kvstore=None, optimizer=hvd.DistributedOptimizer(...))``."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 4)).astype(np.float32), rng.integers(0, 2, 64).astype(np.float32)
    data = mx.sym.Variable("data")
    out = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(data, num_hidden=2, name="fc"), name="softmax")
    mod = mx.mod.Module(out, data_names=["data"], label_names=["softmax_label"])
    it = mx.io.NDArrayIter(x, y, batch_size=16)
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, rescale_grad=1 / 16))
    mod.fit(it, num_epoch=2, kvstore=None, optimizer=opt, initializer=mx.init.Xavier())
    arg_params, _ = mod.get_params()
    hvd.broadcast_parameters(arg_params, root_rank=0)  # a dict of NDArrays
    assert set(arg_params) == {"fc_weight", "fc_bias"}
