"""The start and the end of the spark_hvd.mxnet worker scripts (``mxnet_worker.py``, ``mxnet_zero_worker.py``):
MXNet imported without its numpy deprecation warnings, the job initialised, the ``@check`` registry, and
:func:`finish`, which writes the results where ``helpers.launch.launch_worker`` reads them
(``OUT_DIR/mxnet-rank<r>.json``) and leaves the job; and the trainer checks' pieces: every rank's batches from
seeds, one training loop for a job and for one process on the combined batches. Import it before MXNet."""

from __future__ import annotations

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)  # MXNet 1.9 reads np.bool and friends

from collections.abc import Callable  # noqa: E402

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from checks import make_check  # noqa: E402 - the scripts' directory is on sys.path

import spark_hvd.mxnet as hvd  # noqa: E402

RESULTS: dict[str, str] = {}
OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else "."
check = make_check(RESULTS, after=lambda: hvd.barrier())

hvd.init()
R, N = hvd.rank(), hvd.size()


BATCH = 6
# Gluon's blocks take mx.nd arrays in MXNet 1.x, mx.np arrays in MXNet 2 (the beta: docs/mxnet.md)
MXNET2 = int(mx.__version__.split(".")[0]) >= 2
gluon_array = mx.np.array if MXNET2 else mx.nd.array
LOSS = mx.gluon.loss.SoftmaxCrossEntropyLoss()


def batches(r: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``r``'s batch of ``step``: BATCH rows of 5 features, labels of 3 classes."""
    rng = np.random.default_rng(500 + 10 * step + r)
    return rng.standard_normal((BATCH, 5)).astype(np.float32), rng.integers(0, 3, BATCH).astype(np.float32)


def train(net: mx.gluon.Block, trainer: mx.gluon.Trainer, shards: list[int], steps: range,
          weights: Callable[[mx.gluon.Block], list[np.ndarray]]) -> list[list[np.ndarray]]:
    """``steps`` steps on the batches of ranks ``shards`` (this rank's own in a job, every rank's in one process);
    ``weights(net)`` after each."""
    history = []
    for step in steps:
        xs, ys = zip(*[batches(r, step) for r in shards], strict=True)
        x, y = gluon_array(np.concatenate(xs)), gluon_array(np.concatenate(ys))
        with mx.autograd.record():
            loss = LOSS(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        history.append(weights(net))
    return history


def finish() -> None:
    """Write this rank's results and leave the job."""
    with open(os.path.join(OUT_DIR, f"mxnet-rank{R}.json"), "w") as f:
        json.dump({"rank": R, "size": N, "results": RESULTS}, f)
    hvd.shutdown()
