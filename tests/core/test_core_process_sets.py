"""Process sets on the core's numpy API: at N=3 under spark-hvd-run (disjoint sets working at once, overlapping
sets used in turn by their common rank, values against numpy), and on a Spark barrier stage (the sets are
joined through the same global engine whatever the rendezvous of the job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

WORKER = textwrap.dedent('''
    import json, sys
    import numpy as np
    import spark_hvd.core as c

    c.init()
    r = c.rank()
    pair, solo, left = c.add_process_set([0, 2]), c.add_process_set([1]), c.add_process_set([0, 1])
    out = {"ids": [pair.process_set_id, solo.process_set_id, left.process_set_id]}
    data = [np.arange(4.0) * (q + 1) for q in range(3)]
    for step in range(3):  # rank 0 alternates between its two sets; rank 2 and rank 1 keep to theirs
        if r in (0, 2):
            x = data[r].copy()
            c.allreduce(x, op=c.Sum, name=f"pair.{step}", process_set=pair)
            out[f"pair.{step}"] = x.tolist()
        if r in (0, 1):
            y = data[r].copy()
            c.allreduce(y, process_set=left)  # average over the 2 ranks of the set
            out[f"left.{step}"] = y.tolist()
        if r == 1:
            out[f"solo.{step}"] = c.allgather(np.array([step]), process_set=solo).tolist()
    if r in (0, 2):
        h = c.allgather_async(np.full((r + 1, 2), float(r)), process_set=pair)
        out["gather"] = c.synchronize(h).tolist()
        b = np.full(3, float(r))
        c.broadcast(b, root_rank=2, process_set=pair)
        out["bcast"] = b.tolist()
        out["alltoall"] = [a.tolist() if hasattr(a, "tolist") else a
                           for a in c.alltoall(np.arange(4.0) + 10 * r, [1, 3], process_set=pair)]
        out["rs"] = c.reducescatter(np.arange(6.0).reshape(3, 2) * (r + 1), op=c.Sum, process_set=pair).tolist()
        out["objects"] = c.allgather_object({"r": r}, process_set=pair)
    try:
        c.barrier(process_set=pair)
        out["barrier"] = "ok"
    except ValueError as e:
        out["barrier"] = str(e)
    out["removed"] = [c.remove_process_set(s) for s in (pair, solo, left, pair)]
    x = np.ones(1)
    c.allreduce(x, op=c.Sum)
    out["global"] = x.tolist()
    json.dump(out, open(f"{sys.argv[1]}/core-ps-{r}.json", "w"))
    c.shutdown()
''')


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_process_sets_numpy_three_ranks(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_HVD_")}
    env["SPARK_HVD_TIMEOUT"] = "60"
    proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "3", "--timeout", "150", sys.executable,
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = [json.loads((tmp_path / f"core-ps-{r}.json").read_text()) for r in range(3)]
    data = [np.arange(4.0) * (q + 1) for q in range(3)]
    for r in range(3):
        assert res[r]["ids"] == [1, 2, 3]
        assert res[r]["removed"] == [True, True, True, False]
        assert res[r]["global"] == [3.0]
    for step in range(3):
        for r in (0, 2):
            np.testing.assert_allclose(res[r][f"pair.{step}"], data[0] + data[2])
        for r in (0, 1):
            np.testing.assert_allclose(res[r][f"left.{step}"], (data[0] + data[1]) / 2)
        assert res[1][f"solo.{step}"] == [step]
    for r in (0, 2):
        assert res[r]["gather"] == [[0.0, 0.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
        assert res[r]["bcast"] == [2.0, 2.0, 2.0]
        assert res[r]["objects"] == [{"r": 0}, {"r": 2}]
        assert res[r]["barrier"] == "ok"
    assert res[0]["alltoall"] == [[0.0, 20.0], [1, 1]]
    assert res[2]["alltoall"] == [[1.0, 2.0, 3.0, 21.0, 22.0, 23.0], [3, 3]]
    total = np.arange(6.0).reshape(3, 2) * 4  # rank 0's times 1 plus rank 2's times 3
    np.testing.assert_allclose(res[0]["rs"], total[:2])
    np.testing.assert_allclose(res[2]["rs"], total[2:])
    assert res[1]["barrier"] == "barrier(): rank 1 is not a member of the provided process set 1 (ranks [0, 2])"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_process_sets_on_a_spark_barrier_stage(spark):
    from spark_hvd.runner import run

    def fn() -> list:  # defined here: shipped by value
        import numpy as np

        import spark_hvd.core as c

        r = c.rank()
        mine = c.add_process_set([0]), c.add_process_set([1])
        x = np.full(2, float(r + 1))
        c.allreduce(x, op=c.Sum, process_set=mine[r])
        y = np.full(2, float(r + 1))
        c.allreduce(y, op=c.Sum)
        for s in mine:
            c.remove_process_set(s)
        return [x.tolist(), y.tolist(), mine[r].process_set_id]

    results = run(fn, num_proc=2, verbose=0)
    assert results == [[[1.0, 1.0], [3.0, 3.0], None], [[2.0, 2.0], [3.0, 3.0], None]]
