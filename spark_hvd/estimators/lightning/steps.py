"""Step checkpoints of ``LightningEstimator`` (``checkpoint_every_steps`` / ``checkpoint_every_seconds``): a
resume continues inside the epoch at the exact batch, as it does for ``TorchEstimator`` (``common/step_checkpoint.py``).

The checkpoint is taken where Lightning's own ``ModelCheckpoint(every_n_train_steps=...)`` takes one, in
``on_train_batch_end`` (the bridge's, after the user's callbacks): ``RankRun.step_end`` decides whether one is due,
snapshots Lightning's full state on rank 0 (``LightningTrainer.save_checkpoint``: model, optimizers, LR schedulers,
precision scaler, the user's callbacks' state, and the loops' progress, which says how many batches of the epoch are
done) and uploads it with the shared step-checkpoint code (async upload, manifest last, newest kept); every rank's
random generators and the epoch's running sums of the history go with it (``StepState``).

A resumed run hands that state to ``Trainer.fit(ckpt_path=...)``: Lightning then restarts inside the epoch (it
calls neither ``on_train_epoch_start`` nor the schedulers again). What Lightning does not restore, this file does:

- the data: the dataloader is spark_hvd's, not resumable by Lightning; the resumed epoch's iterator reads the
  rank's shard again in the same order (a function of the seed, the epoch and the batch index) and drops the
  batches already trained (``RankRun.start_step``), so the next batch is the one an uninterrupted run had;
- the random generators (Python, numpy, torch): ``RankRun`` restores them before the fit, but Lightning draws from
  torch's generator when it makes the dataloader's iterator (torch's DataLoader seeds its workers), so they are
  put back again in ``on_train_start``, after that draw and before the first batch;
- the history's running sums of the epoch, training and validation (a validation inside the epoch,
  ``val_check_interval``, counts in the epoch's values; ``on_train_epoch_start``, which starts them, is not called
  again).

No step checkpoint is taken after an epoch's last batch (the epoch's own checkpoint follows at its end; Lightning,
resuming from there, would skip the epoch's end hooks, validation and the history's epoch), nor after a batch that
a validation run follows (``val_check_interval`` inside the epoch: Lightning, resuming there, skips that
validation), nor in the middle of a gradient accumulation (``backward_passes_per_step``: a half-accumulated
gradient is not in any checkpoint).
"""

from __future__ import annotations

import logging
from typing import Any

from spark_hvd.estimators.common.rank_run import RankRun, merged_progress
from spark_hvd.estimators.common.step_checkpoint import rng_state, set_rng_state

__all__ = ["StepCheckpoints", "align_batch_progress", "resized_progress", "validation_follows"]

log = logging.getLogger(__name__)

#: Lightning's warning about resuming mid-epoch with a dataloader it cannot resume (ours skips to the batch itself)
NOT_RESUMABLE_WARNING = ".*dataloader is not resumable.*"


class StepCheckpoints:
    """The step-checkpoint half of the Lightning bridge (see the module docstring), for one ``Trainer.fit``."""

    def __init__(self, owner: Any, run: RankRun) -> None:
        self.owner, self.run = owner, run
        #: batches of epoch ``run.start`` to drop from the training iterator, once (a mid-epoch resume)
        self.skip = run.start_step
        #: this rank's random generators as the step checkpoint had them (RankRun restored them before the fit)
        self.rngs = rng_state() if run.start_step else None

    def train_skip(self, epoch: int) -> int:
        """The batches to drop from the start of ``epoch``'s training iterator (only the resumed epoch's first)."""
        if epoch != self.run.start or not self.skip:
            return 0
        skip, self.skip = self.skip, 0
        return skip

    def train_start(self, recorder_class: type) -> None:
        """``on_train_start`` of a mid-epoch resume: the epoch's running sums and the random generators back."""
        if self.rngs is None:
            return
        progress = self.run.resume_progress or {}
        rec = recorder_class()
        rec.train = dict(progress.get("acc") or {})
        rec.train_rows = int(progress.get("rows", 0))
        rec.outside = dict(progress.get("outside") or {})
        rec.lr = progress.get("lr")
        rec.val = dict(progress.get("val") or {})
        rec.val_rows = int(progress.get("val_rows", 0))
        rec.val_returned = progress.get("val_returned")
        self.owner.recorder = rec
        set_rng_state(self.rngs)
        self.rngs = None

    def batch_end(self, trainer: Any, batch_idx: int) -> None:
        """After the bridge recorded batch ``batch_idx``: a step checkpoint when one is due (every rank calls it)."""
        run = self.run
        if not run.checkpoints_inside_epochs:
            return
        if batch_idx + 1 >= run.readers.steps("train") or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        if validation_follows(trainer):
            return
        rec = self.owner.recorder
        run.step_end(trainer.current_epoch, batch_idx, {
            "acc": rec.train, "rows": rec.train_rows, "outside": rec.outside, "lr": rec.lr,
            "val": rec.val, "val_rows": rec.val_rows, "val_returned": rec.val_returned})


def validation_follows(trainer: Any) -> bool:
    """Whether Lightning runs a validation right after the batch that just ended (Lightning's own decision, which
    is not public API: False where this Lightning has no such method)."""
    loop = trainer.fit_loop
    decide = getattr(loop.epoch_loop, "_should_check_val_fx", None)
    fetcher = getattr(loop, "_data_fetcher", None)
    return bool(decide(fetcher)) if decide is not None and fetcher is not None else False


def resized_progress(progress: list[dict], rank: int) -> dict:
    """A step checkpoint of another number of ranks (an elastic relaunch): rank 0 carries every old rank's sums,
    training and validation (the epoch's metrics sum over the ranks), the others start from zero; the values logged
    outside a batch and the epoch's rate are old rank 0's on every rank."""
    first = progress[0] if progress else {}
    if rank:
        return {"acc": {}, "rows": 0, "outside": dict(first.get("outside") or {}), "lr": first.get("lr")}
    val: dict[str, float] = {}
    for p in progress:
        for key, value in (p.get("val") or {}).items():
            val[key] = val.get(key, 0.0) + float(value)
    returned = [p["val_returned"] for p in progress if p.get("val_returned") is not None]
    return {**merged_progress(progress), "outside": dict(first.get("outside") or {}), "lr": first.get("lr"),
            "val": val, "val_rows": sum(int(p.get("val_rows", 0)) for p in progress),
            "val_returned": sum(returned) if returned else None}


def align_batch_progress(state: dict, step: int) -> None:
    """Make a Lightning checkpoint taken in ``on_train_batch_end`` say ``step`` batches of its epoch are done (an
    elastic relaunch on another number of ranks maps the batch to the same fraction of the epoch of the new shard;
    ``RankRun._map_resume_step``). The epoch's and the run's batch counters move by the same difference."""
    progress = state.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not progress:
        return
    delta = step - int(progress["current"]["ready"])
    if not delta:
        return
    for part in ("current", "total"):
        for key in ("ready", "started", "processed", "completed"):
            progress[part][key] = max(0, int(progress[part][key]) + delta)
    log.info("the Lightning checkpoint's batch of the epoch moved by %+d to %d", delta, step)
