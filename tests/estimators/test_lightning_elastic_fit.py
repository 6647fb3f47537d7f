"""``LightningEstimator(elastic=True, min_num_proc, max_num_proc, checkpoint_every_steps)``: a 2-rank fit whose rank 1
dies mid-epoch while its slot does not come back (a Spark job takes it) goes on with 1 rank from the last step
checkpoint, at the same fraction of the epoch; once the slot frees up, the fit stops at the next step checkpoint and
goes on with 2 ranks again from there. Rank 0's batch log has exactly those batches; with SGD and momentum under
``scale_lr_by_num_proc`` the per-epoch losses and the final weights equal a single-process replay of exactly the
batches committed, each at the rate of its number of ranks, the momentum carried over."""

from __future__ import annotations

import copy
import os
import sys
import time

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.estimators import die_once, linear_df
from helpers.slot_holder import fit_losing_a_slot
from helpers.torch_replay import rank_shards

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from helpers.lightning_modules import LR, Reg, numpy_mse  # noqa: E402

from spark_hvd.estimators import LightningEstimator  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

EVERY, KILL, BATCH = 3, (1, 4), 16  # step checkpoints every 3 steps; rank 1 dies after batch 4 of epoch 1
#: the seconds the one-rank fit waits for the driver to see the freed slot
SEE_FREE_S = 120.0


class _ElasticLog(pl.Callback):
    """Rank 0 logs ``epoch batch size`` of every batch; rank 1 dies once after batch ``KILL``; on one rank (the
    relaunch that lost the slot) the first batch frees the held slot (the ``release`` file) and waits until the
    driver sees it free, so the next step checkpoint grows the fit back to 2 ranks (no timing assumption)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        from spark_hvd.core.elastic import get_link

        if trainer.global_rank == 0:
            with open(os.path.join(self.directory, "batches.log"), "a") as f:
                f.write(f"{trainer.current_epoch} {batch_idx} {trainer.world_size}\n")
        die_once(self.directory, (trainer.current_epoch, batch_idx) == KILL and trainer.global_rank == 1)
        release = os.path.join(self.directory, "release")
        if trainer.world_size == 1 and not os.path.exists(release):
            open(release, "w").close()
            deadline = time.monotonic() + SEE_FREE_S
            while not get_link().hosts_updated():
                assert time.monotonic() < deadline, f"the driver did not see the freed slot in {SEE_FREE_S:g} s"
                time.sleep(0.2)


@pytest.fixture(scope="module")
def df(spark):
    return linear_df(spark)


@pytest.mark.timeout(900)
def test_a_lightning_fit_shrinks_and_grows_at_step_checkpoints(spark, df, tmp_path, monkeypatch):
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = Reg()
    initial = copy.deepcopy(net)
    est = LightningEstimator(num_proc=2, elastic=True, min_num_proc=1, max_num_proc=2, reset_limit=3, store=store,
                             model=net, feature_cols=["features"], label_cols=["y"], batch_size=BATCH, epochs=2,
                             random_seed=1, partitions_per_process=1, verbose=0, scale_lr_by_num_proc=True,
                             checkpoint_every_steps=EVERY, callbacks=[_ElasticLog(str(tmp_path))])
    fitted = fit_losing_a_slot(spark, monkeypatch, est, df, str(tmp_path), "spark_hvd-test-lightning-slot-holder")
    assert fitted.getHistory()["num_proc"] == [2.0, 2.0]

    shards = {n: rank_shards(store, fitted, seed=1, batch_size=BATCH, num_proc=n) for n in (1, 2)}
    assert (shards[2][0].steps("train"), shards[1][0].steps("train")) == (8, 16)
    # 2 ranks: epoch 0, then epoch 1's batches 0-3 (step checkpoint after global batch 12) and 4 (lost with rank 1);
    # 1 rank from 4/8 of epoch 1 = batch 8 of 16, up to the step checkpoint after global batch 27 (batch 10), where
    # the freed slot is seen; 2 ranks again from 11/16 of the epoch = batch round(5.5) = 6 of 8
    committed = ([(0, s, 2) for s in range(8)] + [(1, s, 2) for s in range(4)] + [(1, s, 1) for s in (8, 9, 10)]
                 + [(1, s, 2) for s in (6, 7)])
    logged = [tuple(map(int, line.split())) for line in (tmp_path / "batches.log").read_text().splitlines()]
    assert logged == committed[:12] + [(1, 4, 2)] + committed[12:], logged

    batches = {(n, e): list(zip(*(s.epoch("train", e) for s in shards[n]), strict=True)) for n in (1, 2)
               for e in range(2)}
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sums, rows = [0.0, 0.0], [0, 0]
    for epoch, step, size in committed:  # data-parallel SGD on each step's batches, at the size's rate
        opt.zero_grad()
        for batch in batches[(size, epoch)][step]:
            loss = numpy_mse(model, batch)
            loss.backward()
            sums[epoch] += float(loss.detach()) * len(batch["features"])
            rows[epoch] += len(batch["features"])
        for p in model.parameters():
            p.grad.div_(size)
        for group in opt.param_groups:
            group["lr"] = LR * size  # scale_lr_by_num_proc, rescaled at each relaunch
        opt.step()
    np.testing.assert_allclose(fitted.getHistory()["loss"], [sums[e] / rows[e] for e in range(2)], rtol=1e-4,
                               atol=1e-6)
    for got, want in zip(fitted.getModel().state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_ddp_errors_of_a_lost_peer_are_consequences_others_stay_as_they_are():
    from spark_hvd.core.errors import PeerFailureError
    from spark_hvd.estimators.lightning.rank import peer_failure
    from spark_hvd.runner.errors import CONSEQUENCE_TYPES

    gloo = RuntimeError("[/x/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:55952: "
                        "Connection reset by peer. This is typically caused by a remote worker hanging")
    lost = peer_failure(gloo, 0)
    assert isinstance(lost, PeerFailureError) and type(lost).__name__ in CONSEQUENCE_TYPES
    assert "rank 0" in str(lost) and "Connection reset by peer" in str(lost)
    assert isinstance(peer_failure(torch.distributed.DistNetworkError("the store went away"), 1), PeerFailureError)
    assert peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 0) is None
