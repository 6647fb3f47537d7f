"""Every notebook in notebooks/ runs from top to bottom (nbclient, this venv's Python as the kernel).

A notebook that raises in any cell fails here with that cell's traceback. The notebooks run offline: an embedded
``local[2]`` Spark (started in the kernel), sklearn's bundled digits, ``spark-hvd-run`` for the Horovod one.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = ["horovod_api.ipynb", "torch_estimator.ipynb", "keras_estimator.ipynb", "image_classifier.ipynb"]
#: seconds one cell may run before the notebook fails (fits take seconds to a minute on 2 cores)
CELL_TIMEOUT_S = 600


def _kernel_name() -> str:
    """``python3``, the kernel of this interpreter (jupyter_client runs a ``python`` kernelspec with sys.executable);
    installed into this environment first if it has none."""
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix"], check=True,
                       capture_output=True, timeout=120)
    return "python3"


def _build_module():
    spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOKS / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_notebooks_match_their_builder():
    """The committed notebooks hold the cells of notebooks/build_notebooks.py (edit there, then rebuild)."""
    builder = _build_module()
    assert sorted(builder.NOTEBOOKS) == sorted(NAMES)
    for name, build in builder.NOTEBOOKS.items():
        committed = nbformat.read(NOTEBOOKS / name, as_version=4)
        want = [(c.cell_type, c.source) for c in build().cells]
        got = [(c.cell_type, c.source) for c in committed.cells]
        assert got == want, f"notebooks/{name} differs from build_notebooks.py: run it to rebuild"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str):
    if name == "keras_estimator.ipynb" and importlib.util.find_spec("spark_hvd.estimators.keras") is None:
        pytest.skip("spark_hvd.estimators.keras (KerasEstimator) is not there yet")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=_kernel_name(),
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError naming the cell and carrying its traceback
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
