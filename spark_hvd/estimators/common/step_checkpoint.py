"""Checkpoints inside an epoch: when one is due, what it holds beyond the model, and where it lives.

A step checkpoint taken after batch ``s`` (1-based count) of epoch ``e`` resumes the run exactly there: the
framework's state (``RankTrainer.save_checkpoint``), the history of the finished epochs, the loop's running
sums of the epoch (``progress``) and every rank's random generators (Python, numpy, torch) are in it. A rank's
batches are a function of ``(seed, epoch, batch index)`` (``spark_hvd.data.BatchReader`` shuffles with a
generator seeded per epoch), so the reader's position is the batch index: the resumed rank reads its shard's
epoch again from the start and drops the first ``s`` batches before training on the next one.

Where it lives is ``RunDir``'s (``runs/<run_id>/checkpoints/step-<e>-<s>/`` beside the per-epoch ``epoch-<e>/``
ones, committed the same way, read back once and checked against its manifest). Only the newest is kept: a newer
step checkpoint, or the checkpoint of its epoch's end, replaces it.
"""

from __future__ import annotations

import pickle
import posixpath
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from spark_hvd.store.run_dir import RunDir

__all__ = ["StepTrigger", "StepState", "rng_state", "set_rng_state", "write_step_checkpoint",
           "latest_step_checkpoint"]

STEP_STATE = "step_state.pkl"


# ------------------------------------------------------------------------------------------------ random state
def rng_state() -> dict[str, Any]:
    """This process's random generators: Python's, numpy's global one, torch's CPU (and CUDA) ones."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state()}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what ``rng_state`` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in state:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------ when
class StepTrigger:
    """Whether a step checkpoint is due after a batch: every ``every_steps`` optimizer steps counted over the whole
    run (so a resumed run keeps the same schedule) and/or when ``every_seconds`` passed since the last one (rank 0's
    clock, broadcast so every rank agrees). Only at the end of a ``backward_passes_per_step`` cycle, where no
    gradient is half accumulated."""

    def __init__(self, every_steps: int | None, every_seconds: float | None, backward_passes: int = 1) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.backward_passes = max(1, backward_passes)
        self._last = time.monotonic()

    @property
    def enabled(self) -> bool:
        """Whether any step checkpoint can be due."""
        return bool(self.every_steps) or bool(self.every_seconds)

    def due(self, global_batch: int, hvd: Any) -> bool:
        """After batch number ``global_batch`` (1-based, over the whole run); collective when ``every_seconds``."""
        if global_batch % self.backward_passes:
            return False
        due = bool(self.every_steps) and (global_batch // self.backward_passes) % self.every_steps == 0
        if self.every_seconds:
            late = time.monotonic() - self._last >= self.every_seconds
            due = bool(hvd.broadcast_object(due or late, root_rank=0))
        if due:
            self._last = time.monotonic()
        return due


# ------------------------------------------------------------------------------------------------ where
@dataclass(frozen=True)
class StepState:
    """What resumes a run mid-epoch (besides the framework's files): ``step`` batches of ``epoch`` are done."""

    epoch: int
    step: int
    history: dict
    progress: list  #: the loop's running sums of the epoch on every rank, by rank
    rngs: list  #: ``rng_state()`` of every rank, by rank
    steps: int | None = None  #: batches per epoch on each rank when it was taken (``len(rngs)`` ranks)


def write_step_checkpoint(store: Any, run_id: str, local_dir: str, state: StepState) -> str:
    """Commit ``local_dir`` plus ``state`` as the run's step checkpoint ``(state.epoch, state.step)`` (the older ones
    are deleted: :meth:`RunDir.write_step_checkpoint`); returns its store path."""
    with open(posixpath.join(local_dir, STEP_STATE), "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
    return RunDir(store, run_id).write_step_checkpoint(state.epoch, state.step, local_dir)


def latest_step_checkpoint(store: Any, run_id: str, local_dir: str, after: tuple[int, int]) -> StepState | None:
    """Download the newest step checkpoint later than ``after`` (``(epoch, step)``) that verifies into
    ``local_dir``; its ``StepState``, or None."""
    if RunDir(store, run_id).latest_step_checkpoint(local_dir, after) is None:
        return None
    with open(posixpath.join(local_dir, STEP_STATE), "rb") as f:
        return pickle.load(f)
