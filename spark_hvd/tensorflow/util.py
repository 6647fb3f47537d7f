"""Horovod's ``horovod.tensorflow.util`` helpers that scripts and Horovod's tests import."""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly (not while a graph or a ``tf.function`` is being built)."""
    return tf.executing_eagerly()
