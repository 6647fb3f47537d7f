"""spark_hvd.pickling: a traceback raised where code shipped by value runs shows the user's file, line and source.

The "rank" is a fresh interpreter that unpickles the payload from stdin; the user's module file is deleted before,
as on a cluster where the driver's notebook or script does not exist on the executors. Both ways of pickling are
pinned: by value (the file's lines travel in the payload) and by reference (the module is imported on the rank)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle
import pytest

from spark_hvd import pickling

USER_CODE = textwrap.dedent('''
    def scale(values, factor):
        if factor < 0:
            raise ValueError("negative factor from the user's own line")
        return [v * factor for v in values]


    class Model:
        def __init__(self, factor):
            self.factor = factor

        def forward(self, values):
            inner = lambda v: scale(v, self.factor)  # noqa: E731
            return inner(values)
''')

RANK = textwrap.dedent('''
    import sys, traceback
    from spark_hvd import pickling
    fn, args = pickling.loads(sys.stdin.buffer.read())
    try:
        print(fn(*args))
    except Exception:
        traceback.print_exc(file=sys.stdout)
''')


def _user_module(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.py"
    path.write_text(USER_CODE)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, path


def _on_a_rank(payload: bytes, pythonpath: str = "") -> str:
    env = {"PYTHONPATH": pythonpath} if pythonpath else {}
    out = subprocess.run([sys.executable, "-c", RANK], input=payload, capture_output=True, timeout=120,
                         env={**_base_env(), **env})
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode()


def _base_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHONPATH": str(Path(pickling.__file__).resolve().parents[1])}


@pytest.fixture
def by_value(tmp_path):
    module, path = _user_module(tmp_path, "user_code_by_value")
    cloudpickle.register_pickle_by_value(module)
    yield module, path
    cloudpickle.unregister_pickle_by_value(module)
    del sys.modules[module.__name__]


def test_by_value_traceback_names_the_file_and_shows_the_line_after_the_file_is_gone(by_value):
    module, path = by_value
    payload = pickling.dumps((module.Model(-2.0).forward, ([1.0, 2.0],)))
    path.unlink()  # the rank's host has no copy of the user's file
    tb = _on_a_rank(payload)
    assert f'File "{path}", line 4, in scale' in tb
    assert "raise ValueError(\"negative factor from the user's own line\")" in tb
    assert f'File "{path}", line 14, in forward' in tb and "return inner(values)" in tb
    assert "<lambda>" in tb and "inner = lambda v: scale(v, self.factor)" in tb
    assert "<dynamic-code>" not in tb


def test_by_value_code_still_runs_and_source_travels_once_per_file(by_value):
    module, _ = by_value
    assert _on_a_rank(pickling.dumps((module.Model(3.0).forward, ([1.0, 2.0],)))).strip() == "[3.0, 6.0]"
    payload = pickling.dumps([module.scale, module.Model.forward, module.Model.__init__])
    assert payload.count(b"negative factor from the user's own line") == 2  # the source once, the code's const once


def test_by_reference_reads_the_module_on_the_rank(tmp_path):
    module, path = _user_module(tmp_path, "user_code_by_reference")
    try:
        payload = pickling.dumps((module.scale, ([1.0], -1.0)))
        assert b"def scale" not in payload  # pickled as an import path, not by value
        tb = _on_a_rank(payload, pythonpath=f"{tmp_path}:{_base_env()['PYTHONPATH']}")
    finally:
        del sys.modules[module.__name__]
    assert f'File "{path}", line 4, in scale' in tb
    assert "raise ValueError(\"negative factor from the user's own line\")" in tb


def test_plain_cloudpickle_payloads_still_load():
    assert pickling.loads(cloudpickle.dumps({"a": [1, 2]})) == {"a": [1, 2]}
