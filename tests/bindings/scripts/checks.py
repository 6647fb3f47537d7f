"""The worker scripts' harness: ``@check(name)`` runs the function at once and records "ok" or its traceback in
``results`` (written to JSON for pytest), so one failing check does not stop the others."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Container, Iterable
from typing import Any


def setup_tensorflow() -> None:
    """Before Keras is imported: Keras on TensorFlow, TensorFlow's logs quiet, one intra-op thread and two
    inter-op threads per rank (the ranks share a small machine)."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)


def make_check(results: dict[str, str], *, only: Container[str] | None = None,
               after: Callable[[], object] | None = None) -> Callable:
    """A ``check(name)`` decorator; ``only``: run just these names; ``after``: called after every check that ran
    (a barrier so every check starts together, or a reset of global state)."""
    def check(name: str) -> Callable:
        def deco(fn: Callable) -> Callable:
            if only is not None and name not in only:
                return fn
            try:
                fn()
                results[name] = "ok"
            except Exception:  # noqa: BLE001 - recorded for pytest
                results[name] = traceback.format_exc()
            finally:
                if after is not None:
                    after()
            return fn
        return deco
    return check


def expect_errors(cases: Iterable[tuple[Callable[[], object], str]],
                  error: type[BaseException] | tuple[type[BaseException], ...] = ValueError) -> None:
    """Each ``(call, words)``: ``call()`` raises ``error`` with ``words`` in its message."""
    for call, words in cases:
        try:
            call()
        except error as exc:
            assert words in str(exc), f"{words!r} not in: {exc}"
        else:
            raise AssertionError(f"no error ({words})")


def adasum_tree(vectors: list[Any]) -> Any:
    """Adasum of the ranks' arrays in numpy (N a power of two): neighbours pairwise, then pairs of pairs."""
    import numpy as np

    def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a, b = a.astype(np.float64), b.astype(np.float64)
        dot = float(np.sum(a * b))
        return (1 - dot / (2 * np.sum(a * a))) * a + (1 - dot / (2 * np.sum(b * b))) * b
    while len(vectors) > 1:
        vectors = [pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]
