"""One rank of the sharded-update checks of ``DistributedTrainer`` (``spark_hvd/mxnet/zero.py``); run as
``spark-hvd-run -np 2 python mxnet_zero_worker.py OUT_DIR``. Results go to ``OUT_DIR/mxnet-rank<r>.json``.

The model's 147 parameters split 74 / 73, so the shard boundary falls inside the first weight; every check
compares the weights after each step with one process training a plain Gluon ``Trainer`` on the combined batches."""

from __future__ import annotations

import os

# isort: split
from mxnet_job import BATCH, LOSS, OUT_DIR, N, R, batches, check, finish, hvd  # first: MXNet's warnings off
from mxnet_job import train as job_train

# isort: split
import mxnet as mx
import numpy as np

import spark_hvd.core as core


def mlp() -> mx.gluon.nn.HybridSequential:
    """Dense(5 -> 16) and Dense(16 -> 3): 80 + 16 + 48 + 3 = 147 parameters; per-parameter multipliers differ."""
    mx.random.seed(7)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(16, activation="relu", in_units=5), mx.gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier())
    net[0].weight.lr_mult = 0.5
    net[0].bias.wd_mult = 0.0
    net[1].weight.wd_mult = 2.0
    return net


def options(opt: str) -> dict:
    """A fresh set of optimizer parameters (a scheduler is stateful): weight decay, clipping, a scheduler."""
    sched = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.1 if opt == "sgd" else 0.01)
    base = {"sgd": {"learning_rate": 0.1, "momentum": 0.9}, "adam": {"learning_rate": 0.01}}[opt]
    return {**base, "wd": 1e-2, "clip_gradient": 0.05, "lr_scheduler": sched}


def weights(net: mx.gluon.Block) -> list[np.ndarray]:
    return [p.data().asnumpy() for p in net.collect_params().values()]


def train(net: mx.gluon.Block, trainer: mx.gluon.Trainer, shards: list[int], steps: range) -> list[list[np.ndarray]]:
    return job_train(net, trainer, shards, steps, weights)


def single(opt: str, steps: range, states: str | None = None, save: str | None = None) -> list[list[np.ndarray]]:
    """One process on every rank's batches; ``states``: loaded first; ``save``: written after."""
    net = mlp()
    trainer = mx.gluon.Trainer(net.collect_params(), opt, options(opt), kvstore=None)
    history = []
    if states is not None:
        train(net, trainer, list(range(N)), range(steps.start))  # the weights the states go with
        trainer.load_states(states)
    history = train(net, trainer, list(range(N)), steps)
    if save is not None:
        trainer.save_states(save)
    return history


def same(got: list[list[np.ndarray]], want: list[list[np.ndarray]], tol: float = 1e-5) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=f"step {step}, parameter {i}")


class Spy:
    """Counts the core's allreduces, reducescatters and allgathers while in a ``with``."""

    def __enter__(self) -> Spy:
        self.calls: list[str] = []
        self.real = {k: getattr(core, k) for k in ("allreduce", "reducescatter", "allgather")}
        for k, fn in self.real.items():
            setattr(core, k, lambda *a, _k=k, _fn=fn, **kw: (self.calls.append(_k), _fn(*a, **kw))[1])
        return self

    def __exit__(self, *exc: object) -> None:
        for k, fn in self.real.items():
            setattr(core, k, fn)


@check("sharded_matches_single_process_sgd_adam_mults_clip_scheduler")
def _matches() -> None:
    for opt in ("sgd", "adam"):
        want = single(opt, range(5))
        for mode in (True, False):
            net = mlp()
            trainer = hvd.DistributedTrainer(net.collect_params(), opt, options(opt), sharded_update=mode,
                                             prefix=f"{opt}.{mode}.")
            with Spy() as spy:
                same(train(net, trainer, [R], range(5)), want)
            if mode:
                assert trainer._zero is not None, f"not sharded: {trainer._unsharded_why}"
                assert spy.calls == ["reducescatter", "allgather"] * 5, spy.calls
                assert sum(s.stop - s.start for s in trainer._zero.segments) == (74, 73)[R]
            else:
                assert trainer._zero is None and spy.calls == ["allreduce"] * 5, spy.calls
        # every rank holds the same bits
        gathered = hvd.allgather(mx.nd.array(np.concatenate([w.ravel() for w in weights(net)])[None])).asnumpy()
        np.testing.assert_array_equal(gathered[0], gathered[-1])


@check("save_and_load_states_in_gluon_format")
def _states() -> None:
    for opt in ("sgd", "adam"):
        want = single(opt, range(5))
        # sharded for 3 steps, saved (every rank), then a plain Trainer in one process goes on from the file
        net = mlp()
        trainer = hvd.DistributedTrainer(net.collect_params(), opt, options(opt), prefix=f"save.{opt}.",
                                         sharded_update=True)
        train(net, trainer, [R], range(3))
        path = os.path.join(OUT_DIR, f"{opt}-rank{R}.states")
        trainer.save_states(path)
        same(single(opt, range(3, 5), states=path), want[3:])
        # a plain Trainer's file loaded into a sharded trainer after 3 steps
        plain = os.path.join(OUT_DIR, f"{opt}-plain-rank{R}.states")
        single(opt, range(3), save=plain)
        net = mlp()
        trainer = hvd.DistributedTrainer(net.collect_params(), opt, options(opt), prefix=f"load.{opt}.",
                                         sharded_update=True)
        train(net, trainer, [R], range(3))
        trainer.load_states(plain)
        same(train(net, trainer, [R], range(3, 5)), want[3:])
        assert trainer._zero is not None


@check("falls_back_where_not_exact")
def _fallback() -> None:
    params = {"learning_rate": 0.01}
    net = mlp()
    want = train(net, mx.gluon.Trainer(net.collect_params(), "rmsprop", dict(params), kvstore=None),
                 list(range(N)), range(3))
    net = mlp()
    trainer = hvd.DistributedTrainer(net.collect_params(), "rmsprop", dict(params), prefix="rms.",
                                     sharded_update=True)
    same(train(net, trainer, [R], range(3)), want)
    assert trainer._zero is None and "RMSProp" in trainer._unsharded_why, trainer._unsharded_why
    # allreduce_grads() + update() apart: leave the sharded update, with the whole states
    want = single("sgd", range(5))
    net = mlp()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", options("sgd"), prefix="apart.",
                                     sharded_update=True)
    got = train(net, trainer, [R], range(3))
    assert trainer._zero is not None
    for step in range(3, 5):
        x, y = (mx.nd.array(a) for a in batches(R, step))
        with mx.autograd.record():
            LOSS(net(x), y).backward()
        trainer.allreduce_grads()
        trainer.update(BATCH)
        got.append(weights(net))
    same(got, want)
    assert trainer._zero is None


@check("stale_gradients_as_gluon")
def _stale() -> None:
    net = mlp()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", options("sgd"), prefix="stale.",
                                     sharded_update=True)
    train(net, trainer, [R], range(1))
    try:
        trainer.step(BATCH)  # no backward since the last step
    except UserWarning as e:
        assert "has not been updated by backward" in str(e), str(e)
    else:
        raise AssertionError("a step without backward did not raise")
    before = weights(net)
    trainer.step(BATCH, ignore_stale_grad=True)  # nothing fresh: nothing moves
    for a, b in zip(weights(net), before, strict=True):
        np.testing.assert_array_equal(a, b)


finish()
