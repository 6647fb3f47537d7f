"""``LightningEstimator(elastic=True, min_num_proc, max_num_proc)``, at epoch boundaries: a 2-rank fit whose rank 1
dies mid-epoch while its slot does not come back (a Spark job takes it) goes on with 1 rank from the last epoch
checkpoint (Lightning's own loop owns the state inside an epoch, so there are no step checkpoints). The history
records the ranks of each epoch; with SGD and momentum under ``scale_lr_by_num_proc`` the per-epoch losses and the
final weights equal a single-process replay: epoch 0 on both ranks' batches at twice the rate, epoch 1 again from
its start on the one rank's shard at the rate of one rank, the momentum carried over."""

from __future__ import annotations

import copy
import os
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.estimators import die_once, linear_df
from helpers.slot_holder import fit_losing_a_slot
from helpers.torch_replay import rank_shards, replay

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from helpers.lightning_modules import LR, Reg, numpy_mse  # noqa: E402

from spark_hvd.estimators import LightningEstimator  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

KILL, BATCH = (1, 4), 16  # rank 1 dies after batch 4 of epoch 1


class _DieOnce(pl.Callback):
    """Rank 1 dies (``os._exit``) once, after batch ``KILL``; rank 0 logs ``epoch size`` of every batch."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_rank == 0:
            with open(os.path.join(self.directory, "batches.log"), "a") as f:
                f.write(f"{trainer.current_epoch} {trainer.world_size}\n")
        die_once(self.directory, (trainer.current_epoch, batch_idx) == KILL and trainer.global_rank == 1)


@pytest.fixture(scope="module")
def df(spark):
    return linear_df(spark)


@pytest.mark.timeout(900)
def test_a_lightning_rank_lost_for_good_the_fit_goes_on_with_fewer_ranks_from_the_epoch(spark, df, tmp_path,
                                                                                       monkeypatch):
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = Reg()
    initial = copy.deepcopy(net)
    est = LightningEstimator(num_proc=2, elastic=True, min_num_proc=1, max_num_proc=2, reset_limit=2, store=store,
                             model=net, feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2,
                             random_seed=1, partitions_per_process=1, verbose=0, scale_lr_by_num_proc=True,
                             callbacks=[_DieOnce(str(tmp_path))])
    fitted = fit_losing_a_slot(spark, monkeypatch, est, df, str(tmp_path), "spark_hvd-test-lightning-slot-holder")
    history = fitted.getHistory()
    assert history["num_proc"] == [2.0, 1.0], history

    two = rank_shards(store, fitted, seed=1, batch_size=BATCH)
    one = rank_shards(store, fitted, seed=1, batch_size=BATCH, num_proc=1)
    assert (two[0].steps("train"), one[0].steps("train")) == (8, 16)
    logged = [tuple(map(int, line.split())) for line in (tmp_path / "batches.log").read_text().splitlines()]
    # epoch 1 ran from its start on the one rank: the relaunch resumed from the checkpoint of epoch 0
    assert logged.count((0, 2)) == 8 and logged.count((1, 2)) in (4, 5) and logged.count((1, 1)) == 16, logged

    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR * 2, momentum=0.9)  # scale_lr_by_num_proc on 2 ranks
    batch_loss = numpy_mse
    losses = replay(two, model, opt, batch_loss, 1)
    for group in opt.param_groups:  # the relaunch on 1 rank rescales the restored rate
        group["lr"] = LR
    total, rows = 0.0, 0
    for batch in one[0].epoch("train", 1):
        opt.zero_grad()
        loss = batch_loss(model, batch)
        loss.backward()
        opt.step()
        total, rows = total + float(loss.detach()) * len(batch["features"]), rows + len(batch["features"])
    losses.append(total / rows)
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-4, atol=1e-6)
    for got, want in zip(fitted.getModel().state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_ddp_errors_of_a_lost_peer_are_consequences_others_stay_as_they_are():
    from spark_hvd.core.errors import PeerFailureError
    from spark_hvd.estimators.lightning_rank import peer_failure
    from spark_hvd.runner.errors import CONSEQUENCE_TYPES

    gloo = RuntimeError("[/x/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55952: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    lost = peer_failure(gloo, 0)
    assert isinstance(lost, PeerFailureError) and type(lost).__name__ in CONSEQUENCE_TYPES
    assert "rank 0" in str(lost) and "Connection reset by peer" in str(lost)
    assert isinstance(peer_failure(torch.distributed.DistNetworkError("the store went away"), 1), PeerFailureError)
    assert peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 0) is None
