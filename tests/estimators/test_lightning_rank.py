"""LightningEstimator on Lightning's own Trainer (local[2], num_proc=2): the fit equals single-process training on
the same combined batches (gradient clipping included, and across a resume by run_id whose rank 1 dies mid-epoch
and whose retry resumes from a step checkpoint at the exact batch), a user's Lightning Callback and CSVLogger ran
in the ranks, several optimizers under manual optimization with bf16-mixed precision and a scaled learning rate
stopped by Lightning's EarlyStopping, and bad Trainer settings refused on the driver."""

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
from helpers.estimators import assert_fit_fails_before_anything_runs, die_once
from helpers.torch_replay import assert_fit_equals_replay, rank_shards, replay

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from helpers import lightning_modules  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from spark_hvd.estimators import LightningEstimator  # noqa: E402
from spark_hvd.estimators.common.errors import EstimatorError  # noqa: E402
from spark_hvd.estimators.torch import EarlyStopping  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

_CLIP = 0.5
EVERY, KILL = 3, (2, 4)  # the resumed fit's step checkpoints every 3 steps; its rank 1 dies after batch 4 of epoch 2


class Reg(lightning_modules.Reg):
    """The shared linear regression (SGD with momentum, so a resume must restore the optimizer's state), logging
    its training and validation MSE."""

    def training_step(self, batch, batch_idx):
        loss = lightning_modules.mse(self, batch)
        self.log("train_mse", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_mse", lightning_modules.mse(self, batch), sync_dist=True)


class Hooks(pl.Callback):
    """Appends what each hook saw to ``<directory>/rank<global rank>.jsonl`` on the rank's filesystem."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _write(self, trainer, **what) -> None:
        with open(f"{self.directory}/rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(what) + "\n")

    def on_train_start(self, trainer, module):
        self._write(trainer, hook="train_start", world=trainer.world_size, strategy=type(trainer.strategy).__name__,
                    env=type(trainer.strategy.cluster_environment).__name__,
                    group=torch.distributed.get_world_size())

    def on_train_epoch_end(self, trainer, module):
        self._write(trainer, hook="train_epoch_end", epoch=trainer.current_epoch)

    def on_validation_epoch_end(self, trainer, module):
        self._write(trainer, hook="validation_epoch_end", epoch=trainer.current_epoch,
                    val_mse=float(trainer.callback_metrics["val_mse"]))

    def on_train_end(self, trainer, module):
        self._write(trainer, hook="train_end", step=trainer.global_step)


class BatchLog(pl.Callback):
    """Every rank draws from Python's, numpy's and torch's generators before each batch and appends
    ``[epoch, batch, draws...]`` to ``<directory>/rank<r>.log`` after it; rank 1 dies once after batch ``KILL``."""

    def __init__(self, directory: str) -> None:
        self.directory, self.draws = directory, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.draws = [random.random(), float(np.random.rand()), float(torch.rand(()))]

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        with open(os.path.join(self.directory, f"rank{trainer.global_rank}.log"), "a") as f:
            f.write(json.dumps([trainer.current_epoch, batch_idx, *self.draws]) + "\n")
        die_once(self.directory, (trainer.current_epoch, batch_idx) == KILL and trainer.global_rank == 1)


def assert_resumed_at_the_exact_batch(directory, epochs: range, steps: int) -> None:
    """The ``BatchLog`` of a fit whose rank 1 died once: on every rank each batch of ``epochs`` was trained, at most
    ``EVERY`` twice, the retry starting inside the epoch of ``KILL``, and a batch trained twice drew the same random
    numbers both times (the step checkpoint's random state was restored)."""
    assert (directory / "killed").exists()
    every = [(e, s) for e in epochs for s in range(steps)]
    for rank in (0, 1):
        lines = [json.loads(line) for line in (directory / f"rank{rank}.log").read_text().splitlines()]
        logged = [tuple(line[:2]) for line in lines]
        assert sorted(set(logged)) == every, f"rank {rank}: a batch was never trained"
        repeated = len(logged) - len(every)
        assert 0 < repeated <= EVERY, f"rank {rank}: the retry repeated {repeated} batches (every {EVERY} steps)"
        restart = next(i for i in range(1, len(logged)) if logged[i] <= logged[i - 1])
        assert logged[restart][0] == KILL[0] and logged[restart][1] > 0, "the retry did not resume mid-epoch"
        first: dict = {}
        for line in lines:
            assert first.setdefault(tuple(line[:2]), line[2:]) == line[2:], f"rank {rank}, batch {line[:2]}"


@pytest.fixture(scope="module")
def df(spark):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3 + rng.normal(scale=0.1, size=256).astype(np.float32)
    return spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(256)], "features array<float>, y double")


def _replayed(store, fitted, initial, epochs: int, clip: float | None) -> tuple[torch.nn.Module, list[float]]:
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=lightning_modules.LR, momentum=0.9)

    def apply(optimizer):
        if clip is not None:  # Lightning's gradient_clip_val: the norm of all gradients, after DDP's average
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()

    shards = rank_shards(store, fitted, seed=1, batch_size=16)
    return model, replay(shards, model, opt, lightning_modules.numpy_mse, epochs, apply=apply)


def test_fit_equals_replay_with_callbacks_logger_resume_and_transform(spark, df, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    (tmp_path / "hooks").mkdir()
    torch.manual_seed(0)
    net = Reg()
    initial = copy.deepcopy(net)
    est = LightningEstimator(num_proc=2, store=store, model=net, feature_cols=["features"], label_cols=["y"],
                             batch_size=16, epochs=2, validation=0.25, random_seed=1, partitions_per_process=1,
                             verbose=0, run_id="lightning-replay", gradient_clip_val=_CLIP, log_every_n_steps=1,
                             callbacks=[Hooks(str(tmp_path / "hooks"))],
                             logger=CSVLogger(str(tmp_path / "csv"), name="fit", version=0))
    fitted = est.fit(df)

    # the fit equals one process training on both ranks' batches with averaged, clipped gradients
    model, losses = _replayed(store, fitted, initial, 2, _CLIP)
    assert_fit_equals_replay(fitted, model, losses, atol=1e-5, rtol=1e-4)
    unclipped, _ = _replayed(store, fitted, initial, 2, None)  # the control: clipping changed the weights
    assert (unclipped.lin.weight - model.lin.weight).abs().max() > 1e-3
    hist = fitted.getHistory()
    assert hist["train_mse"] == pytest.approx(hist["loss"]) and len(hist["val_mse"]) == 2

    # the callback ran on both ranks, inside Lightning's DDP over the job's two ranks
    steps = rank_shards(store, fitted, seed=1, batch_size=16)[0].steps("train")
    for rank in (0, 1):
        seen = [json.loads(line) for line in (tmp_path / "hooks" / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [s["hook"] for s in seen] == ["train_start", "validation_epoch_end", "train_epoch_end",
                                             "validation_epoch_end", "train_epoch_end", "train_end"], seen
        assert seen[0] == {"hook": "train_start", "world": 2, "strategy": "DDPStrategy",
                           "env": "SparkHvdEnvironment", "group": 2}
        assert [s["epoch"] for s in seen[1:5]] == [0, 0, 1, 1] and seen[-1]["step"] == 2 * steps
        # Lightning's own epoch value (sync_dist) is the history's mean over both ranks' rows
        assert seen[3]["val_mse"] == pytest.approx(hist["val_mse"][1], rel=1e-2)

    # CSVLogger (rank 0) wrote every training step's train_mse
    with open(tmp_path / "csv" / "fit" / "version_0" / "metrics.csv") as f:
        header, *rows = [line.split(",") for line in f.read().splitlines()]
    assert {"epoch", "step", "train_mse", "val_mse"} <= set(header)
    assert sum(1 for r in rows if r[header.index("train_mse")]) == 2 * steps

    # transform equals the trained module called directly
    got = np.array([r.y__output for r in fitted.transform(df.limit(20)).collect()])
    x = torch.tensor([r.features for r in df.limit(20).collect()])
    with torch.no_grad():
        np.testing.assert_allclose(got, fitted.getModel()(x).squeeze(1).numpy(), rtol=1e-6, atol=1e-6)

    # resume by run_id from Lightning's checkpoint of epoch 1 (weights, momentum, loops) with step checkpoints; rank
    # 1 dies mid-epoch 2 and the retry resumes from the last step checkpoint at the exact batch: the third epoch
    # still equals three epochs of the replay
    (tmp_path / "batches").mkdir()
    more = est.copy({est.epochs: 3, est.checkpoint_every_steps: EVERY, est.max_retries: 1,
                     est.callbacks: [BatchLog(str(tmp_path / "batches"))]}).fit(df)
    assert KILL[1] + 1 < steps
    assert_resumed_at_the_exact_batch(tmp_path / "batches", range(2, 3), steps)
    model3, losses3 = _replayed(store, more, initial, 3, _CLIP)
    assert_fit_equals_replay(more, model3, losses3, atol=1e-5, rtol=1e-4)
    assert more.getHistory()["loss"][:2] == hist["loss"]


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with an optimizer per layer; records whether training_step ran under bf16 autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a = torch.nn.Linear(3, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        out = self(batch["features"])
        loss = torch.nn.functional.mse_loss(out.squeeze(1).float(), batch["y"].float())
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        self.log("bf16", float(out.dtype == torch.bfloat16))
        self.log("lr_a", opt_a.param_groups[0]["lr"])
        return loss

    def configure_optimizers(self):
        return [torch.optim.SGD(self.a.parameters(), lr=0.02), torch.optim.Adam(self.b.parameters(), lr=0.01)]


def test_two_optimizers_manual_optimization_bf16_scaled_lr_early_stopping(spark, df, tmp_path):
    from lightning.pytorch.callbacks import EarlyStopping as LightningEarlyStopping

    torch.manual_seed(0)
    net = TwoOptimizers()
    initial = copy.deepcopy(net)
    # Lightning's EarlyStopping on a value that never improves (always 1.0): it stops after epoch 1 of 4
    stop = LightningEarlyStopping(monitor="bf16", patience=1, mode="min", check_on_train_epoch_end=True)
    est = LightningEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                             feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=4, random_seed=1,
                             verbose=0, precision="bf16-mixed", scale_lr_by_num_proc=True, callbacks=[stop])
    fitted = est.fit(df)
    hist = fitted.getHistory()
    assert hist["bf16"] == [1.0, 1.0], hist  # two epochs (stopped); the step ran under bf16 autocast
    assert hist["lr_a"] == pytest.approx([0.04] * 2), hist  # 0.02 x 2 ranks (scale_lr_by_num_proc)
    assert hist["loss"][1] < hist["loss"][0], hist
    trained = fitted.getModel()
    for layer in ("a", "b"):  # both optimizers stepped
        assert (getattr(trained, layer).weight - getattr(initial, layer).weight).abs().max() > 1e-3, layer


def _manual() -> pl.LightningModule:
    return TwoOptimizers()


BAD = [  # (what, params, message)
    ("a torch-loop callback", dict(callbacks=[EarlyStopping()]), r"callbacks\[0\] is a EarlyStopping, not a "
     r"lightning Callback"),
    ("a reserved Trainer argument", dict(trainer_args={"max_epochs": 3}), r"'max_epochs' is set by the estimator "
     r"\(set epochs\)"),
    ("a misspelt Trainer argument", dict(trainer_args={"gradient_clip_vall": 1.0}),
     r"'gradient_clip_vall' is not a lightning.Trainer argument; did you mean \['gradient_clip_val'"),
    ("a param given twice", dict(precision="bf16-mixed", trainer_args={"precision": 32}), r"precision is given both"),
    ("an unknown precision", dict(precision="bf17"), r"precision 'bf17' is not one of Lightning's"),
    ("another strategy", dict(trainer_args={"strategy": "fsdp"}), r"strategy 'fsdp' is not supported"),
    ("a logger that is not one", dict(logger="csv"), r"logger must be a lightning Logger"),
    ("gradient compression", dict(gradient_compression=object()), r"gradient_compression is not supported"),
    ("clipping under manual optimization", dict(model=_manual(), gradient_clip_val=1.0),
     r"TwoOptimizers uses manual optimization"),
]


@pytest.mark.parametrize("what,params,match", BAD, ids=[b[0] for b in BAD])
def test_bad_trainer_settings_fail_on_the_driver(spark, df, tmp_path, what, params, match):
    root = tmp_path / "store"
    args = dict(num_proc=2, store=Store.create(str(root)), model=Reg(), feature_cols=["features"], label_cols=["y"],
                batch_size=16, verbose=0)
    args.update(params)
    assert_fit_fails_before_anything_runs(spark, LightningEstimator(**args), df, root, what, EstimatorError, match)


def test_a_run_without_lightning_checkpoints_is_not_resumed(spark, df, tmp_path):
    from spark_hvd.estimators.common.step_checkpoint import StepState, rng_state, write_step_checkpoint
    from spark_hvd.store import RunDir

    store = Store.create(str(tmp_path / "store"))
    old = tmp_path / "old"
    old.mkdir()
    torch.save(Reg().state_dict(), old / "model.pt")  # what the own-loop estimator (and TorchEstimator) wrote
    RunDir(store, "older-run").write_checkpoint(0, str(old), {"history": {}})
    est = LightningEstimator(num_proc=2, store=store, model=Reg(), feature_cols=["features"], label_cols=["y"],
                             batch_size=16, verbose=0, run_id="older-run")
    with pytest.raises(EstimatorError, match=r"run_id 'older-run' has a checkpoint of epoch 0 without "
                                             r"lightning.ckpt"):
        est.fit(df)
    # a TorchEstimator's step checkpoint, which a fit with step checkpoints would resume from
    write_step_checkpoint(store, "older-steps", str(old), StepState(1, 2, {}, [{}], [rng_state()]))
    with pytest.raises(EstimatorError, match=r"run_id 'older-steps' has a step checkpoint \(batch 2 of epoch 1\) "
                                             r"without lightning.ckpt"):
        est.copy({est.checkpoint_every_steps: 2, est.run_id: "older-steps"}).fit(df)


class WrongWidth(Reg):
    """Its first layer takes 4 values where the feature column has 3."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)


def test_a_module_that_fails_on_the_prepared_rows_fails_on_the_driver(spark, df, tmp_path, monkeypatch):
    """Lightning's fast_dev_run of a copy of the module on a few prepared rows, on the driver, before any rank starts:
    the error names the batch's shapes and the layer's; the module given to fit is untouched."""
    from spark_hvd.runner.backend import SparkBackend

    def no_rank(*a, **k):
        raise AssertionError("a training rank started")

    monkeypatch.setattr(SparkBackend, "run", no_rank)
    module = WrongWidth()
    before = copy.deepcopy(module.state_dict())
    est = LightningEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=module,
                             feature_cols=["features"], label_cols=["y"], batch_size=16, verbose=0)
    with pytest.raises(ValueError, match=r"LightningEstimator: the LightningModule failed Lightning's fast_dev_run on "
                                         r"4 prepared rows on the driver \(batch: features \(4, 3\), y \(4,\)\): "
                                         r"RuntimeError: .*4x3 and 4x1"):
        est.fit(df)
    for name, value in module.state_dict().items():
        assert torch.equal(value, before[name]), name
