"""One rank of the spark_hvd.mxnet checks; run as ``spark-hvd-run -np 2 python mxnet_worker.py OUT_DIR``.
Results go to ``OUT_DIR/mxnet-rank<r>.json``, one entry per check. Every rank makes every rank's random data from
seeds, so it knows the expected result in numpy."""

from __future__ import annotations

import ctypes

# isort: split
from mxnet_job import BATCH, LOSS, MXNET2, N, R, batches, check, finish, gluon_array, hvd  # first: warnings off
from mxnet_job import train as job_train

# isort: split
import mxnet as mx
import numpy as np
from checks import adasum_tree, expect_errors  # the scripts' directory is on sys.path
from mxnet.base import _LIB, MXNetError, check_call

DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64]


def data(r: int, shape: tuple[int, ...], dtype: type = np.float32, seed: int = 0, small: bool = False) -> np.ndarray:
    """Rank ``r``'s random array; integers small enough that sums and products of N ranks fit the dtype."""
    rng = np.random.default_rng(1000 * seed + r)
    if np.issubdtype(dtype, np.integer):
        lo = 0 if np.issubdtype(dtype, np.unsignedinteger) else -5
        return rng.integers(lo, 6 if small else 40, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def close(a: object, b: np.ndarray, tol: float | None = None) -> None:
    a = a.asnumpy() if isinstance(a, mx.nd.NDArray) else np.asarray(a)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    assert a.dtype == b.dtype, f"dtype {a.dtype} != {b.dtype}"
    if tol is None:
        tol = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5}.get(a.dtype, 1e-12)
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


def pointer(nd: mx.nd.NDArray) -> int:
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    return int(ptr.value)


@check("allreduce_every_op_and_dtype")
def _allreduce() -> None:
    for i, dt in enumerate(DTYPES):
        xs = [data(r, (5, 3), dt, seed=i, small=True) for r in range(N)]
        stack = np.stack(xs)
        x = mx.nd.array(xs[R], dtype=dt)
        ops = [(hvd.Sum, stack.sum(0)), (hvd.Min, stack.min(0)), (hvd.Max, stack.max(0)),
               (hvd.Product, stack.prod(0))]
        if np.issubdtype(dt, np.floating):
            ops.append((hvd.Average, stack.astype(np.float64).mean(0)))
        for op, ref in ops:
            ref = ref.astype(dt)
            close(hvd.allreduce(x, op=op, name=f"ar.{i}.{op.value}"), ref)
            y = x.copy()
            assert hvd.allreduce_(y, op=op) is y
            close(y, ref)
        close(x, xs[R])  # the out-of-place forms leave the input as it was
        if np.issubdtype(dt, np.floating):
            close(hvd.allreduce(x, average=True), stack.astype(np.float64).mean(0).astype(dt))
            close(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
                  (stack.astype(np.float64).sum(0) * 1.5).astype(dt))


@check("adasum")
def _adasum() -> None:
    xs = [data(r, (5, 3), seed=15) for r in range(N)]
    ys = [data(r, (9,), np.float64, seed=16) for r in range(N)]
    close(hvd.allreduce(mx.nd.array(xs[R]), op=hvd.Adasum), adasum_tree(xs).astype(np.float32))
    a, b = hvd.grouped_allreduce([mx.nd.array(xs[R]), mx.nd.array(ys[R], dtype="float64")], op=hvd.Adasum)
    close(a, adasum_tree(xs).astype(np.float32))
    close(b, adasum_tree(ys))


@check("grouped_allreduce_one_and_mixed_dtypes")
def _grouped() -> None:
    xs = [data(r, (4, 3), seed=20) for r in range(N)]
    ys = [data(r, (7,), seed=21) for r in range(N)]
    zs = [data(r, (2, 2), np.int64, seed=22) for r in range(N)]
    x, y, z = (mx.nd.array(a[R], dtype=a[R].dtype) for a in (xs, ys, zs))
    sx, sy, sz = (np.stack(a).sum(0) for a in (xs, ys, zs))
    a, b = hvd.grouped_allreduce([x, y], op=hvd.Sum, name="g.one")  # one dtype: packed into one buffer
    close(a, sx)
    close(b, sy)
    a, b, c = hvd.grouped_allreduce([x, y, z], op=hvd.Sum)  # mixed dtypes: the engine fuses them
    close(a, sx)
    close(c, sz)
    outs = hvd.grouped_allreduce_([x, y, z], op=hvd.Sum)
    assert outs[0] is x and outs[2] is z
    close(x, sx)
    close(y, sy)
    close(z, sz)
    a, b = hvd.grouped_allreduce([mx.nd.array(xs[R]), mx.nd.array(ys[R])])  # average
    close(a, np.stack(xs).mean(0).astype(np.float32))
    close(b, np.stack(ys).mean(0).astype(np.float32))
    assert hvd.grouped_allreduce([]) == []


@check("allgather_ragged_every_dtype")
def _allgather() -> None:
    for i, dt in enumerate(DTYPES):
        rag = [data(r, (r + 2, 3), dt, seed=30 + i) for r in range(N)]
        close(hvd.allgather(mx.nd.array(rag[R], dtype=dt)), np.concatenate(rag))
        one = [data(r, (r + 1,), dt, seed=40 + i) for r in range(N)]
        a, b = hvd.grouped_allgather([mx.nd.array(rag[R], dtype=dt), mx.nd.array(one[R], dtype=dt)], name=f"gg{i}")
        close(a, np.concatenate(rag))
        close(b, np.concatenate(one))


@check("broadcast_every_dtype")
def _broadcast() -> None:
    for i, dt in enumerate(DTYPES):
        xs = [data(r, (3, 4), dt, seed=50 + i) for r in range(N)]
        x = mx.nd.array(xs[R], dtype=dt)
        close(hvd.broadcast(x, root_rank=N - 1), xs[N - 1])
        close(x, xs[R])
        assert hvd.broadcast_(x, root_rank=0, name=f"b_{i}") is x
        close(x, xs[0])


@check("alltoall_with_and_without_splits")
def _alltoall() -> None:
    for i, dt in enumerate(DTYPES):
        splits = [[(r + j) % 3 + 1 for j in range(N)] for r in range(N)]
        a2a = [data(r, (sum(splits[r]), 2), dt, seed=60 + i) for r in range(N)]
        out, rsplits = hvd.alltoall(mx.nd.array(a2a[R], dtype=dt), splits=mx.nd.array(splits[R], dtype="int32"))
        expect = [a2a[r][sum(splits[r][:R]):sum(splits[r][:R + 1])] for r in range(N)]
        close(out, np.concatenate(expect))
        assert rsplits.dtype == np.int32 and rsplits.asnumpy().tolist() == [splits[r][R] for r in range(N)]
        even = [data(r, (2 * N, 3), dt, seed=70 + i) for r in range(N)]
        close(hvd.alltoall(mx.nd.array(even[R], dtype=dt)), np.concatenate([e[2 * R:2 * R + 2] for e in even]))
        out, _ = hvd.alltoall(mx.nd.array(even[R], dtype=dt), splits=[2] * N)  # a plain list works too
        close(out, np.concatenate([e[2 * R:2 * R + 2] for e in even]))


@check("reducescatter_sum_average_uneven")
def _reducescatter() -> None:
    counts = [7 // N + (1 if i < 7 % N else 0) for i in range(N)]
    lo = sum(counts[:R])
    for i, dt in enumerate(DTYPES):
        rs = [data(r, (7, 2), dt, seed=80 + i, small=True) for r in range(N)]
        x = mx.nd.array(rs[R], dtype=dt)
        close(hvd.reducescatter(x, op=hvd.Sum), np.stack(rs).sum(0).astype(dt)[lo:lo + counts[R]])
        if np.issubdtype(dt, np.floating):
            close(hvd.reducescatter(x), np.stack(rs).astype(np.float64).mean(0).astype(dt)[lo:lo + counts[R]])
            close(hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
                  np.stack(rs).sum(0).astype(dt)[lo:lo + counts[R]])
        a, b = hvd.grouped_reducescatter([x, x * 2], op=hvd.Sum)
        close(a, np.stack(rs).sum(0).astype(dt)[lo:lo + counts[R]])
        close(b, (2 * np.stack(rs)).sum(0).astype(dt)[lo:lo + counts[R]])


@check("compression_fp16_allreduce")
def _fp16() -> None:
    xs = [data(r, (6, 5), seed=90) for r in range(N)]
    x = mx.nd.array(xs[R])
    sent, ctx = hvd.Compression.fp16.compress(x)
    assert sent.dtype == np.float16
    back = hvd.Compression.fp16.decompress(hvd.allreduce(sent), ctx)
    close(back, np.stack(xs).mean(0).astype(np.float32), 5e-3)
    i32 = mx.nd.ones((3,), dtype="int32")
    assert hvd.Compression.fp16.compress(i32)[0] is i32


@check("in_place_forms_use_the_ndarray_memory")
def _zero_copy() -> None:
    """allreduce_ / broadcast_ hand the core the NDArray's own memory; allreduce's result is the core's buffer."""
    import spark_hvd.core as core

    seen: list[int] = []
    real = core.allreduce

    def spy(buf, *args, **kwargs):
        seen.append(buf.ctypes.data)
        return real(buf, *args, **kwargs)

    core.allreduce = spy
    try:
        x = mx.nd.ones((1024,)) * (R + 1)
        hvd.allreduce_(x, op=hvd.Sum)
        assert seen[-1] == pointer(x), "allreduce_ reduced a copy"
        out = hvd.allreduce(x, op=hvd.Sum)
        assert seen[-1] == pointer(out), "allreduce's result was copied after the reduction"
        assert pointer(out) != pointer(x)
    finally:
        core.allreduce = real
    close(out, np.full(1024, 2 * sum(range(1, N + 1)), np.float32))
    # a small array used again gets a kept view (spark_hvd.mxnet.ndarray._VIEWS); new values written by MXNet
    # between the calls are what the next call reduces
    from spark_hvd.mxnet import ndarray as nda

    g = mx.nd.zeros((16,))
    for step in range(4):
        g[:] = float(R + step)
        g *= 2.0  # queued by MXNet's engine: the view waits for it
        hvd.allreduce_(g, op=hvd.Sum, name="kept")
        close(g, np.full(16, sum(2.0 * (r + step) for r in range(N)), np.float32))
    assert id(g) in nda._VIEWS, "a small array used four times has no kept view"
    # a view that waits for MXNet's queued writes: the product below is still being computed when allreduce_ runs
    a = mx.nd.random.uniform(shape=(400, 400), ctx=mx.cpu())
    b = mx.nd.dot(a, a)
    ref = np.dot(a.asnumpy().astype(np.float64), a.asnumpy().astype(np.float64))
    b2 = mx.nd.dot(a, a)  # queued, not waited for
    hvd.allreduce_(b2, op=hvd.Max)  # every rank computes its own product; the max of equal-shaped results
    del b
    mine = hvd.allgather(mx.nd.array(ref[None].astype(np.float32)))
    np.testing.assert_allclose(b2.asnumpy(), mine.asnumpy().max(0), rtol=1e-4)


@check("mx_np_arrays_come_back_as_mx_np_arrays")
def _mx_np() -> None:
    xs = [data(r, (4, 2), seed=95) for r in range(N)]
    x = mx.np.array(xs[R])
    out = hvd.allreduce(x, op=hvd.Sum)
    assert isinstance(out, mx.np.ndarray), type(out)
    close(out.as_nd_ndarray(), np.stack(xs).sum(0))
    gathered = hvd.allgather(x)
    assert isinstance(gathered, mx.np.ndarray)
    close(gathered.as_nd_ndarray(), np.concatenate(xs))
    assert hvd.allreduce_(x, op=hvd.Max) is x
    close(x.as_nd_ndarray(), np.stack(xs).max(0))


@check("objects_barrier_join")
def _objects() -> None:
    assert hvd.broadcast_object({"r": R}, root_rank=N - 1) == {"r": N - 1}
    assert hvd.allgather_object(R * 10) == [r * 10 for r in range(N)]
    hvd.barrier()
    assert hvd.join() in range(N)
    assert hvd.is_initialized() and hvd.local_size() == N and hvd.cross_size() == 1


@check("argument_errors_name_the_rank")
def _errors() -> None:
    bad = mx.nd.zeros((3,), dtype="bool") if hasattr(np, "bool_") else None
    expect_errors([
        (lambda: hvd.allreduce(bad), "dtype bool"),
        (lambda: hvd.allreduce(np.ones(3)), "not an mx.nd.NDArray"),
        (lambda: hvd.alltoall(mx.nd.ones((N,)), mx.nd.ones((N,))), "splits must be integers"),
        (lambda: hvd.reducescatter(mx.nd.ones((4,)), op=hvd.Max), "op must be"),
    ], (ValueError, MXNetError))
    try:
        hvd.allreduce(mx.nd.ones((3,), dtype="bool"))
    except hvd.CollectiveArgumentError as e:
        assert f"rank {R}" in str(e) and isinstance(e, MXNetError) and isinstance(e, ValueError)


@check("mismatch_raises_runtime_error_naming_ranks")
def _mismatch() -> None:
    try:
        hvd.allreduce(mx.nd.ones((3 + R,)), name="mismatched")
    except RuntimeError as e:
        assert "mismatched" in str(e), str(e)
    else:
        raise AssertionError("a shape mismatch did not raise")
    close(hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum), np.full(2, N, np.float32))  # and the job goes on


def mlp(seed: int, deferred: bool = False) -> mx.gluon.nn.HybridSequential:
    mx.random.seed(seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(16, activation="relu", in_units=0 if deferred else 5),
            mx.gluon.nn.Dense(3, in_units=0 if deferred else 16))
    net.initialize(mx.init.Xavier())
    return net


def weights(net: mx.gluon.Block) -> list[np.ndarray]:
    return [p.data().asnumpy() for _, p in sorted(net.collect_params().items(), key=lambda kv: kv[0][-8:])]


STEPS = 5


def train(net: mx.gluon.Block, trainer: mx.gluon.Trainer, shards: list[int]) -> list[list[np.ndarray]]:
    """STEPS steps on the batches of ranks ``shards`` (this rank's own in a job, every rank's in one process)."""
    return job_train(net, trainer, shards, range(STEPS), weights)


def single_process(opt: str, params: dict) -> list[list[np.ndarray]]:
    net = mlp(7)
    return train(net, mx.gluon.Trainer(net.collect_params(), opt, dict(params), kvstore=None), list(range(N)))


def assert_same_history(got: list[list[np.ndarray]], want: list[list[np.ndarray]], tol: float) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=f"step {step}, parameter {i}")


@check("trainer_matches_single_process_on_combined_batches")
def _trainer() -> None:
    """SGD with ``sharded_update=True``: reduce-scatter, allgather, no allreduce (spark_hvd/mxnet/zero.py). Adam,
    the default: every gradient lives in one buffer that each step reduces with one allreduce in place, and a
    re-initialisation of the gradients after the trainer was made (``cast``) moves them into a new one."""
    import spark_hvd.core as core

    seen: list[int] = []
    real = core.allreduce

    def spy(buf, *args, **kwargs):
        seen.append(buf.ctypes.data)
        return real(buf, *args, **kwargs)

    for opt, params in (("sgd", {"learning_rate": 0.1, "momentum": 0.9}), ("adam", {"learning_rate": 0.01})):
        want = single_process(opt, params)
        net = mlp(7 + R)  # different weights on each rank until the broadcast
        hvd.broadcast_parameters(net.collect_params(), root_rank=0)
        trainer = hvd.DistributedTrainer(net.collect_params(), opt, dict(params), sharded_update=opt == "sgd")
        if opt == "adam":
            net.cast("float32")  # new data and gradient arrays (same values): the trainer's buffer is rebuilt
        core.allreduce, seen[:] = spy, []
        try:
            assert_same_history(train(net, trainer, [R]), want, 1e-5)
        finally:
            core.allreduce = real
        if opt == "sgd":
            assert trainer._zero is not None and not seen, f"not sharded: {trainer._unsharded_why}, {len(seen)}"
            continue
        (flat,) = trainer._flat.buffers
        start = pointer(flat)
        assert seen == [start] * STEPS, f"{len(seen)} allreduces of {seen} for {STEPS} steps, buffer at {start}"
        for p in net.collect_params().values():
            at = pointer(p.grad()) - start
            assert 0 <= at < flat.size * 4, f"{p.name}'s gradient is not in the trainer's buffer"


@check("trainer_options_groups_predivide_fp16")
def _trainer_options() -> None:
    params = {"learning_rate": 0.1}
    want = single_process("sgd", params)
    for kwargs, tol in (({"num_groups": 2}, 1e-5), ({"gradient_predivide_factor": 2.0}, 1e-5),
                        ({"compression": hvd.Compression.fp16, "prefix": "fp16."}, 5e-3), ({"prefix": "bound."}, 1e-5)):
        net = mlp(7)
        if kwargs.get("prefix") == "bound.":
            # a static_shape block whose backward ran before the trainer: it keeps writing the gradient arrays it
            # ran with, so the trainer gives them back and reduces them one by one (spark_hvd/mxnet/flat_grads.py)
            net.hybridize(static_alloc=True, static_shape=True)
            with mx.autograd.record():
                LOSS(net(gluon_array(batches(R, 0)[0])), gluon_array(batches(R, 0)[1])).backward()
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", dict(params), **kwargs)
        assert_same_history(train(net, trainer, [R]), want, tol)
        if kwargs.get("prefix") == "bound.":
            assert not trainer._fuse and trainer._flat is None, "the trainer kept buffers backward does not write"


@check("distributed_optimizer_in_gluon_trainer")
def _optimizer() -> None:
    params = {"learning_rate": 0.1, "momentum": 0.5}
    want = single_process("sgd", params)
    for kwargs in ({}, {"num_groups": 2, "gradient_predivide_factor": 2.0}):
        net = mlp(7)
        opt = hvd.DistributedOptimizer(mx.optimizer.SGD(**params), **kwargs)
        trainer = mx.gluon.Trainer(net.collect_params(), opt, kvstore=None)
        assert_same_history(train(net, trainer, [R]), want, 1e-5)
    # Horovod's test: an update averages the gradient, weights start equal
    w = mx.nd.array(data(0, (3, 4), seed=110))
    g = mx.nd.array(data(R, (3, 4), seed=111))
    opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=1.0))
    if MXNET2:  # MXNet 2's Optimizer.update takes lists (Horovod's test does the same)
        opt.update([0], [w], [g], [opt.create_state(0, w)])
    else:
        opt.update(0, w, g, opt.create_state(0, w))
    mean = np.stack([data(r, (3, 4), seed=111) for r in range(N)]).mean(0)
    close(w, (data(0, (3, 4), seed=110) - mean).astype(np.float32))


@check("trainer_waits_for_queued_reads_of_a_gradient")
def _queued_reads() -> None:
    """A read of a gradient queued before ``step`` (behind a slow product) sees this rank's own gradient: the
    trainer's allreduce waits for it before it writes the average into the gradient's memory."""
    net = mlp(7)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, prefix="reads.")
    xs, ys = batches(R, 0)
    with mx.autograd.record():
        loss = LOSS(net(gluon_array(xs)), gluon_array(ys))
    loss.backward()
    grad = net[-1].bias.grad()
    mine = grad.asnumpy()
    slow = mx.nd.random.uniform(shape=(700, 700))
    for _ in range(4):
        slow = mx.nd.dot(slow, slow) * 1e-3
    seen = grad.as_nd_ndarray() + mx.nd.sum(slow).as_nd_ndarray() * 0  # queued behind the products
    trainer.step(BATCH)
    np.testing.assert_allclose(seen.asnumpy(), mine, rtol=1e-6)
    others = hvd.allgather(mx.nd.array(mine[None])).asnumpy()
    np.testing.assert_allclose(grad.asnumpy(), others.mean(0), rtol=1e-5, atol=1e-7)


@check("broadcast_parameters_makes_ranks_equal")
def _broadcast_parameters() -> None:
    net = mlp(20 + R)
    hvd.broadcast_parameters(net.collect_params(), root_rank=N - 1, prefix="bp.")
    root = mlp(20 + N - 1)
    for a, b in zip(weights(net), weights(root), strict=True):
        np.testing.assert_array_equal(a, b)
    # a dict of NDArrays (Module.get_params()'s arg_params)
    arrays = {"w": mx.nd.array(data(R, (4, 2), seed=120)),
              "b": mx.nd.array(data(R, (2,), np.int32, seed=121), dtype="int32")}
    hvd.broadcast_parameters(arrays, root_rank=0, prefix="nd.")
    close(arrays["w"], data(0, (4, 2), seed=120))
    close(arrays["b"], data(0, (2,), np.int32, seed=121))
    # deferred initialisation: root's values once the first forward pass gives the shapes
    lazy = mlp(30 + R, deferred=True)
    hvd.broadcast_parameters(lazy.collect_params(), root_rank=0, prefix="lazy.")
    lazy(gluon_array(np.ones((2, 5), np.float32)))
    for w in weights(lazy):
        gathered = hvd.allgather(mx.nd.array(w[None])).asnumpy()
        np.testing.assert_array_equal(gathered[0], gathered[-1])


finish()
