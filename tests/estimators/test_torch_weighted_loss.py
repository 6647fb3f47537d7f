"""TorchEstimator's callable losses with ``sample_weight_col``, as Horovod calls them: a function with a ``reduction``
parameter (``F.binary_cross_entropy``) or a torch loss module is called unreduced, so Horovod's ``test_fit_model``
(per-row ``(N, 1)`` outputs against ``(N,)`` labels) trains; a callable that can only return one value for the
batch stays refused, naming what to do. Each loss is compared with the mean of the weighted per-row binary cross
entropies written out by hand (Horovod's mean(w * loss)). No Spark: the rank's loss step (what the driver's
forward check also calls) alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from spark_hvd.estimators.torch.rank import TorchTrainer
from spark_hvd.estimators.torch.serde import optimizer_spec


def _trainer(loss, loss_weights=None, labels=("y",)) -> TorchTrainer:
    model = torch.nn.Linear(2, 1)
    spec = SimpleNamespace(sample_weight_col="weight", loss=loss, loss_constructors=(), label_cols=labels,
                           loss_weights=loss_weights, metrics=(), train_minibatch_fn=None,
                           optimizer=optimizer_spec(torch.optim.SGD(model.parameters(), lr=0.1), model),
                           lr_scheduler_interval="epoch", backward_passes_per_step=1)
    trainer = TorchTrainer()
    trainer.model, trainer.spec = model, spec
    trainer._build_training(spec)
    return trainer


def _by_hand(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    """sum_i w_i * -(y_i log p_i + (1 - y_i) log(1 - p_i)) / N, element by element (Horovod's mean of w * loss)."""
    total = 0.0
    for pi, yi, wi in zip(p.reshape(-1).tolist(), y.tolist(), w.tolist(), strict=True):
        total += wi * -(yi * torch.log(torch.tensor(pi)) + (1 - yi) * torch.log(torch.tensor(1 - pi))).item()
    return total / len(w.tolist())


# Horovod's test_fit_model data: the XOR table's labels and weights; outputs of a sigmoid, one column
P = torch.tensor([[0.2], [0.7], [0.6], [0.1]])
Y = torch.tensor([0.0, 1.0, 1.0, 0.0])
W = torch.tensor([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("loss", [F.binary_cross_entropy, torch.nn.BCELoss()], ids=["function", "module"])
def test_unreduced_callable_loss_is_the_mean_of_weighted_row_losses(loss):
    trainer = _trainer(loss)
    outputs, labels = trainer._transform_outputs(P, [Y])  # (N,) labels reshaped to the (N, 1) output
    got = float(trainer._loss(outputs, labels, W))
    assert got == pytest.approx(_by_hand(P, Y, W), rel=1e-6)
    # the weights count: equal weights give the plain mean, which differs here
    assert got != pytest.approx(float(F.binary_cross_entropy(P.reshape(-1), Y)), rel=1e-3)
    assert float(trainer._loss(outputs, labels, torch.ones(4))) == pytest.approx(
        float(F.binary_cross_entropy(P.reshape(-1), Y)), rel=1e-6)
    if isinstance(loss, torch.nn.Module):
        assert loss.reduction == "mean"  # the user's module is not changed


def test_loss_weights_combine_the_weighted_label_losses():
    trainer = _trainer([F.binary_cross_entropy, F.binary_cross_entropy], loss_weights=[0.25, 0.75],
                       labels=("a", "b"))
    q = torch.tensor([[0.9], [0.4], [0.3], [0.5]])
    outputs, labels = trainer._transform_outputs((P, q), [Y, 1 - Y])
    got = float(trainer._loss(outputs, labels, W))
    assert got == pytest.approx(0.25 * _by_hand(P, Y, W) + 0.75 * _by_hand(q, 1 - Y, W), rel=1e-6)


def test_a_loss_that_only_reduces_is_refused():
    trainer = _trainer(lambda o, y: ((o - y) ** 2).mean())
    outputs, labels = trainer._transform_outputs(P, [Y])
    with pytest.raises(ValueError, match="one value per row.*reduction"):
        trainer._loss(outputs, labels, W)
