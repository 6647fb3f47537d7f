"""The services of one ``spark-hvd-run`` job, the same for its local ranks (``launch.run_local``) and its ranks on
hosts (``multihost.run_hosts``): a fresh secret and job id, the key-value rendezvous store the ranks meet in
(``KVStoreServer``), the driver service they report to (``DriverService``), the launch's result with the output
sink that fills it; and the launch's end: every rank's return code kept, the service given a moment for the ranks'
last reports (longer after a success), both services stopped."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spark_hvd.core.transport.wire import make_secret
from spark_hvd.runner.client import Event
from spark_hvd.runner.procs import PIPE_DRAIN_S, LaunchResult, RankOutput, RankProcess
from spark_hvd.runner.service import DriverService

__all__ = ["JobServices"]


@dataclass
class JobServices:
    """A started job's secret, id, services (``kv``: the rendezvous store at ``kv_host:kv_port``; ``service``: the
    driver service at ``service_port``), and its ``result`` filled by ``output``."""

    secret: bytes
    job_id: str
    result: LaunchResult
    output: RankOutput
    kv: Any
    kv_host: str
    kv_port: int
    service: DriverService
    service_port: int

    @classmethod
    def start(cls, np: int, *, kv_host: str, bind_host: str, encrypt: bool, capture: bool, verbose: int,
              on_event: Callable[[Event], None] | None) -> JobServices:
        """Both services of a job of ``np`` ranks started: the store on ``kv_host``, the driver service on
        ``bind_host`` ("": every interface), encrypted or not; ``capture``, ``verbose``, ``on_event`` as
        ``run_local``'s."""
        from spark_hvd.core.transport.rendezvous import KVStoreServer  # not at import: the launcher's start

        secret, job_id = make_secret(), secrets.token_hex(4)
        result = LaunchResult(returncode=0)
        output = RankOutput(result, capture, on_event)
        kv = KVStoreServer(secret, host=kv_host, encrypt=encrypt)
        kv_host, kv_port = kv.start()
        try:
            service = DriverService(secret, np, job_id=job_id, verbose=0 if capture else verbose,
                                    on_event=output.event, bind_host=bind_host, encrypt=encrypt)
            _, service_port = service.start()
        except BaseException:
            kv.stop()
            raise
        return cls(secret, job_id, result, output, kv, kv_host, kv_port, service, service_port)

    def finish(self, ranks: Sequence[RankProcess]) -> None:
        """The launch's end, once every rank is stopped: their return codes kept in ``result``, the driver service
        given a moment for the ranks' last reports, both services stopped."""
        self.result.returncodes = [r.proc.returncode for r in ranks]
        self.service.wait_finished(5.0 if self.result.returncode == 0 else PIPE_DRAIN_S, only_started=True)
        self.service.stop()
        self.kv.stop()
