"""One rank of the process-set checks of spark_hvd.keras (TensorFlow backend); run as
``spark-hvd-run -np 3 python kpsets_worker.py OUT_DIR``. Results go to ``OUT_DIR/kpsets-rank<r>.json``.

Set {0, 2} runs the collectives and a ``DistributedOptimizer(process_set=)`` update while rank 1 works alone;
values are checked against numpy on the same data.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from checks import make_check  # noqa: E402 - the scripts' directory is on sys.path

import spark_hvd.keras as hvd  # noqa: E402

RESULTS: dict[str, str] = {}


check = make_check(RESULTS, after=hvd.barrier)  # every check starts together


hvd.init()
R, N = hvd.rank(), hvd.size()
assert N == 3, "these checks need 3 ranks"
MEMBERS = [0, 2]
PAIR = hvd.add_process_set(MEMBERS)
IN = R in MEMBERS


def rnd(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


@check("collectives")
def _collectives() -> None:
    x = {q: rnd(700 + q, 3, 2) for q in range(N)}
    if not IN:
        try:
            hvd.allreduce(x[R], process_set=PAIR)
        except ValueError as e:
            assert "rank 1 is not a member" in str(e), str(e)
        else:
            raise AssertionError("allreduce on a set without this rank did not raise")
        return
    np.testing.assert_allclose(hvd.allreduce(x[R], op=hvd.Sum, process_set=PAIR).numpy(), x[0] + x[2])
    np.testing.assert_allclose(hvd.allreduce(x[R], process_set=PAIR).numpy(), (x[0] + x[2]) / 2)
    np.testing.assert_allclose(hvd.allgather(x[R], process_set=PAIR).numpy(), np.concatenate([x[0], x[2]]))
    np.testing.assert_allclose(hvd.broadcast(x[R], root_rank=2, process_set=PAIR).numpy(), x[2])
    part = hvd.reducescatter(np.concatenate([x[R], x[R]]), op=hvd.Sum, process_set=PAIR).numpy()
    np.testing.assert_allclose(part, x[0] + x[2])  # each member's half of [x0 + x2; x0 + x2]


@check("optimizer")
def _optimizer() -> None:
    start = np.ones((2, 2))
    v = keras.Variable(start.copy(), dtype="float64")
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.5), process_set=PAIR)
    g = {q: rnd(800 + q, 2, 2) for q in range(N)}
    opt.apply_gradients([(keras.ops.convert_to_tensor(g[R], dtype="float64"), v)])
    want = (g[0] + g[2]) / 2 if IN else g[1]
    np.testing.assert_allclose(np.asarray(v.numpy()), start - 0.5 * want, rtol=1e-12)


out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
with open(os.path.join(out_dir, f"kpsets-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
