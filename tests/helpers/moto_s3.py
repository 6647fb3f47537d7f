"""A moto S3 server on a free local port, for the store tests and ``benchmarks/checkpoint_steps.py --store s3``."""

from __future__ import annotations

import contextlib
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from helpers.net import free_port

#: the moto_server script installed beside this Python
MOTO = os.path.join(os.path.dirname(sys.executable), "moto_server")


def moto_argv(host: str, port: int, *, tls: bool = False, cpu: int | None = None) -> list[str]:
    """The command that starts ``moto_server`` on ``host:port`` (``tls``: HTTPS with a self-signed certificate;
    ``cpu``: pinned to that CPU with ``taskset``)."""
    argv = [MOTO, "-H", host, "-p", str(port), *(["-s"] if tls else [])]
    return ["taskset", "-c", str(cpu), *argv] if cpu is not None else argv


def wait_answering(url: str, proc: subprocess.Popen | None = None, log_path: str = "", timeout_s: float = 60) -> None:
    """Return once ``url`` answers HTTP(S) (a self-signed certificate accepted); raise naming ``log_path`` if
    ``proc`` exits first or nothing answers within ``timeout_s``."""
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode}; see {log_path}")
        try:
            urllib.request.urlopen(url, timeout=2, context=context).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer on {url} within {timeout_s:g} s") from None
            time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc`` (kill it after 15 s) and reap it."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


@contextlib.contextmanager
def moto_s3_endpoint(log_path: str, *, tls: bool = False, cpu: int | None = None) -> Iterator[str]:
    """Start ``moto_server`` (its output to ``log_path``; ``tls`` and ``cpu`` as in :func:`moto_argv`), yield
    ``http(s)://127.0.0.1:<port>`` once it answers (within 60 s), stop it on exit."""
    port = free_port()
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(moto_argv("127.0.0.1", port, tls=tls, cpu=cpu), stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            wait_answering(url, proc, log_path)
            yield url
        finally:
            stop(proc)


def s3_options(endpoint: str) -> dict:
    """The s3fs storage options that reach the moto server (its self-signed certificate accepted over HTTPS)."""
    options: dict = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    if endpoint.startswith("https:"):
        options["client_kwargs"] = {"verify": False}
    return options
