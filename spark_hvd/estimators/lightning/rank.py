"""The rank half of ``LightningEstimator``: ``LightningTrainer`` runs Lightning's own ``Trainer.fit`` in each rank.

Each rank builds a ``lightning.Trainer`` whose ``DDPStrategy`` has the job's ``SparkHvdEnvironment``
(``lightning/env.py``: Lightning launches nothing; every rank is a node of one device) and whose
``init_process_group`` meets over the job's authenticated store (``env://``, ``spark_hvd.core.torchrun``). So
Lightning does the training itself: DDP's gradient averaging, ``configure_optimizers`` (one or several
optimizers, manual optimization, LR schedulers), precision plugins, gradient clipping and accumulation, the
user's callbacks and loggers, ``self.log``. The Trainer gets (``trainer_args`` added last, overriding):
``max_epochs=epochs``, ``accumulate_grad_batches=backward_passes_per_step``, ``log_every_n_steps``,
``precision``/``gradient_clip_val``/``profiler`` where set (a profiler by name writes its report to the run's
``logs/profiler/rank<r>/`` in the store), ``logger`` (default none), ``enable_progress_bar=False`` and
``enable_model_summary=False`` (spark_hvd reports progress), ``num_sanity_val_steps=0``,
``use_distributed_sampler=False`` (the data is already sharded).

What spark_hvd adds, through ``_Bridge`` (a Lightning ``Checkpoint`` callback, so it runs after the module's own
``on_train_epoch_end`` and Lightning adds no ``ModelCheckpoint`` of its own):

- the data: a ``DataLoader`` over the rank's shard of the prepared Parquet data (``ShardReaders``), batches as
  dicts of tensors keyed by column name (features, labels, sample weight), the same number of batches on every
  rank, reshuffled per epoch;
- the history: ``self.log``/``self.log_dict`` values (recorded by a wrapper that then calls Lightning's own
  ``log``) averaged over every rank's rows per epoch, plus ``loss`` (the mean of ``training_step``'s loss),
  ``val_loss`` (what ``validation_step`` returns, unless it logs ``val_loss`` itself) and ``lr`` where a scheduler
  runs. Values logged outside a batch (e.g. in ``on_train_epoch_end``) are averaged over the ranks;
- per epoch: ``RankRun.end_epoch`` (rank 0's checkpoint, the metrics log, progress, MLflow); the checkpoint is
  Lightning's own full state (``lightning.ckpt``: model, optimizers, schedulers, loops, callbacks' state,
  precision scaler), and a resumed run hands it to ``Trainer.fit(ckpt_path=...)`` on every rank;
- ``terminate_on_nan`` and ``scale_lr_by_num_proc`` (applied to the optimizers ``configure_optimizers`` built;
  rescaled after Lightning restored a checkpoint of another number of ranks);
- step checkpoints (``checkpoint_every_steps`` / ``_seconds``, ``lightning/steps.py``): Lightning's full state
  taken in ``on_train_batch_end``, with every rank's random generators and the epoch's running sums; a resume
  continues at the exact batch of the epoch;
- ``elastic=True``: a relaunch resumes from the last step or epoch checkpoint, and the job grows at a step
  checkpoint when task slots free up; DDP's error for a lost peer is raised as the core's ``PeerFailureError``
  (``peer_failure``), a consequence the driver relaunches on.
"""

from __future__ import annotations

import functools
import logging
import os
import posixpath
import shutil
import tempfile
import warnings
from typing import Any

from spark_hvd.estimators.common import compat
from spark_hvd.estimators.common.rank_run import RankRun
from spark_hvd.estimators.lightning.steps import (
    NOT_RESUMABLE_WARNING,
    StepCheckpoints,
    align_batch_progress,
    resized_progress,
)
from spark_hvd.estimators.torch.rank import TorchTrainer

__all__ = ["LightningTrainer", "CHECKPOINT_FILE"]

log = logging.getLogger(__name__)

#: the file of a run's checkpoint directory that holds Lightning's checkpoint
CHECKPOINT_FILE = "lightning.ckpt"

#: Lightning's advice that does not apply here (the reader has its own worker pool; the shards are equal), and
#: lightning 2.6's deprecation notice about torch's pytree API (once per rank; nothing a user can change)
_QUIET = (".*does not have many workers.*", ".*IterableDataset.*__len__.*", ".*Total length of.*",
          ".*sync_dist=True.*", ".*is smaller than the logging interval.*", ".*LeafSpec.*is deprecated.*",
          NOT_RESUMABLE_WARNING)
#: Lightning's loggers whose INFO lines ("GPU available", "Initializing distributed" ...) every rank would repeat
_CHATTY = ("lightning.pytorch", "lightning.fabric")


def _scalar(value: Any) -> float | None:
    """A logged value as a float, or None when it is not a number (a torchmetrics ``Metric``: Lightning's)."""
    try:
        return float(value.detach()) if hasattr(value, "detach") else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _loss_of(output: Any) -> Any:
    return output.get("loss") if isinstance(output, dict) else output


class _Recorder:
    """The row-weighted sums of one epoch: training and validation batches, and values logged outside a batch."""

    def __init__(self) -> None:
        self.phase = "train"
        self.rows = 0  #: rows of the batch being run (0: outside a batch)
        self.train: dict[str, float] = {}
        self.train_rows = 0
        self.val: dict[str, float] = {}
        self.val_rows = 0
        self.val_returned: float | None = None
        self.outside: dict[str, float] = {}
        self.lr: float | None = None

    def record(self, name: str, value: Any, batch_size: int | None) -> None:
        number = _scalar(value)
        if number is None:
            return
        if not self.rows:
            self.outside[name] = number
            return
        acc = self.val if self.phase == "val" else self.train
        acc[name] = acc.get(name, 0.0) + number * (batch_size or self.rows)


class LightningTrainer(TorchTrainer):
    """A ``RankTrainer`` whose training is ``lightning.Trainer.fit`` (see the module docstring); ``init`` (binding,
    device, threads), the batch tensors, the output shapes and the final model are ``TorchTrainer``'s."""

    def build(self, spec: Any) -> None:
        from spark_hvd.estimators.torch.serde import deserialize_module

        self.spec = spec
        self.model = deserialize_module(spec.model_bytes).to(self.device)
        self.recorder = _Recorder()
        self.resume: dict | None = None  #: the Lightning checkpoint a resumed run starts from
        #: the learning rates' factor once the resumed state is restored (a resume on another number of ranks)
        self.lr_factor = 1.0
        self.trainer: Any = None
        self.steps: StepCheckpoints | None = None  #: the step checkpoints of the fit under way
        module, owner = self.model, self
        lightning_log = type(module).log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            trainer = module._trainer
            if trainer is None or not trainer.sanity_checking:
                owner.recorder.record(name, value, kwargs.get("batch_size"))
            lightning_log(module, name, value, *args, **kwargs)

        # an instance attribute on this rank's copy (log_dict calls it too); removed before the model is saved
        object.__setattr__(module, "log", log)

    # ---- checkpoints: Lightning's own
    def save_checkpoint(self, directory: str) -> None:
        import torch

        state = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        torch.save(state, os.path.join(directory, CHECKPOINT_FILE))

    def load_checkpoint(self, directory: str) -> None:
        import torch

        path = os.path.join(directory, CHECKPOINT_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"run {self.spec.run_id}: the checkpoint has no {CHECKPOINT_FILE}; it was not "
                                    "written by LightningEstimator (start a new run_id)")
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["state_dict"])
        self.resume = state

    def sync(self) -> None:
        self.resume = self.hvd.broadcast_object(self.resume, root_rank=0)
        self.hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)

    def resized_progress(self, progress: list[dict], rank: int, size: int) -> dict:
        """The epoch's running sums of a step checkpoint of another number of ranks (``steps.py``)."""
        return resized_progress(progress, rank)

    def rescale_lr(self, factor: float) -> None:
        """Lightning restores the optimizers' and schedulers' state (their rates scaled for the checkpoint's number
        of ranks) after ``on_fit_start``: the bridge multiplies them by ``factor`` in ``on_train_start``."""
        self.lr_factor *= factor

    def save_model(self, directory: str) -> None:
        self.model.__dict__.pop("log", None)  # our recording wrapper is not part of the module
        super().save_model(directory)

    # ---- training
    def _batch(self, batch: dict) -> dict:
        """The reader's numpy batch as the module's dict of tensors (integer labels as int64, for class-index
        losses)."""
        import torch

        spec = self.spec
        inputs, labels, sw = self._tensors(batch)
        out = dict(zip(spec.feature_cols, inputs, strict=True))
        out.update((c, y.long() if not y.is_floating_point() and y.dtype != torch.bool else y)
                   for c, y in zip(spec.label_cols, labels, strict=True))
        if sw is not None:
            out[spec.sample_weight_col] = sw
        return out

    def _loader(self, run: RankRun, split: str) -> Any:
        import torch

        owner = self

        class Shard(torch.utils.data.IterableDataset):
            def __iter__(self):
                epoch = owner.trainer.current_epoch
                skip = owner.steps.train_skip(epoch) if split == "train" else 0  # a mid-epoch resume
                for batch in run.readers.epoch(split, epoch, skip=skip):
                    yield owner._batch(batch)

            def __len__(self) -> int:
                return run.readers.steps(split)

        return torch.utils.data.DataLoader(Shard(), batch_size=None)

    def _trainer_args(self, run: RankRun, root: str) -> dict:
        from lightning.pytorch.strategies import DDPStrategy

        from spark_hvd.estimators.lightning.env import SparkHvdEnvironment

        spec = self.spec
        on_gpu = self.device.type == "cuda"
        args = {
            "accelerator": "gpu" if on_gpu else "cpu", "devices": [self.device.index] if on_gpu else 1,
            "num_nodes": run.size, "max_epochs": spec.epochs,
            "strategy": DDPStrategy(cluster_environment=SparkHvdEnvironment(run.rank, run.size)),
            "callbacks": [*spec.callbacks, _Bridge(self, run, self.steps)], "logger": spec.logger or False,
            "enable_checkpointing": True, "enable_progress_bar": False, "enable_model_summary": False,
            "num_sanity_val_steps": 0, "use_distributed_sampler": False, "default_root_dir": root,
            "accumulate_grad_batches": spec.backward_passes_per_step, "log_every_n_steps": spec.log_every_n_steps,
        }
        if spec.precision is not None:
            args["precision"] = spec.precision
        if spec.gradient_clip_val is not None:
            args["gradient_clip_val"] = spec.gradient_clip_val
        if spec.profiler is not None:
            args["profiler"] = _profiler(spec.profiler, os.path.join(root, PROFILER_DIR))
        if not run.readers.has_validation:
            args["limit_val_batches"] = 0
        extra = dict(spec.trainer_args or {})
        strategy = extra.pop("strategy", "ddp")
        if isinstance(strategy, DDPStrategy):  # the user's DDP settings, on the job's ranks
            strategy.cluster_environment = args["strategy"].cluster_environment
            args["strategy"] = strategy
        elif strategy == "ddp_find_unused_parameters_true":
            args["strategy"] = DDPStrategy(cluster_environment=args["strategy"].cluster_environment,
                                           find_unused_parameters=True)
        args.update(extra)
        return args

    def train(self, run: RankRun) -> None:
        import lightning.pytorch as pl
        import torch

        steps = run.readers.steps("train")
        if run.start_step >= steps:  # an elastic resize mapped the checkpoint's batch to the new epoch's end
            log.warning("rank %d: the step checkpoint maps to the end of epoch %d; its last batch is trained again",
                        run.rank, run.start)
            run.start_step = steps - 1
        self.steps = StepCheckpoints(self, run)  # first: it keeps the random state the step checkpoint had
        root = tempfile.mkdtemp(prefix="spark_hvd_lightning_")
        loggers = [logging.getLogger(name) for name in _CHATTY]
        levels = [lg.level for lg in loggers]
        if self.spec.verbose < 2:
            for lg in loggers:
                lg.setLevel(logging.WARNING)
        try:
            with warnings.catch_warnings():
                for message in _QUIET:
                    warnings.filterwarnings("ignore", message=message)
                self.trainer = pl.Trainer(**self._trainer_args(run, root))
                ckpt = None
                if self.resume is not None:
                    ckpt = os.path.join(root, CHECKPOINT_FILE)
                    if run.start_step:
                        align_batch_progress(self.resume, run.start_step)
                        compat.finish_saved_batch(self.resume)
                    torch.save(self.resume, ckpt)
                    self.resume = None
                val = self._loader(run, "val") if run.readers.has_validation else None
                try:
                    self.trainer.fit(self.model, train_dataloaders=self._loader(run, "train"), val_dataloaders=val,
                                     ckpt_path=ckpt)
                except RuntimeError as exc:
                    lost = peer_failure(exc, run.rank)
                    if lost is None:
                        raise
                    raise lost from exc
                reports = os.path.join(root, PROFILER_DIR)
                if os.path.isdir(reports) and os.listdir(reports):  # a named profiler's report, to the store
                    run.run_dir.store.upload_dir(reports, posixpath.join(run.run_dir.logs_path, PROFILER_DIR,
                                                                         f"rank{run.rank}"))
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)
            shutil.rmtree(root, ignore_errors=True)


#: the profiler's report: ``<Trainer root>/profiler`` on the rank, then ``runs/<run_id>/logs/profiler/rank<r>``
PROFILER_DIR = "profiler"


def _profiler(profiler: Any, dirpath: str) -> Any:
    """The Trainer's profiler: a name (``checks.PROFILERS``) as Lightning's class writing ``<stage>-profile*.txt``
    reports under ``dirpath`` (Horovod's file name); an object as the user configured it."""
    if not isinstance(profiler, str):
        return profiler
    from lightning.pytorch.profilers import AdvancedProfiler, PyTorchProfiler, SimpleProfiler

    cls = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}[profiler]
    return cls(dirpath=dirpath, filename="profile")


#: what torch.distributed's errors say when a peer's connection went away (gloo's TCP transport)
_PEER_GONE = ("gloo/transport/tcp",)


def peer_failure(exc: BaseException, rank: int) -> BaseException | None:
    """DDP's error for a lost peer (torch.distributed's network error, or gloo's TCP transport failing: connection
    reset or closed) as the core's ``PeerFailureError``, which the driver counts as a consequence of the peer's loss,
    not a cause of its own (so the root failure named is the peer's, and an elastic fit relaunches instead of
    failing whichever error reaches the driver first); None for any other error."""
    import torch.distributed as dist

    from spark_hvd.core.errors import PeerFailureError

    network = getattr(dist, "DistNetworkError", ())
    if not (isinstance(exc, network) or any(mark in str(exc) for mark in _PEER_GONE)):
        return None
    return PeerFailureError(f"rank {rank}: torch.distributed lost a peer during the Lightning fit: "
                            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", operation="ddp")


def _scale_rates(trainer: Any, factor: float) -> None:
    """Every optimizer's learning rates (and initial rates) and every scheduler's base rates times ``factor``."""
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
    for config in trainer.lr_scheduler_configs:
        if hasattr(config.scheduler, "base_lrs"):
            config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]


@functools.cache
def _bridge_class() -> type:
    """``_Bridge`` (built on first use, so that importing this module does not import Lightning)."""
    from lightning.pytorch.callbacks import Checkpoint

    return type("_Bridge", (_BridgeHooks, Checkpoint), {})


def _Bridge(owner: LightningTrainer, run: RankRun, steps: StepCheckpoints) -> Any:  # noqa: N802 (a class, built lazily)
    return _bridge_class()(owner, run, steps)


class _BridgeHooks:
    """spark_hvd's side of the Lightning fit (see the module docstring): history, ``RankRun.end_epoch``,
    ``terminate_on_nan``, progress, ``scale_lr_by_num_proc``, step checkpoints (``steps.py``)."""

    def __init__(self, owner: LightningTrainer, run: RankRun, steps: StepCheckpoints) -> None:
        self.owner, self.run, self.steps = owner, run, steps

    @property
    def state_key(self) -> str:
        return "spark_hvd"

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        # after configure_optimizers, before a resumed run's optimizer state (already scaled) is restored
        if self.owner.spec.scale_lr_by_num_proc:
            _scale_rates(trainer, self.run.size)

    def on_train_start(self, trainer: Any, module: Any) -> None:
        # after a resumed run's optimizer and scheduler state was restored: rescaled for a new number of ranks
        if self.owner.lr_factor != 1.0:
            _scale_rates(trainer, self.owner.lr_factor)
            self.owner.lr_factor = 1.0
        restoring = self.steps.rngs is not None
        self.steps.train_start(_Recorder)  # a mid-epoch resume: the epoch's sums and the random state back
        # Lightning 2.3-2.4 start the resumed epoch again: its restored sums are kept there
        self._keep_restored = restoring and compat.starts_resumed_epoch()

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        if self.__dict__.pop("_keep_restored", False):
            return
        self.owner.recorder = rec = _Recorder()
        if trainer.lr_scheduler_configs:  # the epoch's rate (Lightning steps an epoch scheduler at its last batch)
            rec.lr = float(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_start(self, trainer: Any, module: Any, batch: dict, batch_idx: int) -> None:
        self.owner.recorder.rows = int(next(iter(batch.values())).shape[0])

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: dict, batch_idx: int) -> None:
        rec = self.owner.recorder
        loss = _loss_of(outputs)
        value = None
        if loss is not None and _scalar(loss) is not None:
            value = _scalar(loss)
            if module.automatic_optimization:  # Lightning divided it by the accumulation
                value *= trainer.accumulate_grad_batches
            rec.train["loss"] = rec.train.get("loss", 0.0) + value * rec.rows
        rec.train_rows += rec.rows
        rec.rows = 0
        self.run.batch_done(trainer.current_epoch, batch_idx, value)
        self.steps.batch_end(trainer, batch_idx)

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self.owner.recorder.phase = "val"

    def on_validation_batch_start(self, trainer: Any, module: Any, batch: dict, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        self.owner.recorder.rows = int(next(iter(batch.values())).shape[0])

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: dict, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        rec = self.owner.recorder
        if not trainer.sanity_checking:
            loss = _scalar(_loss_of(outputs)) if _loss_of(outputs) is not None else None
            if loss is not None:  # a returned loss counts as val_loss unless the step logs one itself
                rec.val_returned = (rec.val_returned or 0.0) + loss * rec.rows
            rec.val_rows += rec.rows
        rec.rows = 0

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self.owner.recorder.phase = "train"

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        owner, rec = self.owner, self.owner.recorder
        logs = owner._epoch_metrics(rec.train, rec.train_rows)
        if self.run.readers.has_validation:
            val = dict(rec.val)
            if rec.val_returned is not None and "val_loss" not in val:
                val["val_loss"] = rec.val_returned
            logs.update(owner._epoch_metrics(val, rec.val_rows))
        if rec.outside:
            logs.update(owner._epoch_metrics(dict(rec.outside), 1))
        if rec.lr is not None:
            logs["lr"] = rec.lr
        if self.run.end_epoch(trainer.current_epoch, logs, stop=trainer.should_stop):
            trainer.should_stop = True

