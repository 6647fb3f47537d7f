"""Mixed precision for the torch loop: ``torch.autocast`` on the rank's device, and a ``GradScaler`` for fp16.

``TorchEstimator(mixed_precision="bf16" | "fp16" | None)``. ``bf16`` runs the forward pass (and the loss) under
autocast in bfloat16: no loss scaling is needed (bfloat16 has float32's exponent range). ``fp16`` runs it in
float16 and scales the loss with ``torch.amp.GradScaler`` so that small gradients do not flush to zero; the
unscaling has to happen *after* the gradients were averaged over the ranks, Horovod's pattern::

    scaler.scale(loss).backward()        # DistributedOptimizer's hooks start the allreduces of scaled gradients
    optimizer.synchronize()               # averaged (still scaled) gradients in p.grad
    scaler.unscale_(optimizer)            # divided by the scale; inf/nan found here is the same on every rank
    with optimizer.skip_synchronize():
        scaler.step(optimizer)            # skipped on every rank alike when the averaged gradients overflowed
    scaler.update()

Every rank sees the same averaged gradients, so every rank finds the same overflow, skips the same steps and
keeps the same scale: the ranks never disagree on whether a collective runs. Parameters and optimizer state stay
float32 (autocast changes only the dtype of operations).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

__all__ = ["MIXED_PRECISION", "MixedPrecision"]

#: the accepted values of ``mixed_precision`` (None: float32)
MIXED_PRECISION = ("bf16", "fp16")


class MixedPrecision:
    """One rank's autocast context and (fp16) gradient scaler; ``mode`` None is plain float32 (all no-ops)."""

    def __init__(self, mode: str | None, device: Any, rank: int = 0) -> None:
        import torch

        if mode is not None and mode not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision must be one of {list(MIXED_PRECISION)} or None, got {mode!r}")
        self.mode = mode
        self.device_type = device.type
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode or "")
        if self.dtype is not None:
            _check_autocast(self.device_type, self.dtype, mode, rank)
        self.scaler = torch.amp.GradScaler(self.device_type) if mode == "fp16" else None

    def autocast(self) -> Any:
        """The context the forward pass and the loss run in."""
        import torch

        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: Any) -> None:
        """``loss.backward()``, of the scaled loss under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: Any) -> None:
        """The update of a ``spark_hvd.torch.DistributedOptimizer``: under fp16 the averaged gradients are
        unscaled before the step (skipped on overflow) and the scale is updated (see the module docstring)."""
        if self.scaler is None:
            optimizer.step()
            return
        optimizer.synchronize()
        self.scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict | None:
        """The scaler's state (None without one), for checkpoints."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        """Restore what ``state_dict`` gave (ignored without a scaler or a state)."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def _check_autocast(device_type: str, dtype: Any, mode: str, rank: int) -> None:
    """Raise ``ValueError`` when this torch cannot autocast to ``dtype`` on ``device_type`` (older torch builds
    disable CPU float16 autocast with only a warning: the run would silently be float32)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autocast(device_type, dtype=dtype):
                enabled = torch.is_autocast_enabled(device_type)
        except (RuntimeError, TypeError) as exc:
            enabled, caught = False, [str(exc)]
    if not enabled:
        why = "; ".join(str(getattr(w, "message", w)) for w in caught) or "autocast stayed disabled"
        raise ValueError(f"rank {rank}: mixed_precision={mode!r} needs torch.autocast with {dtype} on the "
                         f"{device_type} device, which this torch {torch.__version__} does not offer ({why}). Use "
                         "a GPU (use_gpu), mixed_precision='bf16', or None")
