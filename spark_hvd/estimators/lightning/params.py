"""The Params only the Lightning estimator takes (the shared ones: ``spark_hvd.estimators.common.params``; its
model is a ``TorchModel``'s)."""

from __future__ import annotations

from pyspark.ml.param import TypeConverters

from spark_hvd.estimators.common.params import (
    ElasticParams,
    EstimatorParams,
    InputShapesParams,
    RunnerBackendParams,
    StepCheckpointParams,
    _add_accessors,
    _p,
    _to_json_dict,
    _to_optional,
    _to_strict_int,
)

__all__ = ["LightningEstimatorParams"]


@_add_accessors
class LightningEstimatorParams(InputShapesParams, RunnerBackendParams, StepCheckpointParams, ElasticParams,
                               EstimatorParams):
    """``EstimatorParams`` plus the Torch input shapes and the rank's ``lightning.Trainer`` settings (Horovod's
    names); optimizer, loss and metrics come from the module itself, ``callbacks`` are Lightning callbacks."""

    trainer_args = _p("trainer_args", "dict of further lightning.Trainer arguments, added to (and overriding) those "
                      "the estimator gives (strategy: 'ddp', 'ddp_find_unused_parameters_true' or a "
                      "DDPStrategy); not accelerator, devices, num_nodes, max_epochs, callbacks, logger, "
                      "enable_checkpointing, use_distributed_sampler", _to_json_dict)
    logger = _p("logger", "a Lightning logger (or a list of them) run on the ranks, e.g. CSVLogger(path); default "
                "none (the store keeps the metrics log and TensorBoard scalars)")
    log_every_n_steps = _p("log_every_n_steps", "how often the Trainer logs training steps (Lightning's setting)",
                           _to_strict_int)
    precision = _p("precision", "Lightning's precision: 'bf16-mixed', '16-mixed', 'bf16-true', '32-true', 64 ...; "
                   "default Lightning's ('32-true')")
    num_gpus = _p("num_gpus", "GPUs per rank (Horovod's): 1 trains each rank on its task's GPU (use_gpu=True), 0 "
                  "on the CPU (use_gpu=False); each rank is one device, so more is refused (use more ranks); "
                  "default none (use_gpu decides)", _to_optional(_to_strict_int))
    profiler = _p("profiler", "Lightning's profiler, given to each rank's Trainer: 'simple', 'advanced' or 'pytorch' "
                  "(its report goes to the run's logs/profiler/rank<r>/ in the store) or a Profiler object (as "
                  "it is configured); default none")
    gradient_clip_val = _p("gradient_clip_val", "clip gradients at this value (norm by default; "
                           "trainer_args={'gradient_clip_algorithm': 'value'} for values); default none",
                           _to_optional(TypeConverters.toFloat))

    def getNumGPUs(self) -> int | None:  # noqa: N802 - Horovod's spelling
        """Horovod's name of ``getNumGpus``."""
        return self.getOrDefault(self.num_gpus)

    def setNumGPUs(self, value: int | None) -> LightningEstimatorParams:  # noqa: N802 - Horovod's spelling
        """Horovod's name of ``setNumGpus``."""
        return self._set(num_gpus=value)

    def __init__(self) -> None:
        super().__init__()
        self._setDefault(log_every_n_steps=50, precision=None, gradient_clip_val=None, profiler=None,
                         num_gpus=None)
