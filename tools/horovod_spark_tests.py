"""Run Horovod's own Spark integration tests against spark_hvd, through the import alias ``tools/horovod_alias``
(``horovod.spark`` -> ``spark_hvd``), and count the outcomes by file and cause (docs/migrating-from-horovod.md).

    python tools/horovod_spark_tests.py --horovod /path/to/horovod            # a checkout, or its git directory
    python tools/horovod_spark_tests.py --horovod DIR --rev 2626dc87 -- -k test_happy_run   # after --: pytest's
    python tools/horovod_spark_tests.py --classify build/horovod-spark-tests/junit.xml      # count a past run again

The four test files (``test/integration/test_spark{,_torch,_keras,_lightning}.py``) and their helpers
(``test/utils/spark_common.py``, ``common.py``) are copied unchanged into ``--workdir`` (default
``build/horovod-spark-tests``, with a ``pytest.ini`` of its own so this repository's pytest settings do not apply)
and run in one pytest process with the alias on ``PYTHONPATH`` (its ``sitecustomize`` installs it in Spark's Python
workers and the ranks too). Each test is then put in one column:

- pass; skip (Horovod's own skips: GPU, MPI, ...);
- Horovod internals: it uses a Horovod name spark_hvd has no counterpart of (the alias's ``HorovodInternal``, or a
  private method of a Horovod class), or is listed in ``INTERNAL`` below with why (it mocks an internal, so it fails
  on an assertion instead);
- params: an estimator param spark_hvd refuses; Keras 2 / Lightning 1: test code those versions' APIs broke;
- run() keywords: a keyword of ``horovod.spark.run`` / ``run_elastic`` that spark_hvd does not take;
- other: anything else (listed with its message: each is a spark_hvd gap or a documented difference).

The per-test table is written to ``<workdir>/classified.tsv``; the counts print as the docs' Markdown table.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALIAS = REPO / "tools" / "horovod_alias"
FILES = ("test_spark.py", "test_spark_torch.py", "test_spark_keras.py", "test_spark_lightning.py")
HELPERS = ("spark_common.py", "common.py")
COLUMNS = ("pass", "skip", "internals", "params", "keras2/lightning1", "run() keywords", "other")

_MOCKS_LAUNCH = "mocks Horovod's launch internals (gloo_run._exec_command_fn / mpi_run) and asserts on their calls"
#: tests that exercise Horovod's internals without calling a stub (they mock one, or assert on private state)
INTERNAL = {
    "test_spark_run_with_gloo": _MOCKS_LAUNCH,
    "test_spark_run_with_mpi": _MOCKS_LAUNCH,
    "test_spark_run_with_path_with_mpi": _MOCKS_LAUNCH,
    "test_spark_run_num_proc_precedes_spark_cores_with_gloo": _MOCKS_LAUNCH,
    "test_spark_run_num_proc_precedes_spark_cores_with_mpi": _MOCKS_LAUNCH,
    "test_spark_run_defaults_num_proc_to_spark_cores_with_gloo": _MOCKS_LAUNCH,
    "test_spark_run_defaults_num_proc_to_spark_cores_with_mpi": _MOCKS_LAUNCH,
    "test_spark_run_does_not_default_env_to_os_env_with_gloo": _MOCKS_LAUNCH,
    "test_spark_run_does_not_default_env_to_os_env_with_mpi": _MOCKS_LAUNCH,
    "test_spark_run_with_non_zero_exit_with_gloo": _MOCKS_LAUNCH,
    "test_spark_run_with_non_zero_exit_with_mpi": _MOCKS_LAUNCH,
    "test_mpirun_not_found": "expects Horovod's mpirun failure (there is no mpirun on Spark here)",
    "test_get_available_devices": "calls horovod.spark.task.get_available_devices through Horovod's task service",
    "test_sync_hdfs_store": "mocks HDFSStore._get_filesystem_fn and Horovod's per-run local sync (sync_fn)",
    "test_hdfs_store_parse_url": "asserts on HDFSStore._hdfs_kwargs (private); its public paths pass before that",
    "test_dbfs_local_store": "mocks _DBFS_PREFIX_MAPPING, then Keras 2 HDF5 files (read_serialized_keras_model)",
}
_PARAMS = re.compile(r"has no param|refused")
_OLD_API = re.compile(r"Argument\(s\) not recognized: \{'lr'|validation_epoch_end|stochastic_weight_avg")
_RUN_KEYWORD = re.compile(r"(run|run_elastic)\(\) got an unexpected keyword argument")


def copy_tests(source: Path, rev: str, workdir: Path) -> None:
    """Copy Horovod's four test files and their helpers from a checkout or a git directory into ``workdir``."""
    wanted = [f"test/integration/{f}" for f in FILES] + [f"test/utils/{f}" for f in HELPERS]
    checkout = (source / "test" / "integration").is_dir()
    for rel in wanted:
        dest = workdir / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if checkout:
            shutil.copyfile(source / rel, dest)
        else:
            dest.write_bytes(subprocess.run(["git", f"--git-dir={source}", "show", f"{rev}:{rel}"], check=True,
                                            capture_output=True).stdout)
    (workdir / "pytest.ini").write_text("[pytest]\n")


def run_tests(workdir: Path, pytest_args: list[str], time_limit_s: float | None = None) -> int:
    """Run the copied files in one pytest process with the alias; its exit code (the junit XML is written). Past
    ``time_limit_s`` pytest is interrupted (SIGINT), so that it still writes the junit XML of the tests it ran."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ALIAS), str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "--timeout=300",
           f"--junitxml={workdir / 'junit.xml'}", *FILES, *pytest_args]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=workdir / "test" / "integration", env=env)
    try:
        return proc.wait(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        print(f"time limit of {time_limit_s} s reached: interrupting pytest (the tests run so far are counted)",
              flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def classify(junit: Path) -> list[tuple[str, str, str, str]]:
    """(file, test, column, message) for every test case of the junit XML."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        module = next((p for p in parts if p + ".py" in FILES), parts[0])
        name = case.get("name") or ""
        column, message = "pass", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is None:
                continue
            text = (el.get("message") or el.text or "").strip()
            message = text.splitlines()[0][:300] if text else ""
            full = (el.text or "") + text
            if tag == "skipped":
                column = "skip"
            elif "HorovodInternal" in full or "Horovod internal" in full or "'_Stub'" in full or \
                    re.search(r"object has no attribute '_", full):  # a private method of Horovod's classes
                column = "internals"
            elif name in INTERNAL:
                column, message = "internals", f"{INTERNAL[name]} ({message[:120]})"
            elif _RUN_KEYWORD.search(full):
                column = "run() keywords"
            elif _OLD_API.search(full):
                column = "keras2/lightning1"
            elif _PARAMS.search(message):
                column = "params"
            else:
                column = "other"
            break
        rows.append((module, name, column, message))
    return rows


def table(rows: list[tuple[str, str, str, str]]) -> str:
    """The counts by file and column, as a Markdown table."""
    counts = collections.Counter((r[0], r[2]) for r in rows)
    lines = ["| file | tests | " + " | ".join(COLUMNS) + " |", "| --- " * (len(COLUMNS) + 2) + "|"]
    for module in sorted({r[0] for r in rows}, key=lambda m: FILES.index(m + ".py") if m + ".py" in FILES else 9):
        total = sum(counts[(module, c)] for c in COLUMNS)
        lines.append(f"| {module}.py | {total} | " + " | ".join(str(counts[(module, c)] or "-") for c in COLUMNS)
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--horovod", type=Path, help="a Horovod checkout, or its git directory (see --rev)")
    parser.add_argument("--rev", default="HEAD", help="the revision to read from a git directory (default HEAD)")
    parser.add_argument("--workdir", type=Path, default=REPO / "build" / "horovod-spark-tests")
    parser.add_argument("--classify", type=Path, metavar="JUNIT_XML", help="only count the outcomes of a past run")
    parser.add_argument("--time-limit", type=float, metavar="S", help="interrupt pytest after S seconds and count "
                        "the tests it ran")
    args = parser.parse_args(argv)
    args.workdir = args.workdir.resolve()
    if args.classify is None and args.horovod is None:
        parser.error("give --horovod (a checkout or git directory of github.com/horovod/horovod) or --classify")
    junit = args.classify
    status = 0
    if junit is None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        copy_tests(args.horovod.resolve(), args.rev, args.workdir)
        status = run_tests(args.workdir, pytest_args, args.time_limit)
        junit = args.workdir / "junit.xml"
        if not junit.exists():
            print(f"pytest wrote no {junit} (exit code {status})", file=sys.stderr)
            return status or 1
    rows = classify(junit)
    out = junit.parent / "classified.tsv"
    out.write_text("".join("\t".join(r) + "\n" for r in rows))
    for row in rows:
        if row[2] not in ("pass", "skip", "internals"):
            print(f"{row[0]}::{row[1]}\t{row[2]}\t{row[3]}")
    print(table(rows))
    print(f"per test: {out}")
    return 0 if status in (0, 1) else status


if __name__ == "__main__":
    sys.exit(main())
