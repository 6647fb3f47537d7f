"""A two-rank ``TorchEstimator`` fit replayed in one process: the same initial module, the same batches in the same
order, the same arithmetic as data-parallel ranks.

``rank_shards`` opens every rank's shard of the fit's prepared data with the reader the ranks use (``ShardReaders``,
same seed). ``replay`` trains on them as the ranks do: per step, each rank's batch gives a loss whose gradient is
accumulated (divided by ``backward_passes_per_step``, as the estimator does), every ``backward_passes_per_step``
steps the gradients are averaged over the ranks (what ``DistributedOptimizer`` does) and the optimizer steps (and
the LR scheduler, per batch or per epoch). A test then compares the fit's weights and history with the replay's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from spark_hvd.data.metadata import DatasetInfo
from spark_hvd.estimators.common.rank_data import ShardReaders
from spark_hvd.estimators.common.spec import TrainSpec


def rank_shards(store: Any, fitted: Any, *, seed: int, batch_size: int, label_cols: tuple = ("y",),
                sample_weight_col: str | None = None, num_proc: int = 2) -> list[ShardReaders]:
    """Every rank's ``ShardReaders`` over the data ``fitted`` (a ``TorchModel``) was trained on."""
    info = DatasetInfo.load(store, fitted.getMetadata()["dataset"])
    defaults = {f.name: f.default for f in dataclasses.fields(TrainSpec) if f.default is not dataclasses.MISSING}
    spec = SimpleNamespace(**{**defaults, **dict(
        store=store, dataset=info, feature_cols=("features",), label_cols=label_cols,
        sample_weight_col=sample_weight_col, random_seed=seed, batch_size=batch_size, val_batch_size=batch_size,
        shuffle=True)})  # every other reader setting at the fit's default (new ones included)
    return [ShardReaders(spec, rank, num_proc) for rank in range(num_proc)]


def replay(shards: list[ShardReaders], model: torch.nn.Module, optimizer: Any,
           batch_loss: Callable[[torch.nn.Module, dict], torch.Tensor], epochs: int, *,
           backward_passes_per_step: int = 1, scheduler: Any = None, scheduler_interval: str = "epoch",
           backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
           apply: Callable[[Any], None] | None = None) -> list[float]:
    """Train ``model`` on the ranks' batches (see the module docstring); the mean training loss of each epoch over
    every rank's rows, as the fit's history reports it. ``batch_loss(model, batch)`` is one rank's loss on one
    batch; ``backward(loss)`` and ``apply(optimizer)`` (default ``optimizer.step()``) stand in for loss scaling."""
    bpps = backward_passes_per_step
    losses = []
    for epoch in range(epochs):
        total, rows = 0.0, 0
        for step, batches in enumerate(zip(*(s.epoch("train", epoch) for s in shards), strict=True)):
            if step % bpps == 0:
                optimizer.zero_grad()
            for batch in batches:
                loss = batch_loss(model, batch)
                backward(loss / bpps if bpps > 1 else loss)
                n = len(batch["features"])
                total, rows = total + float(loss.detach()) * n, rows + n
            if (step + 1) % bpps:
                continue
            for p in model.parameters():
                p.grad.div_(len(shards))  # the average over the ranks
            if apply is None:
                optimizer.step()
            else:
                apply(optimizer)
            if scheduler is not None and scheduler_interval == "batch":
                scheduler.step()
        losses.append(total / rows)
        if scheduler is not None and scheduler_interval == "epoch":
            scheduler.step()
    return losses


def assert_fit_equals_replay(fitted: Any, model: torch.nn.Module, losses: list[float], atol: float,
                             rtol: float = 1e-3) -> None:
    """The fit's per-epoch loss and final weights equal the replay's within the tolerances."""
    np.testing.assert_allclose(fitted.getHistory()["loss"], losses, rtol=rtol, atol=atol)
    for (name, got), want in zip(fitted.getModel().state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
