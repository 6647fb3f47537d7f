"""The driver's forward check of a torch module (see ``spark_hvd.estimators.common.preflight``): the module called
once on a few prepared rows, exactly as a rank would feed them, and each output compared with its label: a
class-index loss needs one logit per class (the label column's largest index + 1), a regression loss as many values
as the label; the error names both numbers. A module or loss that fails on those rows fails here, with the shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from spark_hvd.estimators.common.errors import param_error
from spark_hvd.estimators.common.preflight import check_output

__all__ = ["torch_forward_check"]


def torch_forward_check(name: str, spec: Any, label_max: dict[str, float], rows: int = 4) -> None:
    """Call the module of ``spec`` (a ``TorchSpec``) on ``rows`` prepared training rows on the driver, as a rank
    would, and check each output against its label and loss; raise ``ValueError`` naming both numbers.

    ``label_max`` maps a label column to its largest value over the whole DataFrame (the number of classes of a
    class-index loss is that + 1). A ``train_minibatch_fn`` replaces the loss step: then only the forward pass runs.
    """
    import torch

    from spark_hvd.estimators.common.rank_data import ShardReaders
    from spark_hvd.estimators.torch.precision import MixedPrecision
    from spark_hvd.estimators.torch.rank import TorchTrainer, is_class_index_loss, resolve_losses

    small = dataclasses.replace(spec, batch_size=rows, shuffle=False, train_steps_per_epoch=1)
    gen = ShardReaders(small, 0, 1).epoch("train", 0)
    try:
        batch = next(gen)
    finally:
        gen.close()
    trainer = TorchTrainer()
    trainer.spec, trainer.device = small, torch.device("cpu")
    trainer.precision = MixedPrecision(None, trainer.device)
    from spark_hvd.estimators.torch.serde import deserialize_module

    trainer.model = deserialize_module(spec.model_bytes).eval()
    trainer._build_training(small)
    inputs, labels, weights = trainer._tensors(batch)
    n = len(inputs[0])
    shapes = ", ".join(f"{c} {tuple(t.shape)}" for c, t in zip(spec.feature_cols, inputs, strict=True))
    where = f"on a forward pass of {n} prepared rows on the driver"
    try:
        with torch.no_grad():
            out = trainer.model(*inputs)
    except Exception as exc:
        raise param_error(name, f"the model failed {where} (inputs: {shapes}): {type(exc).__name__}: {exc}. "
                         "Check input_shapes (without the batch dimension) and the first layer's size") from exc
    outputs = list(out) if isinstance(out, list | tuple) else [out]
    if len(outputs) != len(spec.label_cols):
        raise param_error(name, f"the model returns {len(outputs)} outputs for {len(spec.label_cols)} label columns "
                         f"{list(spec.label_cols)}; return one tensor per label (a tuple for several)")
    losses = resolve_losses(spec.loss, len(spec.label_cols))
    for col, o, y, item in zip(spec.label_cols, outputs, labels, losses, strict=True):
        check_output(name, col, tuple(o.shape), tuple(y.shape), is_class_index_loss(item), _is_elementwise(item),
                      label_max.get(col), "loss='cross_entropy'")
    if spec.train_minibatch_fn is not None:
        return
    try:
        with torch.no_grad():
            outs, fitted = trainer._transform_outputs(outputs, labels)
            trainer._loss(outs, fitted, weights)
    except Exception as exc:
        got = ", ".join(f"output {tuple(o.shape)} vs label {c!r} {tuple(y.shape)}"
                        for c, o, y in zip(spec.label_cols, outputs, labels, strict=True))
        raise param_error(name, f"the loss failed {where} ({got}): {type(exc).__name__}: {exc}") from exc


def _is_elementwise(item: Any) -> bool:
    """Whether a torch loss compares output and label value by value (the built-in regression losses)."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    if isinstance(item, str):
        return item in ("mse", "l1", "bce_with_logits")
    return item in (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy_with_logits) \
        or isinstance(item, torch.nn.MSELoss | torch.nn.L1Loss | torch.nn.SmoothL1Loss | torch.nn.HuberLoss
                      | torch.nn.BCEWithLogitsLoss)
