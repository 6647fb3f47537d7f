"""What an elastic ``state.commit()`` costs on rank 0, by model size (no Spark needed).

Three ways to commit the same ``TorchState`` (a linear model of the given size and its SGD-momentum optimizer):

- ``local``: the in-memory snapshot only (deep copies of the state dicts), what every rank does;
- ``driver``: the snapshot plus rank 0's upload to a driver service on this host (streamed in authenticated
  8 MiB chunks, the tensors' memory sent as it is, kept on the driver's disk), what ``run_elastic`` does;
  ``fetch`` is what a relaunched rank 0 pays to get it back (``download_state``);
- ``file``: the snapshot plus ``torch.save`` of the same state to a local file with fsync (the peer: a checkpoint
  written to a store instead).

Usage::

    python benchmarks/elastic_commit.py --mib 1,16,64 --repeats 7
    python benchmarks/elastic_commit.py --mib 1024 --repeats 2      # the 1 GB state (~4 GiB of memory)

Prints one JSON line per size with the median seconds of each way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import median_time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="1,16", help="model sizes in MiB of float32 parameters, comma separated")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch

    import spark_hvd.core as core
    from spark_hvd.core import elastic
    from spark_hvd.core.transport.wire import make_secret
    from spark_hvd.runner.client import ServiceClient
    from spark_hvd.runner.elastic import ElasticDriver, _ServiceLink
    from spark_hvd.runner.service import DriverService
    from spark_hvd.torch.elastic import TorchState

    class _NoSpark:
        __module__ = "pyspark.sql.connect.session"  # the driver's growth check stays off

    core.init()
    secret = make_secret()
    driver = ElasticDriver(_NoSpark(), max_num_proc=1)
    service = DriverService(secret, 1, job_id="bench", verbose=0, bind_host="127.0.0.1", handlers=driver.handlers())
    _, port = service.start()
    client = ServiceClient(f"127.0.0.1:{port}", secret, "bench", 0)
    try:
        for mib in (float(m) for m in args.mib.split(",")):
            # parameters + momentum buffers are pickled: half the budget each
            width = max(1, int(mib * (1 << 20) / 4 / 2 / 1024))
            model = torch.nn.Linear(1024, width, bias=False)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model(torch.ones(1, 1024)).sum().backward()
            optimizer.step()
            state = TorchState(model, optimizer, epoch=0)
            row = {"mib": mib, "params": model.weight.numel()}
            elastic.set_link(None)
            row["local_s"] = median_time(state.commit, args.repeats)
            elastic.set_link(_ServiceLink(client))
            row["driver_s"] = median_time(state.commit, args.repeats)
            row["state_bytes"] = sum(driver._fetch(0, None) or [])
            row["fetch_s"] = median_time(lambda: elastic.download_state(_ServiceLink(client)), args.repeats)
            elastic.set_link(None)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "state.pt")

                def to_file(path: str = path, state: TorchState = state) -> None:
                    state.commit()
                    with open(path, "wb") as f:
                        torch.save(state.snapshot(), f)
                        f.flush()
                        os.fsync(f.fileno())

                row["file_s"] = median_time(to_file, args.repeats)
            print(json.dumps(row), flush=True)
    finally:
        elastic.set_link(None)
        client.close()
        service.stop()
        driver.close()
        core.shutdown()


if __name__ == "__main__":
    main()
