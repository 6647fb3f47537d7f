"""Horovod's Store API beyond the layout names (``test_horovod_store_names.py``): the constructor's ``train_path`` /
``val_path`` / ``test_path`` / ``runs_path`` (where datasets and runs go, kept through pickling, ``with_options`` and
``without_secrets``), ``get_local_output_dir_fn`` + ``sync_fn`` (a run's local files copied into its directory),
``read_serialized_keras_model`` (a Keras checkpoint read back), each checked on the files they leave."""

from __future__ import annotations

import base64
import os
import pickle

import pytest

from spark_hvd.store import LocalStore, RunDir, Store, StoreURLError


def test_train_and_runs_path_move_datasets_and_runs(tmp_path):
    store = Store.create(str(tmp_path / "s"), train_path="intermediate", runs_path=str(tmp_path / "elsewhere"))
    assert store.data_root() == str(tmp_path / "s" / "intermediate")
    assert store.data_path("ds-1") == str(tmp_path / "s" / "intermediate" / "ds-1")
    assert store.train_data_path("ds-1") == str(tmp_path / "s" / "intermediate" / "ds-1" / "train")
    assert store.run_path("r1") == store.get_run_path("r1") == str(tmp_path / "elsewhere" / "r1")
    assert store.get_runs_path() == str(tmp_path / "elsewhere")
    with store.atomic_dir(store.data_path("ds-1")) as target:  # what prepare_data writes, and finds again
        store.write_bytes(os.path.join(target, "_metadata.json"), b"{}")
    assert store.list_datasets() == ["ds-1"]
    assert (tmp_path / "s" / "intermediate" / "ds-1" / "_metadata.json").exists()
    store.write_json(os.path.join(RunDir(store, "r1").path, "history.json"), {"loss": [1.0]})
    assert store.list_runs() == ["r1"] and (tmp_path / "elsewhere" / "r1" / "history.json").exists()
    # the layout travels: to the ranks (pickle), through with_options / without_secrets
    for copy in (pickle.loads(pickle.dumps(store)), store.with_options(), store.without_secrets()):
        assert copy.data_root() == store.data_root() and copy.runs_root() == store.runs_root()
    assert pickle.loads(pickle.dumps(store)) == store != Store.create(str(tmp_path / "s"))


def test_val_path_only_repeats_train_path(tmp_path):
    same = LocalStore(str(tmp_path), train_path="d", val_path=str(tmp_path / "d"))
    assert same.data_root() == str(tmp_path / "d")
    with pytest.raises(StoreURLError, match="val_path='v'.*one directory"):
        LocalStore(str(tmp_path), train_path="d", val_path="v")
    with pytest.raises(StoreURLError, match="val_path"):
        LocalStore(str(tmp_path), val_path="v")


def test_layout_urls_must_be_under_the_store(tmp_path):
    store = Store.create(f"file://{tmp_path}", train_path=f"file://{tmp_path}/data2")
    assert store.data_root() == f"{tmp_path}/data2"
    with pytest.raises(StoreURLError, match="runs_path='s3://b/runs'"):
        Store.create(str(tmp_path), runs_path="s3://b/runs")


def test_test_path_is_horovods_accessor(tmp_path):
    assert LocalStore(str(tmp_path)).get_test_data_path() == f"{tmp_path}/intermediate_test_data"
    assert LocalStore(str(tmp_path), test_path="t").get_test_data_path(3) == f"{tmp_path}/t.3"


def test_memory_store_takes_layout_and_options(tmp_path):
    store = Store.create("memory://hvdtest/s", train_path="/hvdtest/d", runs_path="r")
    assert store.data_root() == "/hvdtest/d" and store.runs_root() == "/hvdtest/s/r"
    assert store.storage_options == {}


def test_local_output_dir_then_sync_fn_copy_a_runs_files(tmp_path):
    store = Store.create(str(tmp_path / "s"))
    local_dir, sync = store.get_local_output_dir_fn("r1"), store.sync_fn("r1")
    with local_dir() as out:
        os.makedirs(os.path.join(out, "logs"))
        with open(os.path.join(out, "checkpoint.ckpt"), "w") as f:
            f.write("epoch 0")
        with open(os.path.join(out, "logs", "events"), "w") as f:
            f.write("a")
        sync(out)
        with open(os.path.join(out, "checkpoint.ckpt"), "w") as f:
            f.write("epoch 1")
        os.remove(os.path.join(out, "logs", "events"))
        sync(out)  # overwrites what changed, keeps what is gone locally (Horovod's sync)
    assert not os.path.exists(out)
    run = tmp_path / "s" / "runs" / "r1"
    assert (run / "checkpoint.ckpt").read_text() == "epoch 1" and (run / "logs" / "events").read_text() == "a"
    with pytest.raises(FileNotFoundError, match="no local directory"):
        sync(out)


def test_read_serialized_keras_model(tmp_path):
    keras = pytest.importorskip("keras")
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    store = Store.create(str(tmp_path / "s"))
    ckpt = store.path("runs", "r1", "checkpoint")
    os.makedirs(ckpt)
    model.save(os.path.join(ckpt, "model.keras"))
    model.save_weights(os.path.join(ckpt, "w.weights.h5"))
    x = np.ones((1, 3), np.float32)
    for path, into in ((store.get_full_path(ckpt), None),
                       (os.path.join(ckpt, "w.weights.h5"), keras.Sequential([keras.Input((3,)),
                                                                                keras.layers.Dense(2)]))):
        out = tmp_path / "back.keras"
        out.write_bytes(base64.b64decode(store.read_serialized_keras_model(path, into, {})))
        back = keras.saving.load_model(str(out))
        np.testing.assert_allclose(np.asarray(back(x)), np.asarray(model(x)), rtol=1e-6)
