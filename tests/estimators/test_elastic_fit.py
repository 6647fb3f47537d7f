"""``TorchEstimator(elastic=True, min_num_proc, max_num_proc)``: a 2-rank fit whose rank 1 dies mid-epoch while its
executor's slot does not come back (a Spark job takes it) goes on with 1 rank from the last step checkpoint; the
history records the ranks of each epoch and the final weights and losses equal a one-process replay of the batches
the ranks trained on (2 ranks' shards up to the checkpoint, then 1 rank's from the same fraction of the epoch).
And the elastic params are checked on the driver before anything runs."""

from __future__ import annotations

import copy
import os
import sys
import time

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.estimators import assert_fit_fails_before_anything_runs, die_once, linear_df, tiny_df
from helpers.slot_holder import fit_losing_a_slot, hold_a_slot
from helpers.torch_replay import rank_shards

from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import Store

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

pytestmark = pytest.mark.spark

EVERY, KILL, BATCH, LR = 3, (1, 4), 16, 0.05  # step checkpoints every 3 steps; rank 1 dies after batch 4 of epoch 1


class _DieOnce:
    """Rank 1 dies (``os._exit``) once, after batch ``KILL`` (before that batch's step checkpoint could be due)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_batch_end(self, epoch: int, step: int, loss: float) -> None:
        import spark_hvd.torch as hvd

        die_once(self.directory, (epoch, step) == KILL and hvd.rank() == 1)


@pytest.fixture(scope="module")
def df(spark):
    return linear_df(spark)


def _mse_step(model, batches, opt) -> float:
    """One data-parallel step over ``batches`` (one per rank): mean gradient, SGD; returns the rows' loss sum."""
    opt.zero_grad()
    total = 0.0
    for batch in batches:
        out = model(torch.from_numpy(batch["features"]))
        loss = torch.nn.functional.mse_loss(out, torch.from_numpy(batch["y"]).float().reshape(out.shape))
        (loss / len(batches)).backward()
        total += float(loss.detach()) * len(batch["features"])
    opt.step()
    return total


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_lost_for_good_mid_epoch_the_fit_goes_on_with_fewer_ranks(spark, df, tmp_path, monkeypatch):
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    initial = copy.deepcopy(net)
    est = TorchEstimator(num_proc=2, elastic=True, min_num_proc=1, max_num_proc=2, reset_limit=2, store=store,
                         model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), loss="mse",
                         feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2, random_seed=1,
                         partitions_per_process=1, verbose=0, checkpoint_every_steps=EVERY, checkpoint_upload="sync",
                         callbacks=[_DieOnce(str(tmp_path))])
    fitted = fit_losing_a_slot(spark, monkeypatch, est, df, str(tmp_path), "spark_hvd-test-slot-holder")
    history = fitted.getHistory()
    assert history["num_proc"] == [2.0, 1.0], history  # epoch 1 ended on the one rank left

    # the replay: epoch 0 on 2 ranks; epoch 1's first 4 batches (the last step checkpoint, after global batch 12)
    # on 2 ranks, then 1 rank from the same fraction of its 16-batch epoch: batch 8 on
    two, one = rank_shards(store, fitted, seed=1, batch_size=BATCH), rank_shards(store, fitted, seed=1,
                                                                                  batch_size=BATCH, num_proc=1)
    steps2, steps1 = two[0].steps("train"), one[0].steps("train")
    assert (steps2, steps1) == (8, 16)
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for epoch in range(2):
        done2 = steps2 if epoch == 0 else 4
        batches2 = zip(*(s.epoch("train", epoch) for s in two), strict=True)
        total = sum(_mse_step(model, next(batches2), opt) for _ in range(done2))
        if epoch == 1:
            total += sum(_mse_step(model, [b], opt) for b in one[0].epoch("train", 1, skip=steps1 * 4 // steps2))
        losses.append(total / 256)
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(fitted.getModel().state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert history["loss"][1] < history["loss"][0]


class _GrowLog:
    """Rank 0 logs ``epoch step size`` of every batch; while the job has one rank, it frees the held slot (the
    ``release`` file) and trains slowly (0.3 s a batch), so that a later step checkpoint sees the slot free."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_batch_end(self, epoch: int, step: int, loss: float) -> None:
        import spark_hvd.torch as hvd

        if hvd.rank() == 0:
            with open(os.path.join(self.directory, "batches.log"), "a") as f:
                f.write(f"{epoch} {step} {hvd.size()}\n")
        if hvd.size() == 1:
            open(os.path.join(self.directory, "release"), "w").close()
            time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_fit_grows_at_a_step_checkpoint_when_a_slot_frees_up(spark, df, tmp_path):
    """The fit starts on the one free slot; once the other frees up, the ranks stop at the next step checkpoint and
    the fit goes on with 2 ranks from it. Losses and weights equal a replay of the batches rank 0 logged."""
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    initial = copy.deepcopy(net)
    blocker = hold_a_slot(spark, str(tmp_path), "spark_hvd-test-slot-holder-grow")
    est = TorchEstimator(num_proc=2, elastic=True, min_num_proc=1, max_num_proc=2, reset_limit=2, store=store,
                         model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), loss="mse",
                         feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2, random_seed=1,
                         partitions_per_process=1, verbose=0, checkpoint_every_steps=EVERY, checkpoint_upload="sync",
                         callbacks=[_GrowLog(str(tmp_path))])
    try:
        fitted = est.fit(df)
    finally:
        (tmp_path / "release").touch()
        blocker.join(60)
    logged = [tuple(map(int, line.split())) for line in (tmp_path / "batches.log").read_text().splitlines()]
    sizes = [size for _, _, size in logged]
    grew = sizes.index(2)
    assert sizes[0] == 1 and set(sizes[grew:]) == {2}, "the fit did not start on 1 rank and grow to 2"
    epoch, step, _ = logged[grew - 1]
    assert ((epoch * 16 + step + 1) % EVERY) == 0, "the growth was not at a step checkpoint"
    assert fitted.getHistory()["num_proc"][-1] == 2.0

    two, one = rank_shards(store, fitted, seed=1, batch_size=BATCH), rank_shards(store, fitted, seed=1,
                                                                                  batch_size=BATCH, num_proc=1)
    batches = {(n, e): list(zip(*(s.epoch("train", e) for s in shards), strict=True))
               for n, shards in ((1, one), (2, two)) for e in range(2)}
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sums, rows = [0.0, 0.0], [0, 0]
    for e, s, size in logged:
        step_batches = list(batches[(size, e)][s])
        sums[e] += _mse_step(model, step_batches, opt)
        rows[e] += sum(len(b["features"]) for b in step_batches)
    np.testing.assert_allclose(fitted.getHistory()["loss"], [sums[e] / rows[e] for e in range(2)], rtol=1e-5,
                               atol=1e-6)
    for got, want in zip(fitted.getModel().state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    resumed = logged[grew][1]
    assert resumed == min(8, round((step + 1) * 8 / 16)) or (step + 1 == 16 and logged[grew][:2] == (epoch + 1, 0))


def _kwargs(store, **kw):
    torch.manual_seed(0)
    net = torch.nn.Linear(2, 1)
    args = dict(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss="mse",
                feature_cols=["features"], label_cols=["label"], batch_size=4, epochs=1, verbose=0)
    args.update(kw)
    return args


CASES = [
    ("min above max", dict(elastic=True, min_num_proc=2, max_num_proc=1, num_proc=1),
     r"TorchEstimator: min_num_proc=2 is above max_num_proc=1"),
    ("min below 1", dict(elastic=True, min_num_proc=0), r"min_num_proc must be a positive integer, got 0"),
    ("num_proc outside", dict(elastic=True, min_num_proc=1, max_num_proc=2, num_proc=3),
     r"num_proc=3 \(the first launch's ranks\) is outside min_num_proc=1 \.\. max_num_proc=2"),
    ("min without elastic", dict(min_num_proc=1), r"min_num_proc=1 is set but elastic is False"),
    ("max_retries with elastic", dict(elastic=True, max_retries=2),
     r"max_retries=2 does not go with elastic=True.*reset_limit"),
    ("negative reset_limit", dict(elastic=True, reset_limit=-1), r"reset_limit must be >= 0"),
    ("more than the cluster", dict(elastic=True, min_num_proc=3, max_num_proc=3, num_proc=3),
     r"min_num_proc=3 processes were requested but the cluster has only 2"),
]


@pytest.fixture(scope="module")
def small_df(spark):
    return tiny_df(spark)


@pytest.mark.parametrize("what,kwargs,match", CASES, ids=[c[0] for c in CASES])
def test_bad_elastic_params_fail_before_anything_runs(spark, small_df, tmp_path, what, kwargs, match):
    root = tmp_path / "store"
    est = TorchEstimator(**_kwargs(Store.create(str(root)), **kwargs))
    exc = ValueError if what != "more than the cluster" else Exception
    assert_fit_fails_before_anything_runs(spark, est, small_df, root, what, exc, match)
