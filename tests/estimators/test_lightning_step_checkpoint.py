"""LightningEstimator(checkpoint_every_steps=...): rank 1 dies mid-epoch and the retry (``max_retries=1``) resumes
from the last step checkpoint at the exact batch: rank 0's batch log has every batch, at most
``checkpoint_every_steps`` of them twice, the retry starting inside epoch 1; the random numbers a callback draws
(Python, numpy, torch) at a batch trained twice are the same both times on every rank; and the per-epoch losses and
final weights (SGD with momentum) equal a single-process replay of the same batches, as an uninterrupted fit's do
(``test_lightning_trainer.py``)."""

from __future__ import annotations

import copy
import json
import os
import random
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.estimators import die_once, linear_df
from helpers.torch_replay import rank_shards, replay

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from helpers.lightning_modules import LR, Reg, numpy_mse  # noqa: E402

from spark_hvd.estimators import LightningEstimator  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

EVERY, KILL, BATCH = 3, (1, 4), 16  # step checkpoints every 3 steps; rank 1 dies after batch 4 of epoch 1


class _BatchLog(pl.Callback):
    """Every rank draws from Python's, numpy's and torch's generators before each batch and appends
    ``[epoch, batch, draws...]`` to ``rank<r>.log`` after it; rank 1 dies once after batch ``KILL``."""

    def __init__(self, directory: str) -> None:
        self.directory, self.draws = directory, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.draws = [random.random(), float(np.random.rand()), float(torch.rand(()))]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.log"), "a") as f:
            f.write(json.dumps([trainer.current_epoch, batch_idx, *self.draws]) + "\n")
        die_once(self.directory, (trainer.current_epoch, batch_idx) == KILL and trainer.global_rank == 1)


@pytest.fixture(scope="module")
def df(spark):
    return linear_df(spark)


@pytest.mark.timeout(600)
def test_a_lightning_rank_killed_mid_epoch_resumes_at_the_exact_batch(spark, df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = Reg()
    initial = copy.deepcopy(net)
    est = LightningEstimator(num_proc=2, store=store, model=net, feature_cols=["features"], label_cols=["y"],
                             batch_size=BATCH, epochs=2, random_seed=1, partitions_per_process=1, verbose=0,
                             max_retries=1, checkpoint_every_steps=EVERY, callbacks=[_BatchLog(str(tmp_path))])
    fitted = est.fit(df)
    assert (tmp_path / "killed").exists()

    shards = rank_shards(store, fitted, seed=1, batch_size=BATCH)
    steps = shards[0].steps("train")
    assert steps > KILL[1] + 1
    every = [(e, s) for e in range(2) for s in range(steps)]
    for rank in (0, 1):
        lines = [json.loads(line) for line in (tmp_path / f"rank{rank}.log").read_text().splitlines()]
        logged = [tuple(line[:2]) for line in lines]
        assert sorted(set(logged)) == every, f"rank {rank}: a batch was never trained"
        repeated = len(logged) - len(every)
        assert 0 < repeated <= EVERY, f"rank {rank}: the retry repeated {repeated} batches (every {EVERY} steps)"
        restart = next(i for i in range(1, len(logged)) if logged[i] <= logged[i - 1])
        assert logged[restart][0] == 1 and logged[restart][1] > 0, "the retry did not resume inside epoch 1"
        first = {}
        for line in lines:  # a batch trained twice drew the same random numbers both times
            assert first.setdefault(tuple(line[:2]), line[2:]) == line[2:], f"rank {rank}, batch {line[:2]}"

    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = replay(shards, model, opt, numpy_mse, 2)
    np.testing.assert_allclose(fitted.getHistory()["loss"], losses, rtol=1e-4, atol=1e-6)
    for got, want in zip(fitted.getModel().state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
