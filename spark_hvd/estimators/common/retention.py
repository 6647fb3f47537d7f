"""Which epoch checkpoints a run keeps (``keep_checkpoints``, ``keep_best_checkpoints`` by ``monitor``) and which
one is the final model under ``final_model="best"``.

An epoch's score is ``history[monitor][epoch]`` (the history holds one value per epoch from the run's first, a
resumed run's included); epochs without a value are never "best". Ties go to the earlier epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

from spark_hvd.estimators.common.spec import BestPolicy

__all__ = ["best_epochs", "kept_epochs"]


def best_epochs(epochs: Sequence[int], history: dict[str, list[float]], policy: BestPolicy) -> list[int]:
    """``epochs`` that have a ``policy.monitor`` value in ``history``, best first."""
    values = history.get(policy.monitor, [])
    scored = [(values[e], e) for e in epochs if 0 <= e < len(values)]
    sign = -1.0 if policy.mode == "max" else 1.0
    return [e for _, e in sorted(scored, key=lambda item: (sign * item[0], item[1]))]


def kept_epochs(epochs: Sequence[int], history: dict[str, list[float]], keep: int | None,
                keep_best: int | None, policy: BestPolicy | None) -> set[int]:
    """The checkpoints to keep of ``epochs`` (committed, ascending): the newest ``keep`` (all when None, the
    newest one when only ``keep_best`` is set: a resume needs it) and the ``keep_best`` best by ``policy``."""
    epochs = sorted(epochs)
    if keep is None and not keep_best:
        return set(epochs)
    kept = set(epochs[-(keep or 1):])
    if keep_best and policy is not None:
        kept |= set(best_epochs(epochs, history, policy)[:keep_best])
    return kept
