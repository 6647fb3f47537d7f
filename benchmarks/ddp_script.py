"""The DDP script both launchers run in ``torchrun_launch.py``: an unmodified torchrun-style script (gloo, CPU).

``--t0`` is the driver's ``time.time()`` when it called the launcher; rank 0 writes to ``--out`` the seconds from
it to the end of the first optimizer step, and the steady steps/s over the steps after ``--warmup``.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--t0", type=float, required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=80)
parser.add_argument("--warmup", type=int, default=10)
parser.add_argument("--width", type=int, default=512)
args = parser.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
w = args.width
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(64, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 64), torch.randn(64, 1)
first = steady_start = None
for step in range(args.steps):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:
        first = time.time() - args.t0
    if step == args.warmup - 1:
        steady_start = time.perf_counter()
steps_per_s = (args.steps - args.warmup) / (time.perf_counter() - steady_start)
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({"first_step_s": first, "steps_per_s": steps_per_s}, f)
dist.destroy_process_group()
