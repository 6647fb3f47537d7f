"""Settings of the core, read once from the environment into a frozen dataclass.

Each setting has a spark_hvd name and the Horovod name accepted as an alias, so Horovod users can migrate
without changing their job configuration. The spark_hvd name wins when both are set.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MIB = 1024 * 1024
#: An unset stall-shutdown time is this many stall-check periods (the default 60 s check: 180 s).
STALL_SHUTDOWN_PERIODS = 3


def _setting(name: str, alias: str | None, default: Any, parse: Callable[[str], Any], doc: str) -> Any:
    return field(default=default, metadata={"env": name, "alias": alias, "parse": parse, "doc": doc})


def _optional_str(value: str) -> str | None:
    return value or None


def _choice(*allowed: str) -> Callable[[str], str | None]:
    def parse(value: str) -> str | None:
        value = value.strip().lower()
        if value and value not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return value or None

    return parse


def _at_least(low: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        number = int(value)
        if number < low:
            raise ValueError(f"expected an integer >= {low}")
        return number

    return parse


def _bool(value: str) -> bool:
    return value.strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class Settings:
    """The core's tunables. ``Settings.from_env()`` reads them; tests build one directly."""

    fusion_threshold: int = _setting(
        "SPARK_HVD_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD", 64 * MIB, int,
        "most bytes packed into one fusion buffer per collective (shared memory needs no buffer: a round's "
        "tensors go in one collective)")
    cycle_time_ms: float = _setting(
        "SPARK_HVD_CYCLE_TIME", "HOROVOD_CYCLE_TIME", 1.0, float,
        "milliseconds the engine collects submissions before a negotiation round (a caller waiting on a "
        "handle starts the round at once)")
    cache_capacity: int = _setting(
        "SPARK_HVD_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY", 1024, int,
        "entries of the response cache (0 turns it off)")
    timeline: str | None = _setting(
        "SPARK_HVD_TIMELINE", "HOROVOD_TIMELINE", None, _optional_str,
        "path of a Chrome-trace JSON timeline (off when unset)")
    timeout_s: float = _setting(
        "SPARK_HVD_TIMEOUT", "HOROVOD_GLOO_TIMEOUT_SECONDS", 30.0, float,
        "seconds a rank waits for a peer before raising an error naming it")
    stall_check_time_s: float = _setting(
        "SPARK_HVD_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0, float,
        "seconds after which a tensor that some ranks never submitted is reported")
    stall_shutdown_time_s: float = _setting(
        "SPARK_HVD_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 180.0, float,
        "seconds after which such a tensor stops the job: every rank raises a StallError naming it and the "
        "missing ranks (0: never; unset: three stall-check periods)")
    device_backend: str | None = _setting(
        "SPARK_HVD_DEVICE_BACKEND", None, None, _choice("nccl", "gloo", "none"),
        "collectives on CUDA tensors: unset: NCCL, where the tensors lie; 'none': through host memory and the "
        "ring; 'gloo': gloo, and CPU torch tensors take the device path too (the CPU stand-in for NCCL in tests)")
    shm: bool = _setting(
        "SPARK_HVD_SHM", None, True, _bool,
        "use shared memory between ranks on the same host")
    shm_cma_bytes: int = _setting(
        "SPARK_HVD_SHM_CMA", None, 2 * MIB, int,
        "two ranks alone on one host allreduce arrays from this many bytes by reading each other's buffers "
        "(Linux cross-memory attach, process_vm_readv: one copy) instead of through shared-memory slots; "
        "0 turns it off")
    log_depth_bytes: int = _setting(
        "SPARK_HVD_LOG_DEPTH_BYTES", None, 64 * 1024, int,
        "TCP allreduces among three or more ranks (or host leaders) up to this many bytes use recursive doubling "
        "(log2 N exchanges of the whole array) instead of the ring's 2(N-1) steps; 0 turns it off")
    halving_doubling_bytes: int = _setting(
        "SPARK_HVD_HALVING_DOUBLING_BYTES", None, 0, int,
        "TCP allreduces among three or more ranks (or host leaders) from this many bytes use recursive halving and "
        "doubling (Rabenseifner: the ring's bytes in 2 log2 N steps instead of 2(N-1)); 0 turns it off")
    compiled_ring: bool = _setting(
        "SPARK_HVD_COMPILED_RING", None, True, _bool,
        "run TCP rings in the compiled loop where it was built (`make setup` / pip with a C compiler and Python's "
        "headers; see [The compiled ring loop](#the-compiled-ring-loop)); a job splits its rings into the compiled "
        "loop's smaller frames only when every rank has it; false: the Python loop")

    autotune: bool = _setting(
        "SPARK_HVD_AUTOTUNE", "HOROVOD_AUTOTUNE", False, _bool,
        "tune the fusion threshold and cycle time (and, among three or more TCP ranks, the halving-doubling "
        "threshold) online during the first steps (rank 0 measures, every rank switches at the same round; off by "
        "default)")
    autotune_log: str | None = _setting(
        "SPARK_HVD_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG", None, _optional_str,
        "path of the autotune log: a CSV line per scored sample (settings and score), written by rank 0")
    autotune_warmup_samples: int = _setting(
        "SPARK_HVD_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES", 3, _at_least(0),
        "samples autotune discards before it scores any")
    autotune_steps_per_sample: int = _setting(
        "SPARK_HVD_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", 10, _at_least(1),
        "training steps (a step ends where a tensor name comes back) in one autotune sample")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every setting from ``environ`` (default ``os.environ``), falling back to the Horovod alias."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            meta = f.metadata
            raw = env.get(meta["env"])
            if raw is None and meta["alias"]:
                raw = env.get(meta["alias"])
            if raw is not None:
                try:
                    values[f.name] = meta["parse"](raw)
                except ValueError as exc:
                    name = meta["env"] if meta["env"] in env else meta["alias"]
                    raise ValueError(f"environment variable {name}={raw!r} is not valid: {exc}") from None
        if "stall_shutdown_time_s" not in values and "stall_check_time_s" in values:
            values["stall_shutdown_time_s"] = STALL_SHUTDOWN_PERIODS * values["stall_check_time_s"]
        return cls(**values)

    @classmethod
    def describe(cls) -> list[tuple[str, str | None, Any, str]]:
        """(variable, Horovod alias, default, meaning) for every setting, for docs and ``--help``."""
        return [(f.metadata["env"], f.metadata["alias"], f.default, f.metadata["doc"]) for f in fields(cls)]
