"""horovodrun's flags on spark-hvd-run: the ones it takes under Horovod's spelling, and for the others one line
naming what to write instead (not argparse's bare "unrecognized arguments"); nothing starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from spark_hvd.runner.horovod_flags import HOROVOD_FLAGS, horovod_flag_hint
from spark_hvd.runner.launch import build_parser, main

DOCS = Path(__file__).resolve().parents[2] / "docs"

CASES = [
    (["--gloo"], "--gloo is a horovodrun flag that spark-hvd-run does not take; instead: nothing to set: "
                 "spark_hvd's own TCP ring plays gloo's part and is the default"),
    (["--mpi"], "--mpi is a horovodrun flag that spark-hvd-run does not take; instead: to run on MPI, start the "
                "script with mpirun itself"),
    (["--fusion-threshold-mb", "32"], "instead: --env SPARK_HVD_FUSION_THRESHOLD=33554432 (bytes, not MB); "
                                      "HOROVOD_FUSION_THRESHOLD is read too (docs/settings.md)"),
    (["--cycle-time-ms=2.5"], "--cycle-time-ms is a horovodrun flag that spark-hvd-run does not take; instead: "
                              "--env SPARK_HVD_CYCLE_TIME=2.5 (milliseconds)"),
    (["--timeline-filename", "/tmp/tl.json"], "instead: --env SPARK_HVD_TIMELINE=/tmp/tl.json (a path)"),
    (["--no-stall-check"], "instead: --env SPARK_HVD_STALL_CHECK_TIME=0"),
    (["--autotune"], "instead: --env SPARK_HVD_AUTOTUNE=1; HOROVOD_AUTOTUNE is read too"),
    (["--autotune-log-file", "/tmp/at.csv"], "instead: --env SPARK_HVD_AUTOTUNE_LOG=/tmp/at.csv (a path)"),
    (["--min-np", "1"], "instead: elastic training runs on Spark: spark_hvd.runner.run_elastic("),
    (["-cb"], "-cb is a horovodrun flag"),
    (["-prefix-timestamp"], "-prefix-timestamp is a horovodrun flag"),
]


@pytest.mark.parametrize("flag,expected", CASES, ids=[c[0][0] for c in CASES])
def test_horovodrun_flag_names_the_equivalent(capsys, flag, expected):
    with pytest.raises(SystemExit) as info:
        main(["-np", "2", *flag, "python", "train.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"spark-hvd-run: error: {flag[0].partition('=')[0]} is a horovodrun flag" in err
    assert expected in err
    assert "unrecognized arguments" not in err


def test_every_pointer_renders_and_names_real_settings():
    """Each flag's message renders with and without a value, and every SPARK_HVD_ variable it names is one the
    settings page documents."""
    documented = set(re.findall(r"`(SPARK_HVD_[A-Z_]+)`", (DOCS / "settings.md").read_text()))
    for flag, (nargs, _) in HOROVOD_FLAGS.items():
        for values in ([None] if nargs == 0 else [None, ["4"] * nargs]):
            text = horovod_flag_hint(flag, values)
            assert text.startswith(f"{flag} is a horovodrun flag that spark-hvd-run does not take; instead: ")
            named = set(re.findall(r"SPARK_HVD_[A-Z_]+", text))
            assert named <= documented, (flag, named - documented)


def test_flags_after_the_command_are_the_commands_and_horovod_spellings_are_taken():
    parser = build_parser()
    args = parser.parse_args(["-np", "2", "python", "train.py", "--gloo", "--fusion-threshold-mb", "8"])
    assert args.command == ["python", "train.py", "--gloo", "--fusion-threshold-mb", "8"]
    args = parser.parse_args(["-hostfile", "hosts.txt", "--network-interfaces", "eth0,eth1", "python", "t.py"])
    assert args.hostfile == "hosts.txt" and args.network_interface == "eth0,eth1"
    args = parser.parse_args(["-H", "a:1", "--remote-python", "/opt/py/bin/python3", "python", "t.py"])
    assert args.remote_python == "/opt/py/bin/python3" and args.command == ["python", "t.py"]


def test_version_flag(capsys):
    import spark_hvd

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"spark_hvd {spark_hvd.__version__}"
