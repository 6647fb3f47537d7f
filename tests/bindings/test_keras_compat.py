"""spark_hvd._keras_common.compat on the installed Keras, and its branches for the other Keras releases (flags
patched)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from spark_hvd._keras_common import compat


def test_the_pass_counter_and_iterations_follow_the_installed_keras():
    opt = keras.optimizers.SGD(0.1)
    counter = compat.pass_counter(opt)
    assert counter is (opt._iterations if compat.ITERATIONS_IS_PROPERTY else opt.iterations)
    members = compat.iterations_members(keras.optimizers.SGD)
    assert ("iterations" in members) == compat.ITERATIONS_IS_PROPERTY
    assert compat.iterations_members(keras.optimizers.LossScaleOptimizer) == {}


def test_assign_returns_the_value_on_every_keras():
    var = keras.Variable(np.zeros(2, np.float32))
    np.testing.assert_array_equal(np.asarray(compat.assign(var, np.ones(2, np.float32))), [1.0, 1.0])


def test_checkpoint_mode_with_and_without_monitor_callback():
    cb = keras.callbacks.ModelCheckpoint("/tmp/unused.keras", monitor="val_loss", mode="max")
    assert compat.checkpoint_mode(cb)[0] == "max"

    class Old:  # Keras 3.3-3.10: only the comparison it chose
        monitor_op = np.less

    assert compat.checkpoint_mode(Old()) == ("min", 0.0)


@pytest.mark.parametrize("resets, want", [(True, 8), (False, None)])
def test_fit_steps_and_restart_callbacks(monkeypatch, resets, want):
    monkeypatch.setattr(compat, "EPOCH_ITERATOR_RESETS", resets)
    data = list(range(8))
    assert compat.fit_steps(8, data) == want
    assert compat.fit_steps(5, data) == 5  # part of the dataset: always as asked
    assert len(compat.restart_after_peek(object())) == (0 if resets else 1)
