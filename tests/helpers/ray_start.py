"""Starting a local Ray cluster in a test, tried again when Ray does not come up: Ray gives a node 30 s to register
with its GCS (fixed in ``ray._private.node``), which a loaded 2-core machine has exceeded (CI, 2026-12-08: "The
current node timed out during startup")."""

from __future__ import annotations

import glob
import os
import signal
import sys
import time
from collections.abc import Callable

START_TRIES = 3


def start_ray(start: Callable[[str], None], stop: Callable[[], None], temp_dir: str, tries: int = START_TRIES) -> str:
    """Call ``start(attempt_dir)`` up to ``tries`` times, each in a fresh folder under ``temp_dir``, and give the
    folder of the try that returned. A try that raises is stopped (``stop()``, then every process still naming its
    folder killed, the tails of its logs printed for the test's report) before the next; the last try's error is
    raised with the tries counted."""
    for attempt in range(1, tries + 1):
        attempt_dir = os.path.join(temp_dir, f"try{attempt}")
        os.makedirs(attempt_dir)
        try:
            start(attempt_dir)
            return attempt_dir
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a node does not register
            try:
                stop()
            finally:
                _kill_processes_naming(attempt_dir)
            print(f"Ray did not start (try {attempt} of {tries}): {exc}\n{_log_tails(attempt_dir)}",
                  file=sys.stderr)
            if attempt == tries:
                raise RuntimeError(f"Ray did not start in {tries} tries (logs above): {exc}") from exc
    raise AssertionError("unreachable")


def _kill_processes_naming(folder: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process whose command line names ``folder`` (a failed node's GCS, raylet and agents), and wait
    until they are gone."""
    def naming() -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if folder.encode() in f.read():
                            pids.append(int(entry))
                except OSError:
                    pass
        return pids

    for pid in naming():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    while naming() and time.monotonic() < deadline:
        time.sleep(0.1)


def _log_tails(folder: str, lines: int = 15) -> str:
    """The last ``lines`` lines of the GCS's and raylets' logs under ``folder``."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "logs", "*"), recursive=True)):
        if os.path.basename(path).startswith(("gcs_server", "raylet")) and path.endswith((".out", ".err")):
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
            if tail:
                out.append(f"--- {path}\n{''.join(tail)}")
    return "\n".join(out)
