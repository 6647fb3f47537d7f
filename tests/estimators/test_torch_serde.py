"""TorchModel/TorchEstimator load modules, checkpoints and optimizer state on the CPU, whatever device saved them.

No GPU here, so the bytes of a GPU job are made the way torch makes them: a storage is saved with its location tag
(``location_tag``, from ``torch.serialization``'s package registry). A tagger registered ahead of the built-in ones
tags every storage ``cuda:0`` while ``_saved_as_on_cuda()`` is active, so the bytes are those a CUDA tensor gives
(only the data came from the CPU); loading them without ``map_location`` asks torch's own CUDA deserializer, which
fails on this machine, exactly as on a CPU-only executor.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import cloudpickle
import numpy as np
import pytest
import torch

from spark_hvd.estimators import TorchEstimator, TorchModel
from spark_hvd.estimators.torch.serde import deserialize_module, optimizer_spec, serialize_module
from spark_hvd.store import RunDir, Store

_cuda_tagging = {"on": False}


def _cuda_tagger(storage) -> str | None:
    return "cuda:0" if _cuda_tagging["on"] else None


def _no_deserializer(storage, location: str) -> None:
    return None


@contextlib.contextmanager
def _saved_as_on_cuda() -> Iterator[None]:
    torch.serialization.register_package(-100, _cuda_tagger, _no_deserializer)
    _cuda_tagging["on"] = True
    try:
        yield
    finally:
        _cuda_tagging["on"] = False
        torch.serialization._package_registry[:] = [
            entry for entry in torch.serialization._package_registry if entry[1] is not _cuda_tagger]


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    net(torch.randn(16, 4))  # BatchNorm running stats (buffers) move off their init values
    return net.eval()


def _same_module(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sb[key].device.type == "cpu", key
        torch.testing.assert_close(sb[key], sa[key].cpu(), rtol=0, atol=0)


def test_module_pickled_with_cuda_storages_loads_on_cpu():
    net = _net()
    with _saved_as_on_cuda():
        data = serialize_module(net)
    assert b"cuda:0" in data
    if not torch.cuda.is_available():  # what a CPU-only executor did before: torch restores on the saved device
        with pytest.raises(RuntimeError, match="CUDA"):
            cloudpickle.loads(data)
    _same_module(net, deserialize_module(data))
    model = TorchModel._load_for_inference(data)  # what transform runs once per Python worker
    _same_module(net, model)
    x = torch.randn(5, 4)
    with torch.no_grad():
        expect = net(x).numpy()
    np.testing.assert_array_equal(TorchModel._predict(model, [x.numpy()])[0], expect)


def test_final_model_and_optimizer_state_saved_on_cuda_load_on_cpu(tmp_path):
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net.train()
    torch.nn.functional.mse_loss(net(torch.randn(16, 4)), torch.randn(16, 2)).backward()
    opt.step()  # Adam state: exp_avg, exp_avg_sq per parameter
    net.eval()
    store = Store.create(str(tmp_path / "store"))
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    with _saved_as_on_cuda():
        torch.save(net.state_dict(), model_dir / "model.pt")
        model_bytes = serialize_module(net)
        opt_bytes = cloudpickle.dumps(optimizer_spec(opt, net))
    RunDir(store, "gpu-run").write_model(str(model_dir))
    raw = store.read_bytes(f"{RunDir(store, 'gpu-run').model_path}/model.pt")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(io.BytesIO(raw))

    # the driver after fit: the trained weights from the store, on the CPU
    est = TorchEstimator(model=_net(), optimizer=torch.optim.SGD(_net().parameters(), lr=0.1))
    _same_module(net, est._load_trained_model(store, "gpu-run", model_bytes))  # the bytes of a GPU module

    # a saved estimator read back: module and optimizer (with its state) rebuilt on the CPU
    loaded = TorchEstimator()._load_objects({"model": model_bytes, "optimizer": opt_bytes})
    _same_module(net, loaded["model"])
    state, expect = loaded["optimizer"].state_dict()["state"], opt.state_dict()["state"]
    assert state.keys() == expect.keys() and len(state) == len(list(net.parameters()))
    for key in expect:
        for name in ("exp_avg", "exp_avg_sq"):
            assert state[key][name].device.type == "cpu"
            torch.testing.assert_close(state[key][name], expect[key][name], rtol=0, atol=0)
