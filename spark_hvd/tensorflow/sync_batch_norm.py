"""``SyncBatchNormalization``: Keras batch normalisation with the statistics of the whole job's batch.

In training each rank sums its count, sum and sum of squares per channel; one differentiable ``Sum`` allreduce adds
them over the ranks, and the layer normalises with the job's mean and (biased, as Keras's) variance, which also
feed the moving statistics. The allreduce's gradient is again a ``Sum`` allreduce, so the input gradient is that
of the sum of every rank's loss. Outside training, or at size 1, it is Keras's ``BatchNormalization``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from spark_hvd import _binding_common as common
from spark_hvd.tensorflow.collectives import allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Drop-in for ``keras.layers.BatchNormalization`` (TensorFlow backend) whose batch statistics span every
    rank (Horovod's ``hvd.SyncBatchNormalization``). ``fused`` is accepted and ignored, as Keras 3 does."""

    def __init__(self, fused: Any = None, **kwargs: Any) -> None:
        del fused
        if kwargs.get("renorm"):
            raise ValueError("SyncBatchNormalization does not support renorm=True")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if not common.is_initialized() or common.size() == 1:
            return super()._moments(inputs, mask)
        x = tf.cast(inputs, tf.float64) if inputs.dtype in (tf.float16, tf.bfloat16, tf.float32) else inputs
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
        axes = list(self._reduction_axes)
        count = tf.reduce_sum(weights, axis=axes)
        total = tf.reduce_sum(x * weights, axis=axes)
        squares = tf.reduce_sum(x * x * weights, axis=axes)
        reduced = allreduce(tf.stack([count, total, squares]), op=common.Sum)
        mean = reduced[1] / reduced[0]
        variance = tf.maximum(reduced[2] / reduced[0] - mean * mean, 0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
