"""KerasEstimator's training loop on Keras's torch backend on a GPU, against the same loop on the CPU, without Spark.

As ``test_torch_rank_gpu.py`` does for torch: the very ``train_on_rank(KerasTrainer, spec)`` that ``fit`` runs in
Spark's barrier tasks runs here in ranks launched as ``spark-hvd-run`` launches them, on Parquet written with
pyarrow, so a GPU machine without a JVM (or TensorFlow) runs it. Keras picks its backend once per process, so the
whole check runs in a fresh Python process with ``KERAS_BACKEND=torch``. The GPU run pins the rank's GPU
(``SPARK_HVD_GPU``), its gradients are CUDA tensors averaged by the engine's device path; the CPU run's ranks start
with ``KERAS_TORCH_DEVICE=cpu`` (Keras fixes its torch device at import: see docs/gpus.md). A metric reports whether the
model's output was on CUDA, so each run provably trained where it should.

Needs CUDA: skipped, saying why, without it. (TensorFlow on GPUs is not covered: no machine with both was lent.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")

SCRIPT = textwrap.dedent("""
    import os
    import sys

    import keras
    import numpy as np

    from spark_hvd.estimators.common.rank_run import train_on_rank


    def on_cuda(y_true, y_pred):
        return keras.ops.convert_to_tensor(float(y_pred.device.type == "cuda"))


    def rank_fit(spec):
        from spark_hvd.estimators.keras.rank import KerasTrainer

        return train_on_rank(KerasTrainer, spec)


    def fit(store, data, run_id, env):
        from helpers.ranks import run_ranks

        from spark_hvd.estimators import KerasEstimator

        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(32, activation="tanh"),
                                  keras.layers.Dense(1)])
        est = KerasEstimator(store=store, model=model, optimizer=keras.optimizers.SGD(learning_rate=0.05),
                             loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=3,
                             random_seed=3, verbose=0, metrics=[on_cuda], run_id=run_id)
        spec = est._spec(store, run_id, data, est._check_model(model))
        (result,) = run_ranks(rank_fit, 1, env={"SPARK_HVD_TIMEOUT": "60", "KERAS_BACKEND": "torch", **env},
                              args=(spec,), timeout=300)
        return result["history"], est._load_trained_model(store, run_id, spec.model_bytes)


    if __name__ == "__main__":
        import pyarrow as pa
        import pyarrow.parquet as pq

        from spark_hvd.data.parquet import describe_parquet
        from spark_hvd.store import Store

        assert keras.backend.backend() == "torch"
        root = sys.argv[1]
        store = Store.create(os.path.join(root, "store"))
        rng = np.random.default_rng(5)
        x = rng.standard_normal((512, 8)).astype(np.float32)
        y = (x @ rng.standard_normal(8) + 0.3).astype(np.float32)
        path = os.path.join(root, "data")
        os.makedirs(path)
        pq.write_table(pa.table({"features": pa.array(list(x), type=pa.list_(pa.float32())), "y": y}),
                       os.path.join(path, "part-0.parquet"), row_group_size=64)
        data = describe_parquet(store, path, ["features"], ["y"], num_proc=1)
        gpu_history, gpu_model = fit(store, data, "keras-gpu", {"SPARK_HVD_GPU": "0"})
        os.environ["KERAS_TORCH_DEVICE"] = "cpu"  # inherited by the ranks spawned next, before they import Keras
        cpu_history, cpu_model = fit(store, data, "keras-cpu", {})
        assert gpu_history["on_cuda"] == [1.0] * 3, gpu_history
        assert cpu_history["on_cuda"] == [0.0] * 3, cpu_history
        assert gpu_history["loss"][-1] * 3 <= gpu_history["loss"][0], gpu_history
        np.testing.assert_allclose(gpu_history["loss"], cpu_history["loss"], rtol=1e-4, atol=1e-4)
        for got, want in zip(gpu_model.get_weights(), cpu_model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        print("KERAS GPU == CPU")
""")



def test_keras_torch_backend_gpu_fit_equals_cpu_fit(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "keras_gpu_check.py"  # a file: the spawned ranks import its functions from it
    script.write_text(SCRIPT)
    env = {**os.environ, "KERAS_BACKEND": "torch",
           "PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop("KERAS_TORCH_DEVICE", None)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "KERAS GPU == CPU" in done.stdout, done.stdout[-3000:] + done.stderr[-5000:]
