"""A moto S3 server on a free local port, for the store tests and ``benchmarks/checkpoint_steps.py --store s3``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from helpers.net import free_port

#: the moto_server script installed beside this Python
MOTO = os.path.join(os.path.dirname(sys.executable), "moto_server")


@contextlib.contextmanager
def moto_s3_endpoint(log_path: str) -> Iterator[str]:
    """Start ``moto_server`` (its output to ``log_path``), yield ``http://127.0.0.1:<port>`` once it answers (within
    60 s), stop it on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([MOTO, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"moto_server exited with {proc.returncode}; see {log_path}")
                try:
                    urllib.request.urlopen(url, timeout=2).read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"moto_server did not answer on {url} within 60 s") from None
                    time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)


def s3_options(endpoint: str) -> dict:
    """The s3fs storage options that reach the moto server."""
    return {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
