"""Horovod's build queries for torch: what this torch installation can use (NCCL, CUDA, ROCm)."""

from __future__ import annotations

import torch


def nccl_built() -> int:
    """NCCL's version as Horovod encodes it (2.7.8 -> 2708; ``major*1000 + minor*100 + patch`` below 2.9, then
    ``major*10000 + minor*100 + patch``), or 0 when torch has no CUDA/NCCL. Truthy exactly when NCCL is usable
    through the core's torch backend."""
    if not (torch.cuda.is_available() and torch.distributed.is_available()
            and torch.distributed.is_nccl_available()):
        return 0
    try:
        major, minor, patch = (int(x) for x in torch.cuda.nccl.version()[:3])
    except Exception:  # noqa: BLE001 - a build whose NCCL version cannot be read still has NCCL
        return 1
    return major * (10000 if (major, minor) >= (2, 9) else 1000) + minor * 100 + patch


def cuda_built() -> bool:
    """True when torch was built with CUDA (Horovod: built with CUDA support)."""
    return torch.backends.cuda.is_built() and torch.version.cuda is not None


def rocm_built() -> bool:
    """True when torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None
