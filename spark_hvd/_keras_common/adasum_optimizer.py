"""``DistributedOptimizer(..., op=Adasum)`` for Keras 3: the delta optimizer (Horovod's design for Adasum).

Each rank applies its own gradients with the wrapped optimizer (its own slots: Adam's moments stay per rank), then
the change of every trainable variable, ``delta = v_after - v_before``, is combined across the ranks with the Adasum
allreduce and every rank sets ``v = v_before + adasum(deltas)``. ``v_before`` is read where Keras applies weight
decay (so the decay is part of the local step, as in torch's ``AdamW``), the deltas are taken after Keras's update
step, in one grouped collective (each variable keeps its own Adasum coefficients).

With ``backward_passes_per_step=k`` (Keras's ``gradient_accumulation_steps``) the gradients of k passes are
summed locally and the k-th pass runs the local step and the combination, as the torch optimizer does. Variables
registered as local (``register_local_var``, ``PartialDistributedOptimizer``) keep their local change, unscaled.

Differs from Horovod: Horovod's Keras ``DistributedOptimizer`` passes ``op=Adasum`` to its gradient allreduce
(Adasum of the gradients, then the update), while its documentation, its torch optimizer and its TF1 optimizer
combine the updates; here Keras combines the updates like torch. A non-global process set works (Horovod raises
for Adasum), and ``average_aggregated_gradients=True`` is refused as in Horovod's TensorFlow optimizer.
"""

from __future__ import annotations

from typing import Any

import keras


class DeltaAdasumMixin:
    """Placed in front of ``_DistributedOptimizerMixin`` (see ``wrap_optimizer_class``): gradients are applied
    locally (only summed over ``backward_passes_per_step``), the variables' changes are combined with Adasum."""

    def _hvd_allreduce_gradients(self, grads: list[Any], variables: list[Any], pass_factor: float) -> list[Any]:
        """Not reduced: the local step uses this rank's gradients (times ``pass_factor``: summed passes)."""
        del variables
        return [g * pass_factor if g is not None and pass_factor != 1.0 else g for g in grads]

    def _apply_weight_decay(self, variables: Any) -> Any:
        # the last moment before the local step changes the variables: weight decay, then the update step (Keras
        # 3.3-3.4 decay on every pass, before accumulating: the values before the last pass's decay are kept)
        self.__dict__["_hvd_adasum_start"] = [(v, keras.ops.copy(v.value)) for v in variables]
        return super()._apply_weight_decay(variables)  # type: ignore[misc]

    def _backend_update_step(self, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
        start = self.__dict__.pop("_hvd_adasum_start", None)
        out = super()._backend_update_step(grads, trainable_variables, learning_rate)  # type: ignore[misc]
        if start is None:
            raise RuntimeError("DistributedOptimizer(op=Adasum): the update step ran without the variables' values "
                               "before it (Keras called _backend_update_step without _apply_weight_decay)")
        local = self.__dict__.get("_hvd_local_ids") or {}
        updated = {id(v) for v in trainable_variables}
        pairs = [(v, before) for v, before in start if id(v) in updated and id(v) not in local]
        if not pairs:
            return out
        deltas = [keras.ops.subtract(v.value, before) for v, before in pairs]
        # the gradient mixin's reduction, with this class's op (Adasum) and the process set, on the deltas
        combined = super()._hvd_allreduce_gradients(deltas, [v for v, _ in pairs], 1.0)  # type: ignore[misc]
        for (v, before), d in zip(pairs, combined, strict=True):
            v.assign(keras.ops.add(before, keras.ops.cast(d, before.dtype)))
        return out
