"""spark_hvd.mxnet when a rank dies: the survivors' collectives fail fast with an error naming the dead rank."""

from __future__ import annotations

import pytest
from helpers.mxnet_env import mxnet_skip_reason
from helpers.ranks import RankDied, run_ranks

# The floor leg (make leg-floor) installs MXNet and runs these with the compatibility subset; elsewhere they skip.
pytestmark = pytest.mark.compat

if (_reason := mxnet_skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)


def _dead_rank_job() -> str:
    import os
    import signal
    import warnings

    warnings.simplefilter("ignore", DeprecationWarning)
    import mxnet as mx

    import spark_hvd.mxnet as hvd

    hvd.init()
    x = mx.nd.ones((8,))
    hvd.allreduce_(x, op=hvd.Sum, name="before")
    assert x.asnumpy().tolist() == [2.0] * 8
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    net = mx.gluon.nn.Dense(4, in_units=3)
    net.initialize()
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with mx.autograd.record():
        loss = net((mx.np if int(mx.__version__[0]) >= 2 else mx.nd).ones((2, 3))).sum()
    loss.backward()
    try:
        trainer.step(2)
    except hvd.HorovodInternalError as e:
        return f"{type(e).__name__}|{getattr(e, 'rank', None)}|{e}"
    return "no error"


@pytest.mark.timeout(120)
def test_dead_rank_is_named_by_the_survivor():
    results = run_ranks(_dead_rank_job, 2, env={"SPARK_HVD_TIMEOUT": "10", "OMP_NUM_THREADS": "1"}, timeout=90,
                        allow_death={1})
    assert isinstance(results[1], RankDied)
    kind, rank, message = results[0].split("|", 2)
    assert kind in ("PeerFailureError", "CollectiveTimeoutError"), results[0]
    assert rank == "1" and "rank 1" in message, results[0]
