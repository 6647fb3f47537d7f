"""``spark_hvd.estimators._moved``: the flat layout's module names import as the modules they became, so pickles that
name them (and code that imports them) keep working; the class paths saved Pipelines record resolve."""

from __future__ import annotations

import importlib
import pickle

import pytest

from spark_hvd.estimators._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_name_is_the_new_module(old):
    before = importlib.import_module(f"spark_hvd.estimators.{old}")
    assert before is importlib.import_module(f"spark_hvd.estimators.{MOVED[old]}")
    assert before.__name__ == f"spark_hvd.estimators.{MOVED[old]}"  # what new pickles name


def test_an_object_pickled_under_its_old_module_loads():
    from spark_hvd.estimators.common.rank_run import EarlyStopping

    # protocol 0 names a class as the text line "module\nname\n": the flat layout's names can be written in
    data = pickle.dumps(EarlyStopping(monitor="loss", patience=3), protocol=0)
    assert b"spark_hvd.estimators.common.rank_run\nEarlyStopping" in data
    old = data.replace(b"spark_hvd.estimators.common.", b"spark_hvd.estimators.")
    assert b"spark_hvd.estimators.rank_run\nEarlyStopping" in old and b"spark_hvd.estimators.spec\nBestPolicy" in old
    loaded = pickle.loads(old)
    assert type(loaded) is EarlyStopping and (loaded.policy.monitor, loaded.patience) == ("loss", 3)


@pytest.mark.parametrize("path", ["spark_hvd.estimators.torch.TorchModel", "spark_hvd.estimators.torch.TorchEstimator",
                                  "spark_hvd.estimators.keras.KerasModel", "spark_hvd.estimators.keras.KerasEstimator",
                                  "spark_hvd.estimators.lightning.LightningModel",
                                  "spark_hvd.estimators.lightning.LightningEstimator"])
def test_class_paths_saved_pipelines_record_resolve(path):
    pytest.importorskip("pyspark")
    from pyspark.ml.util import DefaultParamsReader

    cls = DefaultParamsReader._DefaultParamsReader__get_class(path)  # how Pipeline.load finds a stage's class
    assert cls.__name__ == path.rpartition(".")[2]
    import spark_hvd.estimators as estimators

    assert getattr(estimators, cls.__name__) is cls
