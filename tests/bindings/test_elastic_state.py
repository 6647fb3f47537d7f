"""Elastic state in one process: TorchState / ObjectState / KerasState / TensorFlowState commit-restore round
trips (bit-exact), the snapshot the driver keeps, ElasticSampler's re-partition over 3 -> 2 -> 3 ranks, the size
cap, and ``hvd.elastic.run``'s reset loop. The multi-rank path on Spark is tests/runner/test_elastic_spark.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest

from spark_hvd.core import elastic, state_stream
from spark_hvd.core.errors import SparkHvdError

torch = pytest.importorskip("torch")


def _model_and_optimizer(seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, optimizer, scale: float = 1.0) -> None:
    x = torch.linspace(-1, 1, 40).reshape(8, 5)
    optimizer.zero_grad()
    (model(x).pow(2).sum() * scale).backward()
    optimizer.step()


def _flat(model, optimizer) -> list:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for per_param in optimizer.state_dict()["state"].values():
        out += [v.clone() if torch.is_tensor(v) else torch.tensor(v) for v in per_param.values()]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_torch_state_restores_model_and_optimizer_bit_exact_after_a_bad_step():
    from spark_hvd.torch.elastic import TorchState

    model, optimizer = _model_and_optimizer()
    state = TorchState(model, optimizer, epoch=0, history=[1.0])
    _step(model, optimizer)
    state.epoch, state.history = 1, state.history + [0.5]
    state.commit()
    committed = _flat(model, optimizer)
    _step(model, optimizer, scale=1e6)  # a bad step: weights, moments, running stats and step count all move
    state.epoch = 99
    state.history.append(float("nan"))
    assert not _same(_flat(model, optimizer), committed)
    state.restore()
    assert _same(_flat(model, optimizer), committed)
    assert state.epoch == 1 and state.history == [1.0, 0.5]
    # training goes on from the restored state exactly as from the committed one
    twin_model, twin_opt = _model_and_optimizer(seed=1)
    twin_model.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # load_state_dict may share the tensors
    _step(model, optimizer)
    _step(twin_model, twin_opt)
    assert _same(_flat(model, optimizer), _flat(twin_model, twin_opt))


def test_the_snapshot_the_driver_keeps_rebuilds_the_state_in_a_fresh_process():
    """What rank 0 streams (``snapshot()`` in parts) loads into a TorchState built from scratch, as a relaunched
    rank 0 does."""
    from spark_hvd.torch.elastic import TorchState

    model, optimizer = _model_and_optimizer()
    state = TorchState(model, optimizer, epoch=3)
    _step(model, optimizer)
    state.commit()
    parts = [bytearray(p) for p in state_stream.encode(state.snapshot())]
    fresh_model, fresh_opt = _model_and_optimizer(seed=7)
    fresh = TorchState(fresh_model, fresh_opt, epoch=0)
    fresh.load_snapshot(state_stream.decode(parts))
    fresh.restore()
    assert fresh.epoch == 3
    assert _same(_flat(fresh_model, fresh_opt), _flat(model, optimizer))
    other = TorchState(fresh_model, optimizer=None, epoch=0)
    with pytest.raises(KeyError, match="'optimizer'"):
        other.load_snapshot(state_stream.decode(parts))


def test_object_state_snapshots_objects_changed_in_place():
    state = elastic.ObjectState(counts=np.zeros(3), seen={1})
    state.counts += 1
    state.seen.add(2)
    state.commit()
    state.counts += 5
    state.seen.add(3)
    state.restore()
    np.testing.assert_array_equal(state.counts, np.ones(3))
    assert state.seen == {1, 2}


class _FakeCore(SimpleNamespace):
    """``size()`` / ``rank()`` of one simulated rank (the sampler asks the core for them)."""

    def is_initialized(self) -> bool:
        return True

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def _partition(monkeypatch, dataset, n: int, state: dict) -> list:
    samplers = []
    for r in range(n):
        monkeypatch.setattr(elastic, "_core", lambda r=r: _FakeCore(n=n, r=r))
        sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=5)
        sampler.load_state_dict(state)
        samplers.append(sampler)
    return samplers


def _process(samplers, batches: int, batch_size: int) -> dict:
    """Each rank records ``batches`` batches; the union of what they processed (what a commit gathers)."""
    done: set[int] = set()
    for sampler in samplers:
        for b in range(batches):
            sampler.record_batch(b, batch_size)
        done |= sampler.processed_indices
    return {"epoch": samplers[0].epoch, "processed_indices": done}


@pytest.mark.parametrize("sizes", [(3, 2, 3), (2, 3, 1)])
def test_elastic_sampler_repartitions_the_remaining_indices_exactly_once(monkeypatch, sizes):
    dataset = list(range(29))
    state: dict = {"epoch": 4, "processed_indices": set()}
    seen: list[int] = []
    for n in sizes:
        samplers = _partition(monkeypatch, dataset, n, state)
        remaining = set(dataset) - state["processed_indices"]
        shares = [s.get_indices(0, len(s), drop_padding=True) for s in samplers]
        flat = [i for share in shares for i in share]
        assert sorted(flat) == sorted(remaining), f"size {n}: the shares do not cover the remaining indices once"
        assert len({len(s) for s in samplers}) == 1 and all(len(list(s)) == len(s) for s in samplers)
        before = state["processed_indices"]
        state = _process(samplers, batches=2, batch_size=2)
        new = state["processed_indices"] - before
        assert not new & before
        seen += sorted(new)
    assert len(seen) == len(set(seen)), "an index was processed twice across the resets"
    # the rest of the epoch after the last reset, then a new epoch starts from every index again
    samplers = _partition(monkeypatch, dataset, 2, state)
    rest = {i for s in samplers for i in s.get_indices(0, len(s), drop_padding=True)}
    assert rest | state["processed_indices"] == set(dataset)
    samplers[0].set_epoch(5)
    assert not samplers[0].processed_indices and len(samplers[0]) == 15


class _MemoryLink:
    """A driver link in memory: the chunks of the pending upload, the parts of the last commit."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []
        self.data = b""
        self.sizes: list[int] | None = None
        self.chunks = 0

    def put(self, commit_id: str, seq: int, data: bytes) -> None:
        assert seq == len(self.pending) and len(data) <= 1 << 20
        self.pending.append(data)
        self.chunks += 1

    def commit(self, commit_id: str, sizes: list[int]) -> bool:
        self.data, self.sizes, self.pending = b"".join(self.pending), sizes, []
        assert sum(sizes) == len(self.data)
        return False

    def committed(self) -> list[int] | None:
        return self.sizes

    def get(self, offset: int, nbytes: int) -> bytes:
        return self.data[offset:offset + nbytes]


def test_a_large_state_streams_in_chunks_and_comes_back_bit_exact(monkeypatch):
    """Tensors and arrays leave the pickle stream as raw parts, sent in bounded chunks; every kind comes back
    equal (contiguous, strided, bfloat16, requiring grad, numpy, plain objects)."""
    monkeypatch.setattr(state_stream, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(elastic, "_core", lambda: SimpleNamespace(rank=lambda: 0, allreduce=lambda a, **_: a))
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(3 << 20, generator=gen)  # 12 MiB of float32
    value = {"big": big, "strided": torch.randn(64, 64, generator=gen).t(), "bf16": torch.randn(9).bfloat16(),
             "grad": torch.randn(4, requires_grad=True), "np": np.arange(100_000, dtype=np.int64),
             "plain": {"epoch": 3, "seen": {1, 2}}}
    link = _MemoryLink()
    elastic.set_link(link)
    try:
        state = elastic.ObjectState(**value)
        state.commit()
        assert link.chunks >= 12 and len(link.data) > 12 << 20  # 12 MiB went out in 1 MiB chunks
        back = elastic.download_state(link)["objects"]
    finally:
        elastic.set_link(None)
    assert back.keys() == value.keys() and back["plain"] == value["plain"]
    np.testing.assert_array_equal(back["np"], value["np"])
    for name in ("big", "strided", "bf16", "grad"):
        assert back[name].dtype == value[name].dtype and torch.equal(back[name].detach(), value[name].detach())
    assert back["grad"].requires_grad


def test_commit_over_a_set_size_cap_names_the_setting(monkeypatch):
    link = _MemoryLink()
    monkeypatch.setattr(elastic, "_core", lambda: SimpleNamespace(rank=lambda: 0, allreduce=lambda a, **_: a))
    monkeypatch.setenv(elastic.STATE_MAX_ENV, "1000")
    elastic.set_link(link)
    try:
        state = elastic.ObjectState(small=1, big=None)
        state.commit()
        assert elastic.download_state(link) == {"objects": {"small": 1, "big": None}}
        state.big = np.zeros(1000)
        with pytest.raises(elastic.StateTooLargeError, match="SPARK_HVD_ELASTIC_STATE_MAX=1000"):
            state.commit()
        assert elastic.download_state(link) == {"objects": {"small": 1, "big": None}}  # the last commit stays
    finally:
        elastic.set_link(None)


def test_run_resets_in_place_on_hosts_updated_outside_spark():
    """Without a driver link (not under run_elastic) a HostsUpdatedInterrupt resets in place, runs the reset
    callbacks and calls the function again; a collective failure restores the last commit and is raised."""
    state = elastic.ObjectState(step=0)
    state.sync = lambda: None  # one process, nothing to broadcast
    calls, resets, callbacks = [], [], []
    state.register_reset_callbacks([lambda: callbacks.append(state.step)])

    def train(state):
        calls.append(state.step)
        state.step += 1
        state.save()
        if len(calls) == 1:
            raise elastic.HostsUpdatedInterrupt()
        return state.step

    assert elastic.run_fn(train, reset=lambda: resets.append(1))(state) == 2
    assert calls == [0, 1] and resets == [1] and callbacks == [1]

    def fails(state):
        state.step = 100
        raise SparkHvdError("peer lost")

    with pytest.raises(SparkHvdError, match="peer lost"):
        elastic.run_fn(fails, reset=lambda: None)(state)
    assert state.step == 2


@pytest.mark.slow
def test_keras_state_restores_model_and_optimizer_variables_bit_exact():
    keras = pytest.importorskip("keras")
    from spark_hvd.keras.elastic import KerasState

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x, y = np.linspace(-1, 1, 48, dtype="float32").reshape(16, 3), np.ones((16, 1), "float32")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    state = KerasState(model, epoch=1)
    state.commit()
    committed = [np.array(v) for v in model.variables + model.optimizer.variables]
    model.fit(x * 1e3, y, epochs=2, batch_size=8, verbose=0)  # a bad stretch of training
    state.epoch = 7
    changed = [np.array(v) for v in model.variables + model.optimizer.variables]
    assert any(not np.array_equal(a, b) for a, b in zip(committed, changed, strict=True))
    state.restore()
    restored = [np.array(v) for v in model.variables + model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(committed, restored, strict=True)) and state.epoch == 1
    # the driver's copy (the snapshot streamed in parts) restores the same into another state object
    parts = [bytearray(p) for p in state_stream.encode(state.snapshot())]
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    other = KerasState(model, epoch=0)
    other.load_snapshot(state_stream.decode(parts))
    other.restore()
    again = [np.array(v) for v in model.variables + model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(committed, again, strict=True)) and other.epoch == 1


@pytest.mark.slow
def test_tensorflow_state_restores_its_variables_bit_exact_and_names_a_changed_count():
    tf = pytest.importorskip("tensorflow")
    from spark_hvd.tensorflow.elastic import TensorFlowState

    v, w = tf.Variable(np.linspace(-1, 1, 6, dtype="float32").reshape(2, 3)), tf.Variable(np.arange(4, dtype="int64"))
    state = TensorFlowState([v, w], epoch=2)
    state.commit()
    committed = [v.numpy().copy(), w.numpy().copy()]
    v.assign(v * 3.5)
    w.assign_add(tf.ones(4, "int64"))
    state.epoch = 9
    state.restore()
    assert np.array_equal(v.numpy(), committed[0]) and np.array_equal(w.numpy(), committed[1]) and state.epoch == 2
    state.variables.append(tf.Variable(1.0))  # the snapshot no longer matches the state's variables
    with pytest.raises(ValueError, match=r"TensorFlowState.restore: the snapshot has 2 variables, the state now has 3"):
        state.restore()


@pytest.mark.slow
def test_keras_state_callbacks_commit_and_count_epochs_and_batches():
    keras = pytest.importorskip("keras")
    from spark_hvd.keras import elastic as kel

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = np.linspace(-1, 1, 48, dtype="float32").reshape(16, 3), np.ones((16, 1), "float32")
    state = kel.KerasState(model, epoch=1, batch=0)
    seen_batches = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen_batches.append((state.epoch, state.batch))

    model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False,
              callbacks=[kel.UpdateBatchStateCallback(state), kel.UpdateEpochStateCallback(state),
                         kel.CommitStateCallback(state, batches_per_commit=3), Spy()])
    assert state.epoch == 3 and state.batch == 0  # 1 + 2 epochs done; batch back to 0 after an epoch
    assert seen_batches == [(1, 0), (1, 1), (2, 0), (2, 1)]
    final = [np.array(v) for v in model.variables]
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    state.restore()  # back to the commit at the end of the last epoch
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(final, model.variables, strict=True))
    assert state.epoch == 3
    with pytest.raises(ValueError, match="batches_per_commit must be >= 1"):
        kel.CommitStateCallback(state, batches_per_commit=0)
