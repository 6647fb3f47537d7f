"""setup.cfg's requirements against the runtime legs (runtimes/*.txt, tools/leg.py): ranges, never exact pins, and
every runtime's own versions inside them, so that installing spark_hvd there has nothing to replace. The legs check
the same by installing (``make legs``); this finds a too-high floor in a second, without building anything."""

from __future__ import annotations

import configparser
import importlib.util
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[1]
LEGS = sorted((ROOT / "runtimes").glob("*.txt"))


def _tool(name: str):
    """tools/<name>.py as a module (leg.py imports lock.py by name, as it does when run as a script)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


lock = _tool("lock")
leg = _tool("leg")


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _requirements(value: str) -> list[Requirement]:
    return [Requirement(line) for line in value.strip().splitlines() if line.strip()]


def test_install_requires_and_every_extra_are_ranges_never_exact_pins():
    config = _setup_cfg()
    groups = {"install_requires": config["options"]["install_requires"], **config["options.extras_require"]}
    pinned = [f"{group}: {req}" for group, value in groups.items() for req in _requirements(value)
              if any(spec.operator in ("==", "===") for spec in req.specifier)]
    assert not pinned, "exact pins belong in the lock (constraints.txt), not in setup.cfg: " + ", ".join(pinned)


@pytest.mark.parametrize("leg_file", LEGS, ids=[p.stem for p in LEGS])
def test_every_runtime_version_satisfies_spark_hvds_requirements(leg_file):
    runtime = lock.read_lock(leg_file)
    config = _setup_cfg()
    wanted = _requirements(config["options"]["install_requires"])
    for extra in leg.extras_for(leg_file).split(","):
        wanted += _requirements(config["options.extras_require"][extra])
    outside = [f"{req} (the runtime has {runtime[name]})" for req in wanted
               if (name := lock.normalise(req.name)) in runtime
               and not req.specifier.contains(runtime[name], prereleases=True)]
    assert not outside, f"installing spark_hvd into {leg_file.name} would replace: " + ", ".join(outside)
    assert {"pyspark", "numpy", "pandas", "pyarrow", "torch", "tensorflow", "keras"} <= runtime.keys()


def test_changed_names_moved_and_removed_packages_not_added_ones():
    before = {"numpy": "1.23.5", "pyarrow": "14.0.1", "keras": "3.3.3"}
    after = {"numpy": "2.4.6", "pyarrow": "14.0.1", "tqdm": "4.67.1"}
    assert leg.changed(before, after) == ["  keras: 3.3.3 -> removed", "  numpy: 1.23.5 -> 2.4.6"]
    assert leg.changed(before, {**before, "tqdm": "4.67.1"}) == []


def test_a_leg_file_names_the_extras_its_user_installs(tmp_path):
    assert "mxnet" in leg.extras_for(ROOT / "runtimes" / "dbr-15.4-ml.txt").split(",")
    plain = tmp_path / "plain.txt"
    plain.write_text("# no extras line\nnumpy==1.23.5\n")
    assert leg.extras_for(plain) == leg.EXTRAS


def test_each_leg_has_its_own_virtualenv():
    assert leg.venv_for(ROOT / "runtimes" / "dbr-15.4-ml.txt") == ROOT / ".venv-dbr-15.4-ml"
    assert len({leg.venv_for(p) for p in LEGS}) == len(LEGS) >= 2
