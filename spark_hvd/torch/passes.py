"""``backward_passes_per_step`` in the gradient hooks of both torch optimizers (``DistributedOptimizer`` and its
Adasum form): each parameter's passes are counted down from ``backward_passes_per_step`` between optimizer steps; its
gradient is handed on at the last one, and one pass more is an error that names the parameter."""

from __future__ import annotations

from typing import Any

__all__ = ["count_pass"]


def count_pass(optimizer: Any, pid: int, before: str) -> bool:
    """Count one backward pass of the parameter ``id`` ``pid`` in ``optimizer._hvd_delay``; True at the step's last
    one (its gradient is then complete). Raises ``AssertionError`` (Horovod's) naming the parameter when it has had
    ``backward_passes_per_step`` passes already, before ``before`` (what should have come first)."""
    delay = optimizer._hvd_delay
    if delay[pid] <= 0:
        raise AssertionError(
            f"gradient of parameter {optimizer._hvd_names[pid]!r} was computed more than backward_passes_per_step="
            f"{optimizer.backward_passes_per_step} times before {before}; increase backward_passes_per_step to "
            "accumulate gradients locally")
    delay[pid] -= 1
    return delay[pid] == 0
