"""The driver's checks of ``LightningEstimator``'s Trainer settings, before any Spark job runs.

``callbacks`` must be Lightning callbacks, ``logger`` a Lightning logger (or a list of them), ``precision`` one of
Lightning's values, ``gradient_clip_val`` a non-negative number with automatic optimization; ``trainer_args``
names only ``lightning.Trainer`` arguments (``strategy`` only as DDP: ``STRATEGIES`` or a ``DDPStrategy``), none
of those the estimator owns (``RESERVED``), none given twice (as a param and in ``trainer_args``).
``gradient_compression`` is refused: DDP averages the gradients.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, get_args

from spark_hvd.estimators.common.errors import param_error, param_type_error

__all__ = ["check_trainer_settings", "RESERVED", "STRATEGIES", "PROFILERS"]

#: Trainer arguments the estimator sets itself, and what to use instead
RESERVED = {
    "accelerator": "set use_gpu",
    "devices": "each rank is one device; set num_proc",
    "num_nodes": "set num_proc",
    "max_epochs": "set epochs",
    "callbacks": "set the callbacks param",
    "logger": "set the logger param",
    "enable_checkpointing": "checkpoints go to the store every epoch",
    "use_distributed_sampler": "the data is sharded by the estimator",
}

#: the strategies ``trainer_args`` may name (a ``DDPStrategy`` instance is taken too)
STRATEGIES = ("ddp", "ddp_find_unused_parameters_true")

#: estimator params that are also Trainer arguments: one place to set each
_TWICE = ("precision", "gradient_clip_val", "log_every_n_steps", "profiler")

#: the profiler names the ``profiler`` param takes (Lightning's classes, writing their report to the store)
PROFILERS = ("simple", "advanced", "pytorch")


def _precisions() -> set:
    from lightning.fabric.plugins.precision.precision import (
        _PRECISION_INPUT_INT,
        _PRECISION_INPUT_STR,
        _PRECISION_INPUT_STR_ALIAS,
    )

    return {*get_args(_PRECISION_INPUT_INT), *get_args(_PRECISION_INPUT_STR), *get_args(_PRECISION_INPUT_STR_ALIAS)}


def check_trainer_settings(est: Any, model: Any) -> None:
    """Raise ``EstimatorParamError``/``EstimatorTypeError`` naming the param at fault (see the module docstring)."""
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.loggers import Logger
    from lightning.pytorch.strategies import DDPStrategy

    for i, cb in enumerate(est._opt(est.callbacks) or ()):
        if not isinstance(cb, pl.Callback):
            raise param_type_error(est, f"callbacks[{i}] is a {type(cb).__name__}, not a lightning Callback "
                                   "(LightningEstimator runs Lightning's Trainer; torch-loop callbacks such as "
                                   "spark_hvd's EarlyStopping are TorchEstimator's: use "
                                   "lightning.pytorch.callbacks.EarlyStopping)")
    logger = est._opt(est.logger)
    if logger is not None and logger is not False:
        loggers = logger if isinstance(logger, list | tuple) else [logger]
        for item in loggers:
            if not isinstance(item, Logger):
                raise param_type_error(est, f"logger must be a lightning Logger (e.g. CSVLogger(path)) or a list of "
                                       f"them, got {type(item).__name__}")
    args = est._opt(est.trainer_args) or {}
    known = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    for key in args:
        if not isinstance(key, str) or key not in known:
            near = difflib.get_close_matches(str(key), sorted(known), n=3)
            raise param_error(est, f"trainer_args: {key!r} is not a lightning.Trainer argument"
                              + (f"; did you mean {near}?" if near else ""))
        if key in RESERVED:
            raise param_error(est, f"trainer_args: {key!r} is set by the estimator ({RESERVED[key]})")
        if key in _TWICE and est.isSet(getattr(est, key)):
            raise param_error(est, f"{key} is given both as a param and in trainer_args; give it once")
    if "accumulate_grad_batches" in args and est.getOrDefault(est.backward_passes_per_step) > 1:
        raise param_error(est, "trainer_args: accumulate_grad_batches and backward_passes_per_step are the same "
                          "setting; give one")
    strategy = args.get("strategy", "ddp")
    if not (strategy in STRATEGIES or isinstance(strategy, DDPStrategy)):
        raise param_error(est, f"trainer_args: strategy {strategy!r} is not supported: give one of {STRATEGIES} "
                          "or a DDPStrategy(...) (its cluster environment becomes the job's)")
    for plugin in args.get("plugins") or []:
        if isinstance(plugin, ClusterEnvironment):
            raise param_error(est, f"trainer_args: the plugin {type(plugin).__name__} is a ClusterEnvironment; the "
                              "estimator gives the Trainer the job's own")
    precision = args.get("precision", est.getOrDefault(est.precision))
    if precision is not None and precision not in _precisions():
        raise param_error(est, f"precision {precision!r} is not one of Lightning's: "
                          f"{sorted(map(str, _precisions()))}")
    clip = args.get("gradient_clip_val", est.getOrDefault(est.gradient_clip_val))
    if clip is not None:
        if not isinstance(clip, int | float) or isinstance(clip, bool) or clip < 0:
            raise param_error(est, f"gradient_clip_val must be a number >= 0, got {clip!r}")
        if not model.automatic_optimization:
            raise param_error(est, f"gradient_clip_val is set but {type(model).__name__} uses manual optimization "
                              "(Lightning clips only under automatic optimization): call "
                              "self.clip_gradients(optimizer, ...) in training_step instead")
    profiler = est._opt(est.profiler)
    if profiler is not None and profiler not in PROFILERS:
        from lightning.pytorch.profilers import Profiler

        if not isinstance(profiler, Profiler):
            raise param_error(est, f"profiler must be one of {PROFILERS} or a lightning Profiler object, got "
                              f"{profiler!r}")
    if est.getOrDefault(est.log_every_n_steps) <= 0:
        raise param_error(est, f"log_every_n_steps must be a positive integer, got "
                          f"{est.getOrDefault(est.log_every_n_steps)}")
    if est._opt(est.gradient_compression) is not None:
        raise param_error(est, "gradient_compression is not supported: Lightning's DDP averages the gradients "
                          "(register a DDP communication hook in the module's setup() for compression)")
