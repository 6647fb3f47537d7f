"""The reader's options through a whole TorchEstimator fit on two ranks: Vectors kept sparse
(``sparse_vectors="sparse"``, handed to ``collate_fn`` as a CSR matrix and to ``transformation_fn`` as the
DataFrame's Vectors, in training and in ``transform`` alike) and the process decode pool
(``reader_pool_type="process"``: ``transformation_fn`` runs in worker processes of each rank)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import cloudpickle
import numpy as np
import pytest

torch = pytest.importorskip("torch")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import this test module

W = np.array([2.0, -1.0, 0.0, 0.5, 0.0, 0.0, 1.5, 0.0, -2.0, 0.0], dtype=np.float32)


@pytest.mark.spark
@pytest.mark.slow
def test_sparse_vectors_reach_collate_fn_as_csr_in_fit_and_transform(spark, tmp_path):
    """Mostly-zero Vectors (sparse and dense ones) stored sparse: collate_fn gets a float32 CSR matrix on the
    ranks (it raises otherwise, failing the fit) and at transform; the regression learns W; transform equals the
    model on the densified vectors."""
    import scipy.sparse
    from pyspark.ml.linalg import Vectors

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    rng = np.random.default_rng(2)
    rows = []
    for i in range(240):
        dense = np.zeros(10)
        idx = rng.choice(10, size=3, replace=False)
        dense[idx] = rng.standard_normal(3)
        vec = Vectors.sparse(10, {int(j): float(dense[j]) for j in idx}) if i % 4 else Vectors.dense(dense)
        rows.append((vec, float(dense @ W)))
    df = spark.createDataFrame(rows, ["vec", "y"])

    def densify(batch):
        if not (scipy.sparse.issparse(batch["vec"]) and batch["vec"].format == "csr"
                and batch["vec"].dtype == np.float32):
            raise TypeError(f"expected a float32 CSR matrix, got {type(batch['vec'])}")
        return {**batch, "vec": batch["vec"].toarray()}

    torch.manual_seed(0)
    net = torch.nn.Linear(10, 1)
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.2), loss="mse", feature_cols=["vec"],
                         label_cols=["y"], batch_size=16, epochs=4, random_seed=1, partitions_per_process=2,
                         sparse_vectors="sparse", collate_fn=densify, verbose=0)
    model = est.fit(df)
    hist = model.getHistory()
    assert hist["loss"][-1] * 20 <= hist["loss"][0], hist
    np.testing.assert_allclose(model.getModel().weight.detach().numpy().reshape(-1), W, atol=0.15)
    out = model.transform(df.limit(40)).collect()
    dense = np.array([r.vec.toArray() for r in out], dtype=np.float32)
    with torch.no_grad():
        direct = model.getModel()(torch.from_numpy(dense)).numpy().reshape(-1)
    np.testing.assert_allclose([r.y__output for r in out], direct, rtol=1e-5, atol=1e-6)


class _SeenVectors:
    """Writes what it gets (each row's ``repr``) to a new file in ``seen``; hands the model the dense values."""

    def __init__(self, seen: str) -> None:
        self.seen = seen

    def __call__(self, df):
        import uuid

        with open(os.path.join(self.seen, uuid.uuid4().hex), "w") as f:
            f.write("\n".join(repr(v) for v in df["vec"]))
        return df.assign(vec=[v.toArray().astype(np.float32) for v in df["vec"]])

    def rows(self) -> set[str]:
        """The rows seen so far, forgotten by the next call."""
        seen = set()
        for name in os.listdir(self.seen):
            with open(os.path.join(self.seen, name)) as f:
                seen |= set(f.read().splitlines())
            os.remove(os.path.join(self.seen, name))
        return seen


@pytest.mark.spark
@pytest.mark.slow
def test_transformation_fn_sees_the_same_vectors_in_fit_and_transform(spark, tmp_path):
    """Vectors stored sparse reach transformation_fn as the DataFrame's own SparseVector / DenseVector objects on
    the ranks and in transform alike (training once got Spark's struct as dicts, transform dense arrays)."""
    from pyspark.ml.linalg import Vectors

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    rows = [(Vectors.sparse(10, {i % 10: float(i), (i + 5) % 10: -0.5}) if i % 3
             else Vectors.dense(np.arange(10) * 0.25 + i), float(i % 2)) for i in range(48)]
    df = spark.createDataFrame(rows, ["vec", "y"])
    want = {repr(v) for v, _ in rows}
    (tmp_path / "seen").mkdir()
    seen = _SeenVectors(str(tmp_path / "seen"))
    net = torch.nn.Linear(10, 1)
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.01), loss="mse", feature_cols=["vec"],
                         label_cols=["y"], batch_size=8, epochs=1, random_seed=1, sparse_vectors="sparse",
                         transformation_fn=seen, verbose=0)
    model = est.fit(df)
    assert seen.rows() == want  # every row, on the ranks (and the driver's first rows), as the DataFrame holds it
    out = model.transform(df).collect()
    assert seen.rows() == want
    dense = np.array([r.vec.toArray() for r in out], dtype=np.float32)
    with torch.no_grad():
        direct = model.getModel()(torch.from_numpy(dense)).numpy().reshape(-1)
    np.testing.assert_allclose([r.y__output for r in out], direct, rtol=1e-5, atol=1e-6)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _DecodeInWorker:
    """float32 bytes -> arrays; leaves a mark (its process's name and pid) in ``marks`` wherever it runs outside
    a main process (a worker of the process pool)."""

    def __init__(self, marks: str) -> None:
        self.marks = marks

    def __call__(self, df):
        proc = multiprocessing.current_process()
        if proc.name != "MainProcess":
            open(os.path.join(self.marks, f"{proc.name}-{os.getpid()}"), "w").close()
        out = df.copy()
        out["x"] = [np.frombuffer(b, dtype=np.float32) for b in df["x"]]
        return out


@pytest.mark.spark
@pytest.mark.slow
def test_process_pool_decodes_in_worker_processes_during_fit(spark, tmp_path):
    """reader_pool_type="process": the transformation_fn runs in pool processes of the ranks (their marks), the
    regression on the decoded bytes learns, and transform (in the Spark task, no pool) equals the model on them."""
    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    rng = np.random.default_rng(3)
    x = rng.standard_normal((200, 10)).astype(np.float32)
    df = spark.createDataFrame([(bytearray(r.tobytes()), float(r @ W)) for r in x], "x binary, y double")
    marks = tmp_path / "marks"
    marks.mkdir()
    torch.manual_seed(0)
    net = torch.nn.Linear(10, 1)
    est = TorchEstimator(num_proc=2, store=Store.create(str(tmp_path / "store")), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss="mse", feature_cols=["x"],
                         label_cols=["y"], batch_size=16, epochs=3, random_seed=1, partitions_per_process=2,
                         transformation_fn=_DecodeInWorker(str(marks)), reader_pool_type="process",
                         train_reader_num_workers=2, verbose=0)
    model = est.fit(df)
    hist = model.getHistory()
    assert hist["loss"][-1] * 20 <= hist["loss"][0], hist
    workers = os.listdir(marks)
    assert workers and all(not name.startswith("MainProcess") for name in workers), workers
    # the pool's workers end with the fit, also where Spark keeps the rank's Python worker for the next task
    pids = {int(name.rsplit("-", 1)[1]) for name in workers}
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)]
    out = model.transform(df.limit(30)).collect()
    decoded = np.stack([np.frombuffer(bytes(r.x), dtype=np.float32) for r in out])
    with torch.no_grad():
        direct = model.getModel()(torch.from_numpy(decoded)).numpy().reshape(-1)
    np.testing.assert_allclose([r.y__output for r in out], direct, rtol=1e-5, atol=1e-6)
