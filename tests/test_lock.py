"""tools/lock.py: the check that `make test` runs against the lock (constraints.txt) names every difference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("lock", Path(__file__).resolve().parents[1] / "tools" / "lock.py")
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)


def test_the_committed_lock_pins_every_line_exactly():
    pins = lock.read_lock()
    assert {"torch", "pyspark", "cloudpickle", "numpy", "pip"} <= pins.keys()
    assert all(version and not version.startswith(("<", ">", "~", "=")) for version in pins.values())


def test_differences_name_changed_missing_and_unlocked_packages():
    locked = {"cloudpickle": "3.1.2", "numpy": "2.4.6", "tqdm": "4.67.1"}
    present = {"cloudpickle": "3.1.3", "numpy": "2.4.6", "pillow": "13.0.0"}
    assert lock.differences(locked, present) == [
        "  cloudpickle: 3.1.3 installed, locked 3.1.2",
        "  pillow: 13.0.0 installed, not in the lock",
        "  tqdm: locked 4.67.1, not installed",
    ]
    assert lock.differences(locked, dict(locked)) == []


def test_names_are_compared_normalised(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text("# a comment\nGoogle_Auth==2.41.0\nzope.interface==8.0  # trailing comment\n")
    assert lock.read_lock(path) == {"google-auth": "2.41.0", "zope-interface": "8.0"}
    path.write_text("numpy>=2\n")
    with pytest.raises(SystemExit, match="not an exact pin"):
        lock.read_lock(path)
