"""The driver's forward check of a LightningModule (see ``spark_hvd.estimators.common.preflight``): Lightning's own
``fast_dev_run`` (one training batch, one validation batch, no logger, no checkpoint) of a copy of the module on a
few prepared rows fed as the ranks feed them, on the driver's CPU; what fails there names the batch's shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spark_hvd.estimators.common.errors import param_error

__all__ = ["lightning_forward_check"]


def lightning_forward_check(name: str, spec: Any, rows: int = 4) -> None:
    """Run Lightning's ``fast_dev_run`` of a copy of the module of ``spec`` (a ``LightningSpec``) on ``rows``
    prepared rows on the driver's CPU, batches as a rank gets them (a dict of tensors by column), with the spec's
    precision and clipping and none of the user's callbacks or loggers; raise ``ValueError`` naming the batch's
    shapes and Lightning's error. The module passed to ``fit`` is not touched (the copy is the spec's bytes)."""
    import logging
    import tempfile
    import warnings

    import lightning.pytorch as pl
    import torch

    from spark_hvd.estimators.common.rank_data import ShardReaders
    from spark_hvd.estimators.lightning.rank import LightningTrainer
    from spark_hvd.estimators.torch.serde import deserialize_module

    small = dataclasses.replace(spec, batch_size=rows, val_batch_size=rows, shuffle=False, train_steps_per_epoch=1,
                                validation_steps_per_epoch=1)
    readers = ShardReaders(small, 0, 1)
    feeder = LightningTrainer()
    feeder.spec, feeder.device = small, torch.device("cpu")

    def first(split: str) -> dict:
        gen = readers.epoch(split, 0)
        try:
            return feeder._batch(next(gen))
        finally:
            gen.close()

    try:
        train = first("train")
        val = first("val") if readers.has_validation else None
    finally:
        readers.close()
    shapes = ", ".join(f"{c} {tuple(t.shape)}" for c, t in train.items())
    module = deserialize_module(spec.model_bytes)
    settings = {k: v for k, v in (("precision", spec.precision), ("gradient_clip_val", spec.gradient_clip_val))
                if v is not None}
    chatty = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [log.level for log in chatty]
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for log in chatty:
            log.setLevel(logging.WARNING)
        try:
            trainer = pl.Trainer(accelerator="cpu", devices=1, fast_dev_run=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 default_root_dir=root, **settings)
            loader = torch.utils.data.DataLoader
            trainer.fit(module, train_dataloaders=loader([train], batch_size=None),
                        val_dataloaders=loader([val], batch_size=None) if val is not None else None)
        except Exception as exc:
            raise param_error(name, f"the LightningModule failed Lightning's fast_dev_run on {rows} prepared rows on "
                              f"the driver (batch: {shapes}): {type(exc).__name__}: {exc}. Check input_shapes "
                              "(without the batch dimension) and the module's layer sizes") from exc
        finally:
            for log, level in zip(chatty, levels, strict=True):
                log.setLevel(level)
