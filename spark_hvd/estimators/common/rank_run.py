"""The rank side of every estimator: one ``RankRun`` does what all frameworks share, a ``RankTrainer`` the rest.

``RankRun(spec, trainer).execute()`` is the training function of every rank:

1. ``trainer.init()`` (the framework's binding, threads, device) and the seed;
2. ``trainer.build()`` (model and optimizer from the spec);
3. resume: rank 0 loads the newest checkpoint of the run (``trainer.load_checkpoint``), ``broadcast_object``
   gives every rank the epoch to start at and the history so far, ``trainer.sync()`` broadcasts the state;
4. ``trainer.train(run)`` trains epochs ``run.start .. spec.epochs - 1`` and calls ``run.end_epoch(epoch, logs)``
   after each (history, rank 0's checkpoint or metrics log, the progress report; it says when to stop); a
   checkpoint is snapshotted to local disk and uploaded by a ``BackgroundWriter`` while training goes on
   (``checkpoint_upload="async"``, at most one in flight) or before it goes on (``"sync"``);
5. finish: rank 0 waits for the last upload, reloads the best epoch's checkpoint if a ``BestPolicy`` chose epochs,
   measures the output shapes on one batch, writes the final model (``trainer.save_model``) and returns the history.

A framework supplies only ``init``, ``build``, ``train``, ``save_checkpoint``/``load_checkpoint``, ``save_model``
and ``output_shapes``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from spark_hvd.estimators.common.rank_data import ShardReaders, append_history
from spark_hvd.estimators.common.retention import best_epochs, kept_epochs
from spark_hvd.estimators.common.spec import TrainSpec
from spark_hvd.estimators.common.step_checkpoint import (
    StepState,
    StepTrigger,
    latest_step_checkpoint,
    rng_state,
    set_rng_state,
    write_step_checkpoint,
)
from spark_hvd.runner.start_lines import QUIET_FRAMEWORK_LOGS, quiet_imports
from spark_hvd.store.background import BackgroundWriter, write_with_retries
from spark_hvd.store.run_dir import RunDir

__all__ = ["RankRun", "RankTrainer", "TrainingContext", "EarlyStopping", "check_finite", "train_on_rank",
           "start_method"]

log = logging.getLogger(__name__)

#: Seconds a failed rank 0 still waits for the checkpoint it is uploading before it raises.
UPLOAD_DRAIN_S = 120.0


class TrainingContext:
    """What a torch-loop callback's ``on_train_begin(context)`` receives: the rank's ``model`` and ``optimizer``
    (and ``scheduler``, if any), ``rank``/``size``, and ``stop_training``: set it to True (e.g. early stopping) and
    training ends after the current epoch. Rank 0's decision is the one every rank follows."""

    def __init__(self, model: Any, optimizer: Any, rank: int, size: int, scheduler: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = rank
        self.size = size
        self.stop_training = False


class EarlyStopping:
    """A torch-loop callback (``TorchEstimator``, ``LightningEstimator``): stop when ``monitor`` (a logs key such as
    ``val_loss``) has not improved by more than ``min_delta`` for ``patience`` epochs; ``mode`` min, max or auto."""

    def __init__(self, monitor: str = "val_loss", patience: int = 0, mode: str = "auto",
                 min_delta: float = 0.0) -> None:
        from spark_hvd.estimators.common.spec import BestPolicy

        self.policy = BestPolicy.create(monitor, mode, min_delta)
        self.patience = int(patience)
        self.best: float | None = None
        self.wait = 0
        self.context: TrainingContext | None = None

    def on_train_begin(self, context: TrainingContext) -> None:
        self.context = context

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        value = logs.get(self.policy.monitor)
        if value is None:
            raise KeyError(f"EarlyStopping monitors {self.policy.monitor!r}, not in the logs {sorted(logs)}")
        if self.policy.improved(value, self.best):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= max(self.patience, 1):  # as Keras: patience 0 and 1 stop at the first miss
            log.info("early stopping after epoch %d: %s did not improve for %d epochs", epoch,
                     self.policy.monitor, self.wait)
            self.context.stop_training = True


class RankTrainer(ABC):
    """A framework's part of the rank-side run."""

    #: the framework's binding (``spark_hvd.torch`` or ``spark_hvd.keras``), set by ``init``
    hvd: Any = None

    @abstractmethod
    def init(self, spec: TrainSpec) -> None:
        """Initialise the binding (``self.hvd``), threads and device."""

    @abstractmethod
    def seed(self, seed: int) -> None:
        """Seed the framework's random state."""

    @abstractmethod
    def build(self, spec: TrainSpec) -> None:
        """Build the model and the optimizer from the spec."""

    @abstractmethod
    def load_checkpoint(self, directory: str) -> None:
        """Load what ``save_checkpoint`` wrote (model and optimizer state)."""

    @abstractmethod
    def save_checkpoint(self, directory: str) -> None:
        """Write the model and optimizer state into ``directory``."""

    @abstractmethod
    def sync(self) -> None:
        """Make every rank's state rank 0's (after a resume, before training)."""

    @abstractmethod
    def train(self, run: RankRun) -> None:
        """Train epochs ``run.start`` .. ``run.spec.epochs - 1``, calling ``run.end_epoch`` after each; stop when it
        returns True."""

    @abstractmethod
    def output_shapes(self, batch: dict) -> list[list[int]]:
        """Per-row shape of each model output, from one batch of training data."""

    @abstractmethod
    def save_model(self, directory: str) -> None:
        """Write the final model into ``directory``."""

    def resized_progress(self, progress: list[dict], rank: int, size: int) -> dict:
        """A step checkpoint of another number of ranks: this rank's running sums of the epoch, from ``progress``
        (what ``step_end`` got on each rank of the checkpoint). Default (the torch loop's ``{"acc", "rows"}``, whose
        epoch metrics are sums over the ranks): rank 0 carries all the ranks' sums, the others start from zero."""
        return merged_progress(progress) if rank == 0 else {}

    def rescale_lr(self, factor: float) -> None:
        """Multiply the learning rate by ``factor`` (a resume on another number of ranks under
        ``scale_lr_by_num_proc``); by default a framework cannot, and says so."""
        log.warning("the learning rate was scaled for another number of ranks and is not rescaled by %g", factor)


class RankRun:
    """One rank's training run (see the module docstring)."""

    def __init__(self, spec: TrainSpec, trainer: RankTrainer) -> None:
        self.spec = spec
        self.trainer = trainer
        self.run_dir = RunDir(spec.store, spec.run_id)
        self._events: Any = None  # the TensorBoard event file, opened by the first metrics written
        self.history: dict[str, list[float]] = {}
        self.start = 0
        self.rank, self.size = 0, 1
        self.readers: ShardReaders | None = None
        self._best: float | None = None
        self._checkpointed = False
        self._progress: Any = None
        self.writer = BackgroundWriter(background=spec.checkpoint_upload == "async",
                                       when_busy=spec.checkpoint_when_busy)
        #: batches of epoch ``start`` already done (a resume from a step checkpoint), and the loop's running sums
        self.start_step = 0
        self.resume_progress: dict = {}
        #: a resumed step checkpoint's batches per epoch (None: as saved by a spark_hvd that did not record them)
        self._saved_steps: int | None = None
        #: the epoch whose checkpoint became the final model (``final_model="best"``); None: the last state
        self.final_epoch: int | None = None
        self.step_checkpoints = 0
        self._trigger = StepTrigger(getattr(spec, "checkpoint_every_steps", None),
                                    getattr(spec, "checkpoint_every_seconds", None),
                                    getattr(spec, "backward_passes_per_step", 1))

    def execute(self) -> dict | None:
        """Run everything; rank 0 returns ``{"history": ..., "output_shapes": ...}``, the others None."""
        spec, trainer = self.spec, self.trainer
        with quiet_imports():  # TensorFlow's lines written before it reads TF_CPP_MIN_LOG_LEVEL (start_lines.py)
            trainer.init(spec)  # where the framework is imported, unless the payload's unpickling did
        hvd = trainer.hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        if spec.random_seed is not None:
            trainer.seed(spec.random_seed)
        trainer.build(spec)
        self._resume()
        self.readers = ShardReaders(spec, self.rank, self.size)
        self._map_resume_step()
        if self.rank == 0 and spec.verbose:
            from spark_hvd.runner import StepReporter

            self._progress = StepReporter(self.readers.steps("train"), spec.epochs)
        try:
            try:
                if self.start < spec.epochs:
                    with start_method(spec.mp_start_method):
                        trainer.train(self)
            except BaseException:
                self._drain_uploads()
                raise
            return self._finish()
        finally:
            self.readers.close()  # the process pool's workers, kept across epochs, end with the fit

    def _drain_uploads(self) -> None:
        """Training failed (often a lost peer): give the checkpoint being uploaded a bounded time to commit, so the
        retry resumes from it rather than from the one before."""
        try:
            self.writer.wait(UPLOAD_DRAIN_S)
        except Exception as exc:  # the training failure is the one to raise
            log.warning("run %s: the checkpoint upload did not finish after training failed: %s",
                        self.spec.run_id, exc)

    # ---- resume
    def _resume(self) -> None:
        start, history, step_state, saved_size = 0, {}, None, None
        if self.rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                found = self.run_dir.latest_checkpoint(tmp)
                if found is not None:
                    last, history = int(found.state.get("epoch", found.epoch)), dict(found.state.get("history") or {})
                    saved_size = found.state.get("num_proc")
                    self.trainer.load_checkpoint(tmp)
                    start = last + 1
                    log.info("run %s: resuming after epoch %d", self.spec.run_id, last)
            if self._trigger.enabled:
                with tempfile.TemporaryDirectory() as tmp:
                    step_state = latest_step_checkpoint(self.spec.store, self.spec.run_id, tmp, after=(start, 0))
                    if step_state is not None:
                        self.trainer.load_checkpoint(tmp)
                        start, history, saved_size = step_state.epoch, step_state.history, len(step_state.rngs)
                        log.info("run %s: resuming after batch %d of epoch %d", self.spec.run_id, step_state.step,
                                 step_state.epoch)
        self.start, self.history, step_state, saved_size = self.trainer.hvd.broadcast_object(
            (start, history, step_state, saved_size), root_rank=0)
        if step_state is not None:
            self.start_step = step_state.step
            self._saved_steps = getattr(step_state, "steps", None)
            if len(step_state.rngs) == self.size:
                set_rng_state(step_state.rngs[self.rank])
                self.resume_progress = step_state.progress[self.rank]
            else:
                if self.rank < len(step_state.rngs):
                    set_rng_state(step_state.rngs[self.rank])
                self.resume_progress = self.trainer.resized_progress(step_state.progress, self.rank, self.size)
        best = self.spec.best
        if best is not None:
            for value in self.history.get(best.monitor, []):
                self._best = value if best.improved(value, self._best) else self._best
        self.trainer.sync()
        if saved_size is not None and int(saved_size) != self.size:
            log.warning("run %s: resuming a checkpoint of %d ranks on %d", self.spec.run_id, saved_size, self.size)
            if self.spec.scale_lr_by_num_proc:
                self.trainer.rescale_lr(self.size / int(saved_size))

    def _map_resume_step(self) -> None:
        """A step checkpoint of another number of ranks (an elastic relaunch) has another number of batches per
        epoch: resume at the same fraction of the epoch, ``round(step * steps_now / steps_then)`` batches into this
        rank's new shard. The rows of the epoch's rest are then the new shards' rest, not exactly the rows the lost
        run had left (docs/elastic.md); from the next epoch on, every row is read once per epoch again."""
        then, now = self._saved_steps, self.readers.steps("train")
        if not self.start_step or then is None or then == now:
            return
        mapped = min(now, round(self.start_step * now / then))
        log.info("run %s: batch %d of %d per epoch on the ranks of the checkpoint is batch %d of %d on %d ranks",
                 self.spec.run_id, self.start_step, then, mapped, now, self.size)
        self.start_step = mapped

    # ---- per batch, per epoch
    def batch_done(self, epoch: int, step: int, loss: Any) -> None:
        """Batch ``step`` (0-based) of ``epoch`` is done with training loss ``loss`` (None: the framework gave none):
        under ``terminate_on_nan`` a non-finite loss raises (``check_finite``); rank 0 reports the progress
        (throttled) for the driver's progress bar."""
        loss = None if loss is None else float(loss)
        if loss is not None and self.spec.terminate_on_nan:
            check_finite(loss, epoch, step, self.rank)
        if self._progress is not None:
            self._progress(epoch, step + 1, loss=loss)

    @property
    def checkpoints_inside_epochs(self) -> bool:
        """Whether step checkpoints are on (``checkpoint_every_steps`` / ``_seconds``): ``step_end`` then wants the
        loop's running sums after every batch."""
        return self._trigger.enabled

    def step_end(self, epoch: int, step: int, progress: dict) -> None:
        """After batch ``step`` (0-based) of ``epoch``, once everything of the batch is done (optimizer, scheduler,
        callbacks): take a step checkpoint when one is due (``checkpoint_every_steps`` / ``_seconds``); every rank
        calls it (the ranks' random states are gathered). ``progress``: the loop's running sums of the epoch.
        Elastic (``spec.elastic``): after a checkpoint, when the driver says task slots are free below
        ``max_num_proc``, every rank raises ``HostsUpdatedInterrupt`` once it is committed: the driver relaunches
        the fit bigger, from this checkpoint."""
        if not self._trigger.enabled:
            return
        if not self._trigger.due(epoch * self.readers.steps("train") + step + 1, self.trainer.hvd):
            return
        gathered = self.trainer.hvd.allgather_object((rng_state(), copy.deepcopy(progress)))
        submitted = self.rank == 0 and self._step_checkpoint(epoch, step, gathered)
        if getattr(self.spec, "elastic", False):
            self._grow_if_slots_freed(submitted)

    def _grow_if_slots_freed(self, submitted: bool) -> None:
        """Every rank, under ``run_elastic``: rank 0 asks the driver whether the job can grow (only when it just
        submitted a checkpoint, which it then waits to be committed); all raise ``HostsUpdatedInterrupt`` if so."""
        from spark_hvd.core.elastic import HostsUpdatedInterrupt, get_link

        link = get_link()
        if link is None:
            return
        grow = False
        if self.rank == 0 and submitted and link.hosts_updated():
            self.writer.wait()  # the relaunch resumes from this checkpoint
            grow = True
        if self.trainer.hvd.broadcast_object(grow, root_rank=0):
            log.info("run %s: task slots are free; stopping at this checkpoint to relaunch on more ranks",
                     self.spec.run_id)
            raise HostsUpdatedInterrupt(False)

    def _step_checkpoint(self, epoch: int, step: int, gathered: list) -> bool:
        """Rank 0: snapshot the step checkpoint and hand it to the writer; False when skipped."""
        if self.writer.when_busy == "skip" and self.writer.busy():
            self.writer.skipped += 1
            log.info("run %s: step checkpoint at batch %d of epoch %d skipped: the previous one is still uploading",
                     self.spec.run_id, step + 1, epoch)
            return False
        state = StepState(epoch, step + 1, copy.deepcopy(self.history), [g[1] for g in gathered],
                          [g[0] for g in gathered], steps=self.readers.steps("train"))
        snapshot = self._snapshot("spark_hvd_step_")
        store, run_id = self.spec.store, self.spec.run_id
        if self.writer.submit(lambda: write_step_checkpoint(store, run_id, snapshot, state),
                              what=f"run {run_id}: the checkpoint after batch {step + 1} of epoch {epoch} "
                                   f"({self.run_dir.step_checkpoint_path(epoch, step + 1)})",
                              checkpoint=True, cleanup=lambda: shutil.rmtree(snapshot, ignore_errors=True)):
            self.step_checkpoints += 1
            return True
        shutil.rmtree(snapshot, ignore_errors=True)
        return False

    def end_epoch(self, epoch: int, logs: dict[str, float], stop: bool = False) -> bool:
        """After ``epoch``: history, rank 0's checkpoint (only improving epochs under a ``BestPolicy``) or metrics
        log, the progress report. ``stop``: this rank wants to stop; rank 0's wish is broadcast, so every rank
        returns the same answer (True: stop training)."""
        from spark_hvd.runner import report

        append_history(self.history, logs)
        if getattr(self.spec, "elastic", False):  # the ranks that ended each epoch: an elastic run's size changes
            append_history(self.history, {"num_proc": self.size})
        save = True
        policy = self.spec.best
        if policy is not None:
            value = logs.get(policy.monitor)
            if value is None:
                log.warning("best-epoch selection monitors %r, not in the logs %s: checkpointing every epoch",
                            policy.monitor, sorted(logs))
            else:
                save = policy.improved(value, self._best)
                self._best = value if save else self._best
        if self.rank == 0:
            if not (save and self._checkpoint(epoch)):
                history = copy.deepcopy(self.history)
                self.writer.submit(lambda: self._write_metrics(history), optional=True,  # the next rewrites it
                                   what=f"the metrics log of epoch {epoch} ({self.run_dir.logs_path})")
        report(epoch=epoch, **logs)
        return bool(self.trainer.hvd.broadcast_object(bool(stop), root_rank=0))

    def _checkpoint(self, epoch: int) -> bool:
        """Rank 0: snapshot the state to local disk and hand its upload to the writer (in the background under
        ``checkpoint_upload="async"``). False when skipped (``checkpoint_when_busy="skip"`` and one in flight)."""
        if self.writer.when_busy == "skip" and self.writer.busy():
            self.writer.skipped += 1
            log.info("run %s: checkpoint of epoch %d skipped: the previous one is still uploading",
                     self.spec.run_id, epoch)
            return False
        snapshot = self._snapshot("spark_hvd_ckpt_")
        history = copy.deepcopy(self.history)
        def write() -> None:
            self._commit(epoch, snapshot, history)
            if self._trigger.enabled:  # the epoch's end supersedes its step checkpoints
                self.run_dir.delete_step_checkpoints(before=(epoch + 1, 0))

        submitted = self.writer.submit(write,
                                       what=f"run {self.spec.run_id}: the checkpoint of epoch {epoch} "
                                            f"({self.run_dir.checkpoint_path(epoch)})",
                                       checkpoint=True, cleanup=lambda: shutil.rmtree(snapshot, ignore_errors=True))
        if not submitted:
            shutil.rmtree(snapshot, ignore_errors=True)
            return False
        self._checkpointed = True
        return True

    def _snapshot(self, prefix: str) -> str:
        """A new local directory holding the trainer's checkpoint (removed again when the trainer fails to write)."""
        snapshot = tempfile.mkdtemp(prefix=prefix)
        try:
            self.trainer.save_checkpoint(snapshot)
        except BaseException:
            shutil.rmtree(snapshot, ignore_errors=True)
            raise
        return snapshot

    def _commit(self, epoch: int, snapshot: str, history: dict) -> None:
        """Commit the local ``snapshot`` as the checkpoint of ``epoch`` (with the history in its state), delete the
        epochs neither among the newest ``keep_checkpoints`` nor the best ``keep_best_checkpoints``
        (``retention.kept_epochs``), then write the metrics log."""
        self.run_dir.write_checkpoint(epoch, snapshot, {"history": history, "num_proc": self.size})
        keep = getattr(self.spec, "keep_checkpoints", None)
        keep_best = getattr(self.spec, "keep_best_checkpoints", None)
        if keep or keep_best:  # retention: only once this one is committed
            epochs = self.run_dir.list_checkpoints()
            kept = kept_epochs(epochs, history, keep, keep_best, getattr(self.spec, "monitor", None))
            for old in epochs:
                if old not in kept:
                    self.spec.store.delete(self.run_dir.checkpoint_path(old))
        self._write_metrics(history)

    def _write_metrics(self, history: dict) -> None:
        """``history`` as ``logs/metrics.jsonl`` and as TensorBoard scalars (``train/<name>``, ``val/<name>``,
        step = epoch; ``spark_hvd.estimators.common.tensorboard``) beside it."""
        self.run_dir.write_metrics(history)
        if self._events is None:
            from spark_hvd.estimators.common.tensorboard import EventFileWriter

            self._events = EventFileWriter(self.spec.store, self.run_dir.logs_path)
        self._events.write_history(history)

    def _load_best(self) -> None:
        """Rank 0, ``final_model="best"``: load the kept epoch checkpoint best by ``monitor`` (the next best when one
        does not verify); without any value of ``monitor`` in the history, the last state stays, with a warning."""
        policy = self.spec.monitor
        ranked = best_epochs(self.run_dir.list_checkpoints(), self.history, policy)
        for epoch in ranked:
            with tempfile.TemporaryDirectory() as tmp:
                if self.run_dir.latest_checkpoint(tmp, only={epoch}) is not None:
                    self.trainer.load_checkpoint(tmp)
                    self.final_epoch = epoch
                    log.info("run %s: the final model is epoch %d's, best by %s", self.spec.run_id, epoch,
                             policy.monitor)
                    return
        log.warning("run %s: final_model='best' but no kept checkpoint has a %r value (history keys %s): the "
                    "final model is the last state", self.spec.run_id, policy.monitor, sorted(self.history))

    def first_batch(self) -> dict:
        """One batch of this rank's training data (for shapes)."""
        gen = self.readers.epoch("train", 0)
        try:
            return next(gen)
        finally:
            gen.close()

    # ---- finish
    def _finish(self) -> dict | None:
        if self.rank != 0:
            return None
        self.writer.wait()  # the last checkpoint is uploaded (or its failure raised) before the final model
        self.writer.close()
        if self.spec.best is not None:
            with tempfile.TemporaryDirectory() as tmp:  # the best epoch's state
                if self.run_dir.latest_checkpoint(tmp) is not None:
                    self.trainer.load_checkpoint(tmp)
        elif getattr(self.spec, "final_model", "last") == "best":
            self._load_best()
        output_shapes = self.trainer.output_shapes(self.first_batch())
        with tempfile.TemporaryDirectory() as tmp:
            self.trainer.save_model(tmp)
            write_with_retries(lambda: self.run_dir.write_model(tmp),
                               what=f"run {self.spec.run_id}: the final model ({self.run_dir.model_path})")
        return {"history": self.history, "output_shapes": output_shapes, "final_epoch": self.final_epoch}


@contextlib.contextmanager
def start_method(method: str | None) -> Iterator[None]:
    """Python's multiprocessing start method set to ``method`` (the ``mp_start_method`` param, as Horovod sets it
    in its ranks) for the block, then the one before it again (the process may run later Spark tasks); None: as
    it is."""
    import multiprocessing

    if method is None:
        yield
        return
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(method, force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(before, force=True)


def merged_progress(progress: list[dict]) -> dict:
    """The running sums of an epoch of several ranks as one rank's (a resume on another number of ranks: rank 0
    carries them all, the others start from zero; the epoch's metrics sum over the ranks, so they come out the
    same). ``progress``: by rank, ``{"acc": {name: sum}, "rows": n}`` as the torch loop keeps them."""
    acc: dict[str, float] = {}
    rows = 0
    for p in progress:
        for key, value in (p.get("acc") or {}).items():
            acc[key] = acc.get(key, 0.0) + float(value)
        rows += int(p.get("rows", 0))
    return {"acc": acc, "rows": rows}


def check_finite(loss: float, epoch: int, step: int, rank: int) -> None:
    """Raise ``FloatingPointError`` naming the epoch, step and rank when the training loss is NaN or infinite."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"the training loss is {loss} at epoch {epoch}, step {step} (rank {rank}): training diverged. Lower the "
            "learning rate, check the data for NaN/inf, or set terminate_on_nan=False to continue anyway")


def train_on_rank(trainer_class: type[RankTrainer], spec: TrainSpec) -> dict | None:
    """The training function of every rank (run by ``spark_hvd.runner``): a ``RankRun`` with a new
    ``trainer_class``; rank 0 returns the history and output shapes. Frameworks log quietly
    (``QUIET_FRAMEWORK_LOGS``, before they are imported) unless the rank's environment says otherwise."""
    for name, value in QUIET_FRAMEWORK_LOGS.items():
        os.environ.setdefault(name, value)
    return RankRun(spec, trainer_class()).execute()
