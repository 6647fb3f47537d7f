"""A torchrun-style training script, unmodified for spark_hvd: DDP (or FSDP2's ``fully_shard`` with --fsdp) on
gloo, the combined batch of every step split by rank, the final weights saved by rank 0 (--out)."""

import argparse

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--fsdp", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    wrapped = fully_shard(model)
else:
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(wrapped.parameters(), lr=args.lr, momentum=0.9)
data = torch.Generator().manual_seed(1)
for _ in range(args.steps):
    x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)  # the combined batch
    loss = torch.nn.functional.mse_loss(wrapped(x[rank::world]), y[rank::world])
    opt.zero_grad()
    loss.backward()
    opt.step()
state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
         for k, v in model.state_dict().items()}
if rank == 0:
    torch.save(state, args.out)
dist.destroy_process_group()
