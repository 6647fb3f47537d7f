"""spark-hvd-run's host list: -H and --hostfile parsing, placement in host order, the remote command line."""

from __future__ import annotations

import pytest

from spark_hvd.runner.hosts import Placement, is_local_host, parse_hostfile, parse_hosts, place
from spark_hvd.runner.multihost import ssh_argv
from spark_hvd.runner.remote import remote_command, request


def test_parse_hosts():
    assert parse_hosts("host1:2,host2:2") == [("host1", 2), ("host2", 2)]
    assert parse_hosts("a, b:3") == [("a", 1), ("b", 3)]
    for bad, why in (("a:0", "host:slots"), ("a:x", "host:slots"), (",", "names no host"), ("a:1,a:2", "twice")):
        with pytest.raises(ValueError, match=why):
            parse_hosts(bad)


def test_parse_hostfile():
    text = "# cluster\nhost1 slots=2\n\nhost2   slots=4 max_slots=8  # comment\nhost3:3\nhost4\n"
    assert parse_hostfile(text) == [("host1", 2), ("host2", 4), ("host3", 3), ("host4", 1)]
    with pytest.raises(ValueError, match=r"hf:1: 'host1 cpus=2': expected 'host slots=N'"):
        parse_hostfile("host1 cpus=2", "hf")
    with pytest.raises(ValueError, match="names no host"):
        parse_hostfile("# nothing\n", "hf")


def test_place_in_host_order():
    placed = place([("a", 2), ("b", 2)])
    assert placed == [Placement(0, "a", 0, 2, 0, 2), Placement(1, "a", 1, 2, 0, 2),
                      Placement(2, "b", 0, 2, 1, 2), Placement(3, "b", 1, 2, 1, 2)]
    assert place([("a", 2), ("b", 2)], 3)[-1] == Placement(2, "b", 0, 1, 1, 2)
    assert [p.host for p in place([("a", 4), ("b", 4)], 2)] == ["a", "a"]
    with pytest.raises(ValueError, match=r"-np 5 is more than the 4 slot\(s\) of the hosts \(a:2, b:2\)"):
        place([("a", 2), ("b", 2)], 5)


def test_local_hosts():
    assert is_local_host("localhost") and is_local_host("127.0.0.1")
    assert not is_local_host("198.18.0.250")


def test_ssh_command_line_carries_no_secret():
    shell = remote_command("/usr/bin/python3", "/work/dir with space")
    argv = ssh_argv(["ssh"], "host1", shell, port=2222, identity_file="/k/id")
    assert argv[:1] == ["ssh"] and "BatchMode=yes" in argv and argv[-2:] == ["host1", shell]
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k/id"
    assert ssh_argv(["my-rsh", "-q"], "h", "cmd") == ["my-rsh", "-q", "h", "cmd"]  # no ssh-only options
    secret_hex = "ab" * 32
    line = request(["python", "train.py"], {"SPARK_HVD_SECRET": secret_hex}, "/w", 3.0)
    assert secret_hex in line.decode() and secret_hex not in " ".join(argv)
    assert "'/work/dir with space'" in shell
