"""``RunDir``: the one owner of a training run's directory in a store, ``<prefix>/runs/<run_id>/``.

Layout::

    runs/<run_id>/checkpoints/epoch-<e>/   a checkpoint: the framework's files and state.json, committed atomically
    runs/<run_id>/checkpoints/step-<e>-<s>/  a checkpoint after batch <s> of epoch <e> (only the newest is kept)
    runs/<run_id>/logs/metrics.jsonl       one JSON line per epoch (TensorBoard events beside it)
    runs/<run_id>/model/                   the final model, committed atomically

A checkpoint is committed like every atomic directory of a store (``Store.atomic_dir``: files aside, fsynced, a
manifest of sizes and checksums written last; a committed version is replaced only once its successor is
committed). ``state.json`` inside it holds what resumes the run (``{"epoch": e, "history": {...}, ...}``).

Reading one back downloads it once and checks the local copy against its manifest (:meth:`RunDir.latest_checkpoint`):
the newest one that verifies wins; a newer one that does not is skipped with a warning saying why, and left in place
until that epoch is written again. Step checkpoints (:meth:`RunDir.write_step_checkpoint`) are read back the same way
(:meth:`RunDir.latest_step_checkpoint`). Checkpoint names are made and parsed here alone (``_NAME``, ``_STEP_NAME``
and their patterns). What a step checkpoint holds beyond the framework's files is the estimators' business
(``spark_hvd.estimators.common.step_checkpoint``): to this class it is a directory.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import shutil
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spark_hvd.store import atomic
from spark_hvd.store.manifest import LEGACY_MARKER, MANIFEST, Manifest

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.store.base import Store

__all__ = ["Checkpoint", "RunDir"]

logger = logging.getLogger(__name__)

_NAME = "epoch-{epoch}"
_NAME_RE = re.compile(r"^epoch-(\d+)$")
_STEP_NAME = "step-{epoch}-{step}"
_STEP_RE = re.compile(r"^step-(\d+)-(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read back: its epoch, its store path, the local directory holding the verified copy, and its
    ``state.json`` (empty for a checkpoint written without one)."""

    epoch: int
    path: str
    local_dir: str
    state: dict[str, Any] = field(default_factory=dict)
    step: int | None = None  #: batches of ``epoch`` done, for a step checkpoint; None for an epoch's end


class RunDir:
    """``runs/<run_id>/`` of ``store``: checkpoints, the metrics log, the final model.

    Raises ``ValueError`` at construction for a ``run_id`` that is not a plain name.
    """

    STATE = "state.json"
    METRICS = "metrics.jsonl"

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.path = store.run_path(run_id)

    def __repr__(self) -> str:
        return f"RunDir({self.store!r}, {self.run_id!r})"

    # ------------------------------------------------------------------ layout
    @property
    def checkpoints_path(self) -> str:
        """``runs/<run_id>/checkpoints``."""
        return posixpath.join(self.path, "checkpoints")

    def checkpoint_path(self, epoch: int) -> str:
        """``runs/<run_id>/checkpoints/epoch-<epoch>``."""
        if int(epoch) < 0:
            raise ValueError(f"checkpoint epoch must be >= 0, got {epoch}")
        return posixpath.join(self.checkpoints_path, _NAME.format(epoch=int(epoch)))

    @property
    def logs_path(self) -> str:
        """``runs/<run_id>/logs``: the metrics log, TensorBoard events."""
        return posixpath.join(self.path, "logs")

    @property
    def model_path(self) -> str:
        """``runs/<run_id>/model``: the final model."""
        return posixpath.join(self.path, "model")

    # ------------------------------------------------------------------ checkpoints
    def write_checkpoint(self, epoch: int, local_dir: str, state: dict[str, Any] | None = None) -> str:
        """Commit the local directory ``local_dir`` as the checkpoint of ``epoch`` (``state``, when given, is
        written into it first as ``state.json``, with the epoch and the time); returns its store path."""
        if state is not None:
            with open(os.path.join(local_dir, self.STATE), "w") as f:
                json.dump({"epoch": int(epoch), **state, "time": time.time()}, f)
        final = self.checkpoint_path(epoch)
        with self.store.atomic_dir(final) as target:
            self.store.upload_dir(local_dir, target)
        return final

    def list_checkpoints(self) -> list[int]:
        """The epochs of the committed checkpoints (a manifest present; not verified), ascending."""
        epochs = []
        for name in self.store.listdir(self.checkpoints_path):
            m = _NAME_RE.match(name)
            if m and self.store.is_committed(posixpath.join(self.checkpoints_path, name)):
                epochs.append(int(m.group(1)))
        return sorted(epochs)

    def latest_checkpoint(self, local_dir: str, only: Collection[int] | None = None) -> Checkpoint | None:
        """Download the newest checkpoint that verifies into ``local_dir`` (emptied first) and return it; None when
        there is none. ``only``: consider only the checkpoints of these epochs.

        Each candidate is downloaded once and its local copy checked against its manifest; one that fails is
        skipped with a warning saying why (and left in place: it is replaced when that epoch is written again).
        Called when a run starts, so it tidies the checkpoint directory first: interrupted replacements are
        finished, stale temporary directories and partial epochs (no manifest, no marker) deleted.
        """
        root = self.checkpoints_path
        atomic.recover(self.store, root)
        epochs = []
        for name in self.store.listdir(root):
            m = _NAME_RE.match(name)
            if m and (only is None or int(m.group(1)) in only):
                epochs.append((int(m.group(1)), posixpath.join(root, name)))
        for epoch, path in sorted(epochs, reverse=True):
            if self._fetch(path, local_dir, f"the checkpoint of epoch {epoch}"):
                return Checkpoint(epoch, path, local_dir, self._read_state(local_dir))
        _empty(local_dir)
        return None

    # ------------------------------------------------------------------ step checkpoints
    def step_checkpoint_path(self, epoch: int, step: int) -> str:
        """``runs/<run_id>/checkpoints/step-<epoch>-<step>``: after batch ``step`` (1-based) of ``epoch``."""
        if int(epoch) < 0 or int(step) < 1:
            raise ValueError(f"a step checkpoint needs epoch >= 0 and step >= 1, got {epoch}, {step}")
        return posixpath.join(self.checkpoints_path, _STEP_NAME.format(epoch=int(epoch), step=int(step)))

    def step_checkpoints(self) -> list[tuple[tuple[int, int], str]]:
        """The run's step checkpoints, committed or not, newest first: ``((epoch, step), path)``."""
        found = []
        for name in self.store.listdir(self.checkpoints_path):
            m = _STEP_RE.match(name)
            if m:
                found.append(((int(m.group(1)), int(m.group(2))), posixpath.join(self.checkpoints_path, name)))
        return sorted(found, reverse=True)

    def write_step_checkpoint(self, epoch: int, step: int, local_dir: str) -> str:
        """Commit ``local_dir`` as the checkpoint after batch ``step`` of ``epoch``, then delete the older step
        checkpoints (only the newest is kept); returns its store path."""
        final = self.step_checkpoint_path(epoch, step)
        with self.store.atomic_dir(final) as target:
            self.store.upload_dir(local_dir, target)
        self.delete_step_checkpoints(before=(epoch, step))
        return final

    def delete_step_checkpoints(self, before: tuple[int, int]) -> None:
        """Delete the step checkpoints older than ``(epoch, step)``; the end of epoch ``e`` is ``(e + 1, 0)``."""
        for position, path in self.step_checkpoints():
            if position < before:
                self.store.delete(path)

    def latest_step_checkpoint(self, local_dir: str, after: tuple[int, int]) -> Checkpoint | None:
        """Download the newest step checkpoint later than ``after`` (``(epoch, step)``) that verifies into
        ``local_dir`` (emptied first), as :meth:`latest_checkpoint` does; None when there is none."""
        atomic.recover(self.store, self.checkpoints_path)
        for (epoch, step), path in self.step_checkpoints():
            if (epoch, step) <= after:
                break
            if self._fetch(path, local_dir, f"the checkpoint after batch {step} of epoch {epoch}"):
                return Checkpoint(epoch, path, local_dir, step=step)
        _empty(local_dir)
        return None

    def _fetch(self, path: str, local_dir: str, what: str) -> bool:
        """Download the committed directory ``path`` once into ``local_dir`` (emptied first) and check the local copy
        against its manifest: True when it verifies. A directory never committed (no manifest, no marker) is
        deleted; one that fails is left in place and logged with the reason."""
        try:
            manifest = Manifest.loads(self.store.read_bytes(posixpath.join(path, MANIFEST)))
        except FileNotFoundError:
            if not self.store.exists(posixpath.join(path, LEGACY_MARKER)):
                logger.info("run %s: deleting %s, never committed (%s)", self.run_id, what, path)
                self.store.delete(path)
                return False
            problem = f"it has only the {LEGACY_MARKER} marker of a spark_hvd without manifests: cannot verify"
        except ValueError as e:
            problem = f"its manifest is unreadable: {e}"
        else:
            _empty(local_dir)
            self.store.download_dir(path, local_dir)
            problem = manifest.problem_in_local_copy(local_dir)
            if problem is None:
                return True
        logger.warning("run %s: skipping %s in %r: %s", self.run_id, what, self.store, problem)
        return False

    def _read_state(self, local_dir: str) -> dict[str, Any]:
        try:
            with open(os.path.join(local_dir, self.STATE)) as f:
                return dict(json.load(f))
        except FileNotFoundError:
            return {}

    # ------------------------------------------------------------------ metrics, final model
    def write_metrics(self, history: dict[str, list[float]]) -> str:
        """Rewrite ``logs/metrics.jsonl``: one line per epoch so far (the store has no append); returns its path."""
        n = max((len(v) for v in history.values()), default=0)
        lines = [json.dumps({"epoch": e, **{k: v[e] for k, v in history.items() if e < len(v)}}) for e in range(n)]
        path = posixpath.join(self.logs_path, self.METRICS)
        self.store.write_bytes(path, ("\n".join(lines) + "\n").encode())
        return path

    def write_model(self, local_dir: str) -> None:
        """Commit the local directory ``local_dir`` as ``runs/<run_id>/model``."""
        with self.store.atomic_dir(self.model_path) as target:
            self.store.upload_dir(local_dir, target)

    def read_model_file(self, name: str) -> bytes:
        """A file of the final model directory."""
        return self.store.read_bytes(posixpath.join(self.model_path, name))


def _empty(local_dir: str) -> None:
    """Make ``local_dir`` an empty directory (a failed candidate's files must not mix with the next one's)."""
    if os.path.isdir(local_dir):
        for entry in os.listdir(local_dir):
            full = os.path.join(local_dir, entry)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full)
            else:
                os.remove(full)
    os.makedirs(local_dir, exist_ok=True)
