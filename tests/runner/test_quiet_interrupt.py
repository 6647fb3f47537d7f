"""QuietInterrupt: a SIGINT while a training stage runs raises Spark's cancellation loggers to ERROR before
pyspark's handler cancels the jobs, and stopping gives the loggers and the SIGINT handler back as they were.
(The whole path, a real fit interrupted in a fresh driver, is tests/estimators/test_interrupt.py.)"""

from __future__ import annotations

import signal

import pytest

from spark_hvd.runner.interrupt import NOISY_LOGGERS, QuietInterrupt

pytestmark = pytest.mark.spark


def _state(spark):
    """Per noisy logger: (its effective level, whether a logger config of exactly that name exists)."""
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    config = log4j.LogManager.getContext(False).getConfiguration()
    child = {"org.apache.spark.scheduler": ".TaskSetManager", "org.apache.spark.sql.execution.python":
             ".MapInBatchEvaluatorFactory$MapInBatchEvaluator$$anon$1"}
    return {name: (str(log4j.LogManager.getLogger(name + child.get(name, "")).getLevel()),
                   config.getLoggerConfig(name).getName() == name) for name in NOISY_LOGGERS}


def test_sigint_quiets_spark_cancellation_loggers_until_stopped(spark):
    before, handler = _state(spark), signal.getsignal(signal.SIGINT)
    assert all(level in ("WARN", "INFO", "DEBUG", "TRACE", "ALL") for level, _ in before.values()), before
    quiet = QuietInterrupt(spark).start()
    try:
        assert signal.getsignal(signal.SIGINT) is not handler
        assert _state(spark) == before  # nothing changes before an interrupt
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # the handler runs before this returns
        assert all(level == "ERROR" for level, _ in _state(spark).values()), _state(spark)
    finally:
        quiet.stop()
    assert _state(spark) == before
    assert signal.getsignal(signal.SIGINT) is handler


def test_no_handler_for_spark_connect_or_outside_the_main_thread(spark):
    import threading

    handler = signal.getsignal(signal.SIGINT)
    with QuietInterrupt(object()):  # not a classic session: nothing to quiet
        assert signal.getsignal(signal.SIGINT) is handler
    seen = []
    thread = threading.Thread(target=lambda: seen.append(QuietInterrupt(spark).start()._quieted))
    thread.start()
    thread.join(30)
    assert seen == [None] and signal.getsignal(signal.SIGINT) is handler
