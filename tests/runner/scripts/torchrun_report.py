"""A torchrun-style script that reports what it sees (--dir DIR: one JSON file per rank): its argv, torchrun's
variables, torch.distributed's and spark_hvd's ranks side by side, an allreduce through each, the store type."""

import json
import os
import sys

import torch
import torch.distributed as dist

import spark_hvd.torch as hvd

dist.init_process_group("gloo")
mine = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(mine)
hvd.init()  # harmless: the runner joined the job already
through_hvd = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):  # torch's PrefixStores around the rendezvous store
    store = store.underlying_store
report = {
    "argv": sys.argv[1:], "name": __name__, "file": os.path.basename(__file__),
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                           "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")},
    "dist": [dist.get_rank(), dist.get_world_size()], "hvd": [hvd.rank(), hvd.size(), hvd.local_rank()],
    "dist_sum": mine.item(), "hvd_sum": through_hvd.item(),
    "store": type(store).__name__,
}
with open(os.path.join(sys.argv[sys.argv.index("--dir") + 1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(report, f)
