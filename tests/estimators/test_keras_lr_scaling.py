"""``scale_lr_by_num_proc`` on the Keras side: a constant rate is multiplied, a schedule is a clear error."""

from __future__ import annotations

import pytest

keras = pytest.importorskip("keras")

from spark_hvd.estimators.keras.rank import scale_learning_rate  # noqa: E402


def test_constant_rate_is_multiplied():
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    scale_learning_rate(optimizer, 3)
    assert float(optimizer.learning_rate) == pytest.approx(0.3)


def test_schedule_is_refused_naming_the_param():
    optimizer = keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5))
    with pytest.raises(ValueError, match="scale_lr_by_num_proc"):
        scale_learning_rate(optimizer, 2)
