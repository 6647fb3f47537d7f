"""``spark-hvd-run --encrypt`` across simulated hosts: what a rank host's link carries, captured on the link itself
(a raw packet socket on the host's ``eth0``), holds no run of a known gradient with encryption, and holds it in
clear without; the allreduce equals numpy either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
COUNT = 1 << 20  # 4 MiB of float32 per rank: the ring, in many frames

SNIFFER = """
import os, socket, sys
out, stop = sys.argv[1], sys.argv[2]
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL: every frame of eth0
sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root): keep up with the link
sock.bind(("eth0", 0))
sock.settimeout(0.2)
open(out + ".ready", "w").close()
with open(out, "wb") as f:
    while not os.path.exists(stop):
        try:
            f.write(sock.recv(1 << 18))
        except TimeoutError:
            pass
"""

RANK = f"""
import json
import numpy as np
import spark_hvd.core as hvd
from spark_hvd.core.backend import ReduceOp
hvd.init()
def gradient(rank):
    return np.arange({COUNT}, dtype=np.float32) * np.float32(1e-3) + np.float32(0.5 + rank)
out = hvd.allreduce(gradient(hvd.rank()), op=ReduceOp.SUM)
print(json.dumps({{"rank": hvd.rank(), "equal": bool(np.array_equal(out, gradient(0) + gradient(1))),
                  "encrypt": hvd.job_env().encrypt}}))
hvd.shutdown()
"""


def _gradient(rank: int) -> np.ndarray:
    return np.arange(COUNT, dtype=np.float32) * np.float32(1e-3) + np.float32(0.5 + rank)


def _run_captured(sim, tmp_path: Path, encrypt: bool) -> tuple[list[dict], bytes]:
    """One two-rank job (a rank on each of hosts 1 and 2), host 2's link recorded meanwhile."""
    tag = "encrypted" if encrypt else "authenticated"
    sniffer, rank_script = tmp_path / "sniffer.py", tmp_path / "rank.py"
    sniffer.write_text(SNIFFER)
    rank_script.write_text(textwrap.dedent(RANK))
    capture, stop = tmp_path / f"{tag}.pcap", tmp_path / f"{tag}.stop"
    h1, h2 = sim.hosts[1], sim.hosts[2]
    sniffing = h2.popen([sys.executable, str(sniffer), str(capture), str(stop)])
    try:
        deadline = time.monotonic() + 30
        while not Path(str(capture) + ".ready").exists():
            assert sniffing.poll() is None and time.monotonic() < deadline, "the packet capture did not start"
            time.sleep(0.05)
        argv = [sys.executable, "-m", "spark_hvd.runner", "-H", f"{h1.address}:1,{h2.address}:1", "--ssh-command",
                sim.ssh_command(), "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS=1", "--grace", "3",
                *(["--encrypt"] if encrypt else []), sys.executable, str(rank_script)]
        env = {**os.environ, "PYTHONPATH": str(REPO), "SPARK_HVD_TIMEOUT": "30"}
        env.pop("SPARK_HVD_IFACE_ADDR", None)
        env.pop("SPARK_HVD_ENCRYPT", None)
        proc = sim.hosts[0].popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    finally:
        stop.touch()
        sniffing.wait(30)
    rows = [json.loads(line.partition(" ")[2]) for line in out.splitlines() if line.partition(" ")[2].startswith("{")]
    return sorted(rows, key=lambda row: row["rank"]), capture.read_bytes()


def test_an_encrypted_link_carries_no_gradient_in_clear(sim, tmp_path):
    patterns = [g.tobytes()[at:at + 32] for g in (_gradient(1), _gradient(0) + _gradient(1))
                for at in range(0, COUNT * 4, 64 * 1024)]
    for encrypt in (False, True):
        rows, wire = _run_captured(sim, tmp_path, encrypt)
        assert [(row["rank"], row["equal"], row["encrypt"]) for row in rows] == [(0, True, encrypt),
                                                                               (1, True, encrypt)]
        assert len(wire) > COUNT * 4, "the capture missed the allreduce's traffic"  # 2 x 4 MiB went by
        found = sum(p in wire for p in patterns)
        if encrypt:
            assert found == 0
        else:  # host 2's rank sends half its gradient and half the sum in clear (some runs straddle packets)
            assert found >= len(patterns) // 4, (found, len(patterns))
