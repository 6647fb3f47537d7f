"""One rank of the spark_hvd.tensorflow checks; run as ``spark-hvd-run -np 2 python tf_worker.py OUT_DIR``.
Results go to ``OUT_DIR/tf-rank<r>.json``, one entry per check. Every rank makes every rank's random data from
seeds, so it knows the expected result in numpy."""

from __future__ import annotations

import json
import os
import sys

from checks import adasum_tree, make_check, setup_tensorflow  # the scripts' directory is on sys.path

setup_tensorflow()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_hvd.tensorflow as hvd  # noqa: E402

RESULTS: dict[str, str] = {}
OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else "."
check = make_check(RESULTS, after=lambda: hvd.barrier())

hvd.init()
R, N = hvd.rank(), hvd.size()


def data(r: int, shape: tuple[int, ...], dtype: type = np.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + r)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-50, 50, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def close(a: object, b: np.ndarray, tol: float = 1e-5) -> None:
    a = np.asarray(a)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


def all_collectives(run: object, seed: int) -> None:
    """Every collective through ``run(fn)`` (eager: fn(); graph: tf.function(fn)()) against numpy."""
    xs = [data(r, (5, 3), seed=seed) for r in range(N)]
    ints = [data(r, (7,), np.int32, seed=seed) for r in range(N)]
    stack = np.stack(xs)
    x, xi = tf.constant(xs[R]), tf.constant(ints[R])
    for op, ref in ((hvd.Sum, stack.sum(0)), (hvd.Average, stack.mean(0)), (hvd.Min, stack.min(0)),
                    (hvd.Max, stack.max(0)), (hvd.Product, stack.prod(0))):
        close(run(lambda op=op: hvd.allreduce(x, op=op)), ref)
    close(run(lambda: hvd.allreduce(xi, op=hvd.Sum)), np.stack(ints).sum(0), 0)
    close(run(lambda: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)), stack.sum(0) * 1.5)
    close(run(lambda: hvd.allreduce(x, compression=hvd.Compression.fp16)), stack.mean(0), 2e-3)
    outs = run(lambda: hvd.grouped_allreduce([x, x * 2.0, tf.cast(xi, tf.float64)], op=hvd.Sum))
    close(outs[0], stack.sum(0))
    close(outs[1], 2 * stack.sum(0))
    close(outs[2], np.stack(ints).sum(0).astype(np.float64))
    # Adasum: one tensor, and two fused with each its own coefficients (float64 and fp16-compressed too)
    ys = [data(r, (9,), seed=seed + 5) for r in range(N)]
    close(run(lambda: hvd.allreduce(x, op=hvd.Adasum)), adasum_tree(xs))
    a1, a2 = run(lambda: hvd.grouped_allreduce([x, tf.constant(ys[R])], op=hvd.Adasum))
    close(a1, adasum_tree(xs))
    close(a2, adasum_tree(ys))
    close(run(lambda: hvd.allreduce(tf.cast(x, tf.float64), op=hvd.Adasum)), adasum_tree(xs), 1e-12)
    close(run(lambda: hvd.allreduce(x, op=hvd.Adasum, compression=hvd.Compression.fp16)), adasum_tree(xs), 5e-3)
    # allgather with a ragged first dimension: rank r sends r + 2 rows
    rag = [data(r, (r + 2, 4), seed=seed + 1) for r in range(N)]
    close(run(lambda: hvd.allgather(tf.constant(rag[R]))), np.concatenate(rag))
    g1, g2 = run(lambda: hvd.grouped_allgather([tf.constant(rag[R]), xi]))
    close(g1, np.concatenate(rag))
    close(g2, np.concatenate(ints), 0)
    close(run(lambda: hvd.broadcast(x, root_rank=N - 1)), xs[N - 1])
    # alltoall: rank r sends splits[r][j] rows to rank j
    splits = [[(r + j) % 3 + 1 for j in range(N)] for r in range(N)]
    a2a = [data(r, (sum(splits[r]), 2), seed=seed + 2) for r in range(N)]
    out, rsplits = run(lambda: hvd.alltoall(tf.constant(a2a[R]), splits=tf.constant(splits[R], tf.int32)))
    expect = [a2a[r][sum(splits[r][:R]):sum(splits[r][:R + 1])] for r in range(N)]
    close(out, np.concatenate(expect))
    assert list(np.asarray(rsplits)) == [splits[r][R] for r in range(N)], rsplits
    even = [data(r, (2 * N, 3), seed=seed + 3) for r in range(N)]
    close(run(lambda: hvd.alltoall(tf.constant(even[R]))), np.concatenate([e[2 * R:2 * R + 2] for e in even]))
    # reducescatter with uneven rows (7 rows over N ranks: the first 7 % N ranks get one more)
    rs = [data(r, (7, 2), seed=seed + 4) for r in range(N)]
    counts = [7 // N + (1 if i < 7 % N else 0) for i in range(N)]
    lo = sum(counts[:R])
    close(run(lambda: hvd.reducescatter(tf.constant(rs[R]), op=hvd.Sum)), np.stack(rs).sum(0)[lo:lo + counts[R]])
    close(run(lambda: hvd.reducescatter(tf.constant(rs[R]))), np.stack(rs).mean(0)[lo:lo + counts[R]])
    a, b = run(lambda: hvd.grouped_reducescatter([tf.constant(rs[R]), tf.constant(rs[R]) * 2], op=hvd.Sum))
    close(a, np.stack(rs).sum(0)[lo:lo + counts[R]])
    close(b, 2 * np.stack(rs).sum(0)[lo:lo + counts[R]])


@check("collectives_eager")
def _eager() -> None:
    all_collectives(lambda fn: fn(), seed=1)


@check("host_memory_without_copies")
def _host_memory() -> None:
    from spark_hvd.tensorflow import host_memory

    x = tf.constant(data(R, (1000,), seed=14))
    assert np.shares_memory(host_memory.view(x), host_memory.view(x))  # the tensor's own memory, not a copy
    # a buffer handed over becomes the tensor's memory when aligned; an unaligned one is copied (TF's kernels
    # would abort the process on it)
    mine = host_memory.writable_copy(np.arange(256, dtype=np.float32))
    shared = host_memory.to_tensor(mine, tf.float32, owned=True)
    assert np.shares_memory(host_memory.view(shared), mine)
    odd = host_memory.aligned_empty((257,), np.float32)[1:]
    odd[:] = 1.0
    copied = host_memory.to_tensor(odd, tf.float32, owned=True)
    assert not np.shares_memory(host_memory.view(copied), odd) and float(tf.reduce_sum(copied[3:])) == 253.0
    # the collectives leave their inputs alone; packed results at aligned offsets, usable by TF's kernels
    before = x.numpy()
    xs = [data(r, (1000,), seed=14) for r in range(N)]
    ys = [data(r, (3, 7), seed=15) for r in range(N)]
    y = tf.constant(ys[R])
    close(hvd.allreduce(x, op=hvd.Sum), np.stack(xs).sum(0))
    a, b = hvd.grouped_allreduce([y, x, y[1:]], op=hvd.Sum)[:2]
    close(tf.reduce_sum(a, axis=1), np.stack(ys).sum(0).sum(1), 1e-4)
    close(b * 2.0, 2 * np.stack(xs).sum(0))
    close(hvd.broadcast(x, root_rank=0), xs[0])
    np.testing.assert_array_equal(x.numpy(), before)


@check("collectives_tf_function")
def _graph() -> None:
    all_collectives(lambda fn: tf.function(fn)(), seed=2)


@check("collectives_tf1_graph_session")
def _tf1() -> None:
    xs = [data(r, (4, 3), seed=3) for r in range(N)]
    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        # built in one order, requested in one run: paired by their build-time names
        outs = [hvd.allreduce(x * float(i + 1), op=hvd.Sum) for i in range(6)]
        gathered = hvd.allgather(x)
        v = tf.compat.v1.Variable(np.full(3, float(R), np.float32))
        bcast = hvd.broadcast_global_variables(0)
        rank_t, size_t = hvd.rank_op(), hvd.size_op()
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            res = sess.run(outs + [gathered, rank_t, size_t], feed_dict={x: xs[R]})
            sess.run(bcast, feed_dict={x: xs[R]})  # the collectives built before it run again first
            close(sess.run(v), np.zeros(3, np.float32))
    for i in range(6):
        close(res[i], np.stack(xs).sum(0) * (i + 1))
    close(res[6], np.concatenate(xs))
    assert (res[7], res[8]) == (R, N)


@check("tf1_graph_built_before_init")
def _tf1_before_init() -> None:
    """As in Horovod, a TF1 graph's collectives may be built before ``init()``: they check when they run."""
    xs = [data(r, (3,), seed=4) for r in range(N)]
    hvd.shutdown()
    try:
        assert not hvd.is_initialized()
        with tf.Graph().as_default() as early:
            red = hvd.allreduce(tf.constant(xs[R]), op=hvd.Sum)
        with tf.Graph().as_default() as g:
            v = tf.compat.v1.Variable(np.full(3, float(R), np.float32))
            bcast = hvd.broadcast_global_variables(0)  # Horovod's test_horovod_broadcast_graph_mode
            total = hvd.allreduce(tf.constant(xs[R]), op=hvd.Sum)
            rank_t = hvd.rank_op()
        with tf.compat.v1.Session(graph=early) as sess:
            try:
                sess.run(red)
                raise AssertionError("a collective ran without init()")
            except tf.errors.FailedPreconditionError as e:
                assert "initialized" in str(e) and "allreduce" in str(e), str(e)
    finally:
        hvd.init()
    with tf.compat.v1.Session(graph=g) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        got = sess.run([bcast, total, rank_t])
        close(sess.run(v), np.zeros(3, np.float32))  # read after the run that assigned it
    close(got[1], np.stack(xs).sum(0))
    assert got[2] == R


@check("indexed_slices_allreduce")
def _sparse() -> None:
    vals = [data(r, (2, 3), seed=5) for r in range(N)]
    sl = tf.IndexedSlices(tf.constant(vals[R]), tf.constant([R, R + 1]), tf.constant([N + 1, 3]))
    for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / N)):
        out = hvd.allreduce(sl, op=op)
        dense = tf.math.unsorted_segment_sum(out.values, out.indices, N + 1).numpy()
        ref = np.zeros((N + 1, 3))
        for r in range(N):
            ref[r:r + 2] += vals[r]
        close(dense, ref * scale)
    for bad in (lambda: hvd.allreduce(sl, op=hvd.Max), lambda: hvd.allreduce(sl, op=hvd.Sum, prescale_factor=2.0),
                lambda: hvd.allreduce(sl, op=hvd.Adasum), lambda: hvd.reducescatter(tf.ones([4]), op=hvd.Adasum)):
        try:
            bad()
        except NotImplementedError:
            pass
        else:
            raise AssertionError("no NotImplementedError")


def grad_of(fn: object, x: tf.Tensor, graph: bool) -> np.ndarray:
    def g() -> tf.Tensor:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return tape.gradient(y, x)
    return (tf.function(g)() if graph else g()).numpy()


def gradient_cases(graph: bool) -> None:
    """loss = sum(collective(x) * w_R), with every rank's weights w known to every rank."""
    w = [data(r, (6, 2), seed=6) for r in range(N)]
    x = tf.constant(data(R, (6, 2), seed=7))
    wr = tf.constant(w[R])
    ws = np.stack(w)
    # allreduce Sum: d/dx sum_r <allreduce(x), w_r> on rank R = sum over ranks of w (the gradient's allreduce)
    close(grad_of(lambda t: tf.reduce_sum(hvd.allreduce(t, op=hvd.Sum) * wr), x, graph), ws.sum(0))
    close(grad_of(lambda t: tf.reduce_sum(hvd.allreduce(t) * wr), x, graph), ws.mean(0))
    # allgather: rank R's rows of the average of the gathered gradients
    wg = [data(r, (6 * N, 2), seed=8) for r in range(N)]
    close(grad_of(lambda t: tf.reduce_sum(hvd.allgather(t) * wg[R]), x, graph),
          np.stack(wg).mean(0)[6 * R:6 * R + 6])
    # broadcast from rank 0: the average on the root, zeros elsewhere
    close(grad_of(lambda t: tf.reduce_sum(hvd.broadcast(t, 0) * wr), x, graph),
          ws.mean(0) if R == 0 else np.zeros((6, 2)))
    # alltoall (even split): the gradient comes back by the reverse alltoall
    wa = [data(r, (6, 2), seed=9) for r in range(N)]
    k = 6 // N
    expect = np.concatenate([wa[j][k * R:k * R + k] for j in range(N)])
    close(grad_of(lambda t: tf.reduce_sum(hvd.alltoall(t) * wa[R]), x, graph), expect)
    # reducescatter Sum: allgather of the gradient times size
    wrs = [data(r, (6 // N, 2), seed=10) for r in range(N)]
    close(grad_of(lambda t: tf.reduce_sum(hvd.reducescatter(t, op=hvd.Sum) * wrs[R]), x, graph),
          np.concatenate(wrs) * N)
    # DistributedGradientTape(op=Adasum): each variable's gradient is the Adasum of the ranks' own gradients
    v1, v2 = tf.Variable(data(R, (4, 3), seed=11)), tf.Variable(data(R, (3,), seed=12))
    local = [data(r, (4,), seed=13) for r in range(N)]

    def loss_and_grads(distributed: bool) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(tf.linalg.matvec(v1, v2) * local[R]) + v1[:, 0] ** 2)
        if distributed:
            tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
        return tape.gradient(loss, [v1, v2])

    step = tf.function(loss_and_grads) if graph else loss_and_grads
    own = [g.numpy() for g in step(False)]
    everyone = hvd.allgather_object(own)
    for got, i in zip(step(True), range(2), strict=True):
        close(got, adasum_tree([everyone[r][i] for r in range(N)]))



@check("gradients_eager_and_tf_function")
def _gradients() -> None:
    for graph in (False, True):
        gradient_cases(graph)

def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    return model


def train(distributed: bool, graph: bool, steps: int = 5) -> list[np.ndarray]:
    """SGD on a small MLP: each rank on its half of each batch (distributed), or one process on whole batches."""
    model = make_model(11 + (R if distributed else 0))  # different starting weights per rank: the broadcast fixes
    opt = keras.optimizers.SGD(0.1)
    if distributed:
        hvd.broadcast_variables(model.variables, root_rank=0)

    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    run = tf.function(step) if graph else step
    for s in range(steps):
        xb = np.concatenate([data(r, (4, 5), seed=20 + s) for r in range(N)])
        yb = np.concatenate([data(r, (4, 1), seed=40 + s) for r in range(N)])
        if distributed:
            xb, yb = xb[4 * R:4 * R + 4], yb[4 * R:4 * R + 4]
        run(tf.constant(xb), tf.constant(yb))
    return [v.numpy() for v in model.trainable_variables]


@check("training_tape_matches_single_process_eager")
def _train_eager() -> None:
    for a, b in zip(train(True, False), train(False, False), strict=True):
        close(a, b, 1e-5)


@check("training_tape_matches_single_process_tf_function")
def _train_graph() -> None:
    for a, b in zip(train(True, True), train(False, True), strict=True):
        close(a, b, 1e-5)


@check("distributed_optimizer_keras_in_tf_loop")
def _optimizer() -> None:
    def run(distributed: bool) -> list[np.ndarray]:
        model = make_model(13)
        opt = keras.optimizers.SGD(0.05)
        if distributed:
            opt = hvd.DistributedOptimizer(opt)

        @tf.function
        def step(x: tf.Tensor, y: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        for s in range(3):
            xb = np.concatenate([data(r, (3, 5), seed=60 + s) for r in range(N)])
            yb = np.concatenate([data(r, (3, 1), seed=70 + s) for r in range(N)])
            if distributed:
                xb, yb = xb[3 * R:3 * R + 3], yb[3 * R:3 * R + 3]
            step(tf.constant(xb), tf.constant(yb))
        return [v.numpy() for v in model.trainable_variables]
    for a, b in zip(run(True), run(False), strict=True):
        close(a, b, 1e-5)


@check("partial_tape_local_layers")
def _partial() -> None:
    model = make_model(15 + R)  # different weights per rank: reduced gradients differ from local ones
    x = tf.constant(data(R, (4, 5), seed=80))
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(model(x))
    local = tape.gradient(loss, model.trainable_variables)
    ptape = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
    grads = ptape.gradient(loss, model.trainable_variables)
    mine, shared = ptape.get_local_and_global_gradients(loss, model.trainable_variables)
    every = hvd.allgather_object([g.numpy() for g in local])
    for i, g in enumerate(grads):
        if i < 2:  # the first layer's kernel and bias: local, divided by size
            close(g, local[i].numpy() / N)
        else:
            close(g, np.mean([e[i] for e in every], axis=0))
    assert len(mine) == 2 and len(shared) == 2


@check("sync_batch_norm_matches_whole_batch")
def _sync_bn() -> None:
    xs = [data(r, (3, 4), seed=90) * (r + 1) for r in range(N)]
    whole = np.concatenate(xs)
    bn = keras.layers.BatchNormalization(axis=1)
    sbn = hvd.SyncBatchNormalization(axis=1)
    ref = bn(tf.constant(whole), training=True).numpy()
    out = sbn(tf.constant(xs[R]), training=True).numpy()
    close(out, ref[3 * R:3 * R + 3], 1e-4)
    close(sbn.moving_mean.numpy(), bn.moving_mean.numpy(), 1e-5)
    close(sbn.moving_variance.numpy(), bn.moving_variance.numpy(), 1e-5)


@check("objects_join_barrier_ops_process_set")
def _misc() -> None:
    assert hvd.broadcast_object({"r": R}, root_rank=1) == {"r": 1}
    assert hvd.allgather_object(R * 10) == [r * 10 for r in range(N)]
    assert int(hvd.rank_op()) == R and int(hvd.size_op()) == N
    assert int(hvd.local_rank_op()) == hvd.local_rank() and int(hvd.local_size_op()) == hvd.local_size()
    # join: rank 0 has one batch more; the other ranks' allreduce adds zeros for the joined rank
    if R == 0:
        # named: the unnamed ops' counters would differ between the ranks afterwards
        close(hvd.allreduce(tf.ones(3), op=hvd.Sum, name="extra_batch"), np.full(3, 1.0, np.float32))
    last = hvd.join()
    assert last == 0, last
    try:
        hvd.broadcast_global_variables(0)
    except RuntimeError as e:
        assert "broadcast_variables" in str(e)
    else:
        raise AssertionError("broadcast_global_variables is eager-only an error")
    v = tf.Variable(np.full(4, float(R), np.float32))
    hvd.broadcast_(v, root_rank=1)
    close(v.numpy(), np.ones(4))
    ps = hvd.add_process_set([1])
    try:
        if R == 1:
            close(hvd.allreduce(tf.constant([2.0, 4.0]), process_set=ps), np.array([2.0, 4.0]))
        else:
            try:
                hvd.allreduce(tf.ones(2), process_set=ps)
            except ValueError as e:
                assert "not a member" in str(e), str(e)
            else:
                raise AssertionError("a non-member's collective did not raise")
    finally:
        hvd.remove_process_set(ps)


@check("mismatch_raises_failed_precondition")
def _mismatch() -> None:
    """Horovod's class, eagerly, in tf.function and in a TF1 session (where TensorFlow would say UnknownError)."""

    def expect(run, what: str) -> None:
        try:
            run()
        except tf.errors.FailedPreconditionError as e:
            assert "shape" in str(e).lower() and "allreduce" in str(e).lower(), f"{what}: {e}"
        else:
            raise AssertionError(f"{what}: no error for different shapes")
        close(hvd.allreduce(tf.ones(2), op=hvd.Sum), np.full(2, float(N)))  # and the engine still works

    expect(lambda: hvd.allreduce(tf.ones([3 + R])), "eager")
    expect(lambda: tf.function(lambda x: hvd.allreduce(x, name="mm_fn") * 2.0)(tf.ones([3 + R])), "tf.function")

    def tf1() -> None:
        with tf.Graph().as_default():
            out = hvd.allreduce(tf.ones([3 + R]), name="mm_tf1") + 1.0
            with tf.compat.v1.Session() as session:
                session.run(out)

    expect(tf1, "TF1 session")


@check("elastic_tensorflow_state")
def _elastic() -> None:
    v = tf.Variable(np.full(2, float(R + 1), np.float32))
    state = hvd.elastic.TensorFlowState([v], epoch=R)
    state.sync()
    close(v.numpy(), np.ones(2))
    assert state.epoch == 0
    v.assign([5.0, 5.0])
    state.restore()
    close(v.numpy(), np.ones(2))
    v.assign([7.0, 7.0])
    state.commit()
    v.assign([0.0, 0.0])
    state.restore()
    close(v.numpy(), np.full(2, 7.0))
    model = make_model(17 + R)
    kstate = hvd.elastic.TensorFlowKerasState(model, keras.optimizers.SGD(0.1), batch=3)
    kstate.sync()
    ref = hvd.broadcast_object([w.numpy() for w in model.variables], root_rank=0)
    for w, r in zip(model.variables, ref, strict=True):
        close(w.numpy(), r)


@check("device_path_dlpack_gloo_stand_in")
def _device_path() -> None:
    """SPARK_HVD_DEVICE_BACKEND=gloo: TF tensors go by DLPack to the device group (gloo standing in for NCCL),
    the path a GPU tensor takes, without a copy through numpy."""
    from spark_hvd.core import get_engine
    from spark_hvd.tensorflow import device

    hvd.shutdown()
    os.environ["SPARK_HVD_DEVICE_BACKEND"] = "gloo"
    try:
        hvd.init()
        xs = [data(r, (6, 3), seed=30) for r in range(N)]
        x = tf.constant(xs[R])
        assert device.on_device_path([x])
        # DLPack both ways shares memory: torch sees TF's own buffer (a copy would have a new address each time),
        # and TF sees torch's (a change through torch shows in the TF tensor)
        assert device.to_torch(x).data_ptr() == device.to_torch(x).data_ptr()
        w = device.to_torch(x).clone()
        back = device.to_tf(w)
        w.add_(1.0)
        close(back, xs[R] + 1.0)
        before = get_engine().stats["device_collectives"]
        close(hvd.allreduce(x, op=hvd.Sum), np.stack(xs).sum(0))
        close(hvd.allreduce(x), np.stack(xs).mean(0))
        a, b = hvd.grouped_allreduce([x, x * 3.0], op=hvd.Sum)
        close(a, np.stack(xs).sum(0))
        close(b, 3 * np.stack(xs).sum(0))
        close(hvd.allgather(tf.constant(xs[R][:R + 1])), np.concatenate([xs[r][:r + 1] for r in range(N)]))
        close(hvd.broadcast(x, root_rank=1), xs[1])
        close(x, xs[R])  # the input is untouched (the collective worked on a copy on the device)
        close(grad_of(lambda t: tf.reduce_sum(hvd.allreduce(t, op=hvd.Sum) * float(R + 1)), x, False),
              np.full((6, 3), sum(r + 1 for r in range(N)), np.float32))
        assert get_engine().stats["device_collectives"] - before >= 6, get_engine().stats
    finally:
        hvd.shutdown()
        del os.environ["SPARK_HVD_DEVICE_BACKEND"]
        hvd.init()


with open(os.path.join(OUT_DIR, f"tf-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
