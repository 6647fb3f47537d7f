"""Which device ``transform`` runs a task's model on with ``use_gpu=True``: the GPU Spark assigned to the task.

``choose_gpu`` maps Spark's address to a CUDA ordinal (its place in ``CUDA_VISIBLE_DEVICES``, or the address where
that is unset; device 0 with a warning where nothing usable was assigned); ``task_gpu_index`` keeps it only where the
framework sees that device. Checked here without a GPU: the mapping itself, a task context carrying a GPU address,
and a Spark transform whose module reads ``inference_device()`` (what the task chose). The assignment by Spark's
fake-GPU discovery on executor JVMs is in ``tests/runner/test_runner_local_cluster.py`` (it already starts such a
cluster); the device path itself (the module and its batches on CUDA) in ``test_model.py``, where CUDA is.
"""

from __future__ import annotations

import logging
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from spark_hvd.estimators import TorchModel
from spark_hvd.estimators.common import model as model_mod
from spark_hvd.estimators.common.model import choose_gpu, inference_device, task_device, task_gpu_index

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the executors cannot import this test module


@pytest.mark.parametrize(("address", "visible", "ordinal", "warned"), [
    ("3", None, 3, False),            # every GPU visible: the address is the ordinal
    ("3", "2,3", 1, False),           # a cluster manager that isolates GPUs: the address's place in the list
    ("7", "2,3", 0, True),            # an address not listed: device 0 of the visible ones
    (None, None, 0, True),            # no GPU in the task's resources: device 0
    (None, "5", 0, True),
    ("gpu-a", None, 0, True),         # not an index
])
def test_choose_gpu_maps_spark_address_to_cuda_ordinal(address, visible, ordinal, warned):
    choice = choose_gpu(True, address, visible)
    assert (choice.address, choice.visible, choice.ordinal) == (address, visible, ordinal)
    assert (choice.note != "the task's GPU") == warned, choice.note
    if warned:
        assert "device 0" in choice.note
    off = choose_gpu(False, address, visible)
    assert off.ordinal is None and off.device == "cpu"


@pytest.fixture
def task_with_gpu(monkeypatch):
    """A TaskContext in this process whose resources hold GPU address "3" (as Spark's worker sets it up)."""
    from pyspark import TaskContext
    from pyspark.resource import ResourceInformation

    ctx = TaskContext._getOrCreate()
    ctx._resources = {"gpu": ResourceInformation("gpu", ["3"])}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield ctx
    TaskContext._taskContext = None


def test_task_gpu_index_takes_the_task_gpu_where_visible(task_with_gpu, monkeypatch, caplog):
    assert task_device(True).address == "3"
    assert task_gpu_index(True, 4) == 3
    assert model_mod._LOADED_DEVICE[0].device == "cuda:3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert task_gpu_index(True, 2) == 1
    assert task_gpu_index(False, 2) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert task_gpu_index(True, 2) == 0  # address 3 but two devices seen: device 0, warned
    assert "sees 2 GPU(s)" in model_mod._LOADED_DEVICE[0].note
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    model_mod._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger=model_mod.__name__):
        assert task_gpu_index(True, 0) is None  # no CUDA here: the CPU, warned once
        assert task_gpu_index(True, 0) is None
    assert model_mod._LOADED_DEVICE[0].device == "cpu" and model_mod._LOADED_DEVICE[0].ordinal == 1
    assert len([r for r in caplog.records if "transform runs on the CPU" in r.getMessage()]) == 1


class _DeviceProbe(torch.nn.Module):
    """A linear map whose output also carries what ``inference_device()`` reports in the task that runs it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = inference_device()  # None on the driver (the output shapes are taken there)
        code = [-2.0] * 3 if d is None else [-1.0 if d.ordinal is None else float(d.ordinal),
                                             1.0 if d.device == "cpu" else 0.0,
                                             -1.0 if d.address is None else float(d.address)]
        extra = torch.tensor(code, dtype=x.dtype).expand(len(x), 3)
        return torch.cat([self.lin(x), extra], dim=1)


@pytest.mark.spark
def test_transform_records_the_device_of_each_task(spark):
    """The shared session gives tasks no GPU: with ``use_gpu``, each task chooses device 0 (warned), sees no CUDA
    here and runs on the CPU, and its outputs equal the module's; without ``use_gpu``, the CPU directly."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the choice is the real device (test_model.py checks that path)")
    x = np.random.default_rng(4).standard_normal((30, 3)).astype(np.float32)
    df = spark.createDataFrame([(i, x[i].tolist()) for i in range(30)], "id long, arr array<float>").repartition(3)
    net = _DeviceProbe()
    model = TorchModel(model=net, feature_cols=["arr"], label_cols=["t"], batch_size=8)
    with torch.no_grad():
        expect = net.lin(torch.from_numpy(x)).numpy()[:, 0]
    for use_gpu, want in ((True, [0.0, 1.0, -1.0]), (False, [-1.0, 1.0, -1.0])):
        rows = sorted(model.setUseGpu(use_gpu).transform(df).collect(), key=lambda r: r.id)
        got = np.array([r.t__output for r in rows])
        np.testing.assert_allclose(got[:, 0], expect, rtol=1e-5, atol=1e-6)
        assert (got[:, 1:] == want).all(), (use_gpu, np.unique(got[:, 1:], axis=0))
    assert inference_device() is None  # the driver ran no task


def test_in_process_batches_leave_no_task_device_behind():
    """The per-batch function run in this process (as the MLflow pyfunc runs it) reports its device to the module
    while it runs, and restores what was there before when it ends, failed or not: no stale device afterwards."""
    import pyarrow as pa

    from spark_hvd.estimators.common.pyfunc import _Shared

    net = _DeviceProbe()
    data = TorchModel._serialize_model(net)
    x = np.random.default_rng(5).standard_normal((6, 3)).astype(np.float32)
    rb = pa.RecordBatch.from_arrays([pa.array(list(x), type=pa.list_(pa.float32()))], names=["arr"])
    spec = [{"name": "arr", "dtype": "float32", "shape": [3], "kind": "array"}]
    fn = model_mod._make_transform_fn(TorchModel, "device-probe", _Shared(data), spec, [0], [], ["t__output"],
                                      [[4]], 4)
    assert inference_device() is None
    got = pa.Table.from_batches(list(fn(iter([rb])))).column("t__output").to_pylist()
    assert np.array(got)[:, 1:].tolist() == [[-1.0, 1.0, -1.0]] * 6  # set while it ran: use_gpu off, the CPU
    assert inference_device() is None
    with pytest.raises(ValueError, match="values per row"):
        bad = pa.RecordBatch.from_arrays([pa.array([[1.0, 2.0]], type=pa.list_(pa.float32()))], names=["arr"])
        list(fn(iter([bad])))
    assert inference_device() is None
