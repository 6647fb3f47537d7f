"""The benchmark driver's variants (``IMPL:VARIANT`` with ``BENCH_VARIANTS``) and the perf summary's line parser."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import allreduce  # noqa: E402
import allreduce_perf  # noqa: E402


def test_variant_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_VARIANTS", json.dumps({"python": {"SPARK_HVD_COMPILED_RING": 0}}))
    assert allreduce.variant_env("ring") == {}
    assert allreduce.variant_env("ring:python") == {"SPARK_HVD_COMPILED_RING": "0"}
    with pytest.raises(ValueError, match="no variant 'other'"):
        allreduce.variant_env("ring:other")
    with pytest.raises(ValueError, match="unknown implementation 'rings'"):
        allreduce.variant_env("rings:python")


def test_perf_lines() -> None:
    self_line = "    18.92%  [kernel.kallsyms]   [k] _copy_from_iter"
    child_line = "    28.20%     0.37%  [k] tcp_sendmsg"
    m = allreduce_perf._LINE.match(self_line)
    assert m is not None and (m.group(1), m.group(3), m.group(4)) == ("18.92", "[kernel.kallsyms]", "_copy_from_iter")
    m = allreduce_perf._LINE.match(child_line)
    assert m is not None and (m.group(1), m.group(4)) == ("28.20", "tcp_sendmsg")
