"""Checkpoints inside an epoch (``checkpoint_every_steps``): when they are due, the random state they carry, their
place in the store, and a TorchEstimator fit whose rank 1 dies mid-epoch: the retry resumes at the exact batch
(it repeats at most ``checkpoint_every_steps`` batches, counted from every batch the ranks logged) and the final
weights and per-epoch losses equal a single-process replay of the same batches."""

from __future__ import annotations

import copy
import os
import random
import sys
from types import SimpleNamespace

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.torch_replay import rank_shards, replay

from spark_hvd.estimators.common.step_checkpoint import (
    StepState,
    StepTrigger,
    latest_step_checkpoint,
    rng_state,
    set_rng_state,
    write_step_checkpoint,
)
from spark_hvd.store import Store
from spark_hvd.store.run_dir import RunDir

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module


@pytest.mark.compat
def test_the_trigger_counts_optimizer_steps_over_the_run():
    hvd = SimpleNamespace(broadcast_object=lambda value, root_rank: value)
    every3 = StepTrigger(3, None)
    assert [g for g in range(1, 13) if every3.due(g, hvd)] == [3, 6, 9, 12]
    accumulating = StepTrigger(2, None, backward_passes=2)  # only where no gradient is half accumulated
    assert [g for g in range(1, 13) if accumulating.due(g, hvd)] == [4, 8, 12]
    assert not StepTrigger(None, None).enabled
    timed = StepTrigger(None, 1e-9)  # due at every step
    assert timed.enabled and timed.due(1, hvd)


@pytest.mark.compat
def test_random_state_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = rng_state()
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


@pytest.mark.compat
def test_the_newest_step_checkpoint_after_a_point_is_found_and_older_ones_deleted(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    for epoch, step in ((0, 3), (1, 2), (1, 5)):
        local = tmp_path / f"snap-{epoch}-{step}"
        local.mkdir()
        (local / "model.bin").write_bytes(bytes([epoch, step]))
        state = StepState(epoch, step, {"loss": [1.0] * epoch}, [{"rows": step}], [rng_state()])
        write_step_checkpoint(store, "r", str(local), state)
    root = RunDir(store, "r").checkpoints_path
    assert store.listdir(root) == ["step-1-5"]  # each newer one replaced the older
    found = latest_step_checkpoint(store, "r", str(tmp_path / "back"), after=(1, 0))
    assert (found.epoch, found.step, found.progress) == (1, 5, [{"rows": 5}])
    assert (tmp_path / "back" / "model.bin").read_bytes() == bytes([1, 5])
    assert latest_step_checkpoint(store, "r", str(tmp_path / "none"), after=(2, 0)) is None  # an epoch end is later
    RunDir(store, "r").delete_step_checkpoints(before=(2, 0))
    assert store.listdir(root) == []


# ------------------------------------------------------------------------------------------------ a fit
EVERY, KILL = 3, (1, 4)  # checkpoint every 3 steps; rank 1 dies after batch 4 of epoch 1


class _BatchLog:
    """Every rank appends each batch it finished to ``rank<r>.log``; rank 1 dies once after batch ``KILL``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_batch_end(self, epoch: int, step: int, loss: float) -> None:
        import spark_hvd.torch as hvd

        with open(os.path.join(self.directory, f"rank{hvd.rank()}.log"), "a") as f:
            f.write(f"{epoch} {step}\n")
        marker = os.path.join(self.directory, "killed")
        if (epoch, step) == KILL and hvd.rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(17)


def _mse(model, batch):
    """The estimator's ``loss="mse"`` on one batch."""
    out = model(torch.from_numpy(batch["features"]))
    return torch.nn.functional.mse_loss(out, torch.from_numpy(batch["y"]).float().reshape(out.shape))


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3
    return spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(256)], "features array<float>, y double")


@pytest.mark.compat
@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_mid_epoch_resumes_at_the_exact_batch(spark, df, tmp_path):
    from spark_hvd.estimators import TorchEstimator

    store = Store.create(str(tmp_path / "store"))
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    initial = copy.deepcopy(net)
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=2,
                         random_seed=1, partitions_per_process=1, verbose=0, max_retries=1,
                         checkpoint_every_steps=EVERY, callbacks=[_BatchLog(str(tmp_path))])
    fitted = est.fit(df)
    assert (tmp_path / "killed").exists()

    shards = rank_shards(store, fitted, seed=1, batch_size=16)
    steps = shards[0].steps("train")
    assert steps > KILL[1] + 1
    logged = [tuple(map(int, line.split())) for line in (tmp_path / "rank0.log").read_text().splitlines()]
    every = [(e, s) for e in range(2) for s in range(steps)]
    assert sorted(set(logged)) == every, "a batch was never trained"
    repeated = len(logged) - len(every)
    assert 0 < repeated <= EVERY, f"the retry repeated {repeated} batches (checkpoint_every_steps={EVERY})"
    restart = next(i for i in range(1, len(logged)) if logged[i] <= logged[i - 1])
    assert logged[restart][0] == 1 and logged[restart][1] > 0, "the retry did not resume inside epoch 1"

    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = replay(shards, model, opt, _mse, 2)
    np.testing.assert_allclose(fitted.getHistory()["loss"], losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(fitted.getModel().state_dict().values(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
