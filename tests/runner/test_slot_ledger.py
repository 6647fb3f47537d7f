"""Concurrent runs of one process share the session's task slots: a run that does not fit waits for the others
(never more slots held than the session has, no deadlock), with a message; then on Spark, two barrier stages that
do not fit at once run one after the other instead of the second failing."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from spark_hvd.runner.errors import NotEnoughSlotsError
from spark_hvd.runner.slot_ledger import SlotLedger


def test_reservations_never_exceed_the_slots_and_all_complete(caplog):
    ledger, lock = SlotLedger(), threading.Lock()
    held, peak, done, errors = [0], [0], [], []
    release = [threading.Event() for _ in range(5)]

    def job(i, need):
        try:
            with ledger.reserve("s", need, 4, what=f"job {i}", timeout_s=60):
                with lock:
                    held[0] += need
                    peak[0] = max(peak[0], held[0])
                release[i].wait(60)
                with lock:
                    held[0] -= need
            done.append(i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    caplog.set_level(logging.WARNING, logger="spark_hvd.runner.slot_ledger")
    threads = [threading.Thread(target=job, args=(i, need)) for i, need in enumerate([2, 2, 2, 3, 1])]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while ledger.held("s") < 4 and time.monotonic() < deadline:  # two of the 2-slot jobs (or 3 + 1) got in
        time.sleep(0.01)
    assert ledger.held("s") == 4 and len(done) == 0
    for ev in release:  # let them finish in turn; the waiting ones get in as slots come back
        ev.set()
    for t in threads:
        t.join(60)
    assert not errors and sorted(done) == [0, 1, 2, 3, 4]
    assert peak[0] <= 4 and ledger.held("s") == 0
    assert any("waiting for them to finish" in r.getMessage() for r in caplog.records)


def test_a_reservation_bigger_than_the_session_or_waiting_too_long_fails():
    ledger = SlotLedger()
    with pytest.raises(NotEnoughSlotsError, match="num_proc=5"):
        with ledger.reserve("s", 5, 4):
            pass
    with ledger.reserve("s", 3, 4):
        with pytest.raises(NotEnoughSlotsError, match="only 1 free task slots"):
            with ledger.reserve("s", 2, 4, timeout_s=0.2):
                pass
        assert ledger.held("s") == 3
    assert ledger.held("s") == 0 and ledger.holders("s") == 0


@pytest.mark.spark
@pytest.mark.slow
def test_two_runs_that_do_not_fit_at_once_run_one_after_the_other(spark):
    """Two run(num_proc=2) at once on local[2]: both complete, their ranks never overlap in time (the second one
    started after the first one's ranks ended), instead of the second failing on the busy slots."""
    from spark_hvd.runner import run

    def fn():
        import time as t

        begin = t.time()
        t.sleep(1.0)  # long enough that the second run's slot check finds the slots busy
        return begin, t.time()

    results, errors = [], []

    def launch():
        try:
            results.append(run(fn, num_proc=2, verbose=0, spark=spark))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=launch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    (a, b) = sorted(results, key=lambda r: min(x[0] for x in r))
    assert max(end for _, end in a) <= min(begin for begin, _ in b)
