"""When the engine's next round starts: the cycle, bursts, back-off while work waits elsewhere, heartbeats.

Thread-free; the engine thread asks ``Pacer.next_round`` when to run its next round and tells it when one started
(``last_start``) and whether it moved anything (``progressed`` / ``idle``).

- With local work, a round starts ``cycle_time_ms`` after the previous one (or after the first submission following
  an idle spell), extended while a burst of submissions is still arriving (up to ``BURST_CYCLES`` cycles) so one
  round carries it. A caller that waits on a handle whose request is still unsent starts the round at once (the
  engine's ``hurry``): nothing submitted later could join that operation, so the cycle would only add latency.
- With work outstanding on some rank but none here, the rounds back off from ``cycle_time_ms`` to 10 ms while no
  progress is made, and to 100 ms once nothing has moved for a second (a peer in validation, a stalled tensor).
- With nothing outstanding anywhere, a heartbeat round every ``min(1 s, timeout / 4)`` keeps a peer waiting in a
  round from timing out (e.g. while rank 0 runs validation) and notices dead peers; a rank does not spin.
"""

from __future__ import annotations

MAX_BACKOFF_S = 0.010  # round interval while work waits on another rank ...
LONG_BACKOFF_S = 0.100  # ... and once nothing has moved for LONG_WAIT_S (a peer in validation, a stall)
LONG_WAIT_S = 1.0
BURST_CYCLES = 5


class Pacer:
    """The round timing of one engine (``size`` ranks, ``timeout_s``: the backend's timeout)."""

    def __init__(self, cycle_time_ms: float, size: int, timeout_s: float) -> None:
        self.heartbeat = 60.0 if size == 1 else max(0.05, min(1.0, timeout_s / 4.0))
        self.cycle = self.backoff_cap = 0.0
        self.set_cycle(cycle_time_ms)
        self.last_start = 0.0  # when the last round started
        self.idle_rounds = 0  # rounds in a row that moved nothing
        self.progress_at = 0.0  # when a round last moved something

    def set_cycle(self, cycle_time_ms: float) -> None:
        """Run with this cycle time from now on (autotune's switch)."""
        self.cycle = max(cycle_time_ms, 0.0) / 1000.0
        self.backoff_cap = max(self.cycle, MAX_BACKOFF_S)

    def progressed(self, now: float) -> None:
        """A round moved something (at ``now``)."""
        self.idle_rounds = 0
        self.progress_at = now

    def idle(self) -> None:
        """A round moved nothing."""
        self.idle_rounds += 1

    def next_round(self, now: float, first_seen: float | None, idle_before: bool, last_enqueue: float,
                   table_idle: bool) -> float:
        """When the next round should start. ``first_seen``: when this wait first saw local work (None: there is
        none); ``idle_before``: nothing was outstanding when the wait began; ``last_enqueue``: the latest
        submission; ``table_idle``: nothing is outstanding on any rank."""
        cycle = self.cycle
        if first_seen is not None:
            target = self.last_start + cycle
            if idle_before:  # collect a cycle's worth of submissions after idling
                target = max(target, first_seen + cycle)
            if cycle > 0 and target <= now:
                # a burst of submissions still under way (a loop enqueueing gradients): let it finish, so the ranks
                # negotiate it in one round, for at most BURST_CYCLES cycles
                quiet_at = last_enqueue + cycle / 2
                if quiet_at > now and now < first_seen + BURST_CYCLES * cycle:
                    target = quiet_at
            return target
        if not table_idle:
            cap = self.backoff_cap
            if now - self.progress_at > LONG_WAIT_S:
                cap = max(cap, min(LONG_BACKOFF_S, self.heartbeat))
            return self.last_start + min(cap, cycle * (2 ** min(self.idle_rounds, 16)))
        return self.last_start + self.heartbeat
