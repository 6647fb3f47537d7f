"""An elastic training script (docs/elastic.md's loop) for ``run_elastic("elastic_train.py", ...)``: rank 1 dies
once (os._exit) in epoch 1; the relaunch runs the script again from the top and ``hvd.elastic.run`` restores the
last commit. Each rank writes where it started, the final weights and torchrun's variables to --dir/rank<r>.json."""

import argparse
import json
import os

import torch

import spark_hvd.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
args = parser.parse_args()

hvd.init()
gen = torch.Generator().manual_seed(3)
x = torch.randn(24, 4, generator=gen, dtype=torch.float64)
dataset = torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]], dtype=torch.float64))
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)
marker = os.path.join(args.dir, "killed")
starts = []


@hvd.elastic.run
def train(state):
    starts.append([state.epoch, len(sampler.processed_indices)])
    while state.epoch < 2:
        for batch_idx, (xb, yb) in enumerate(torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)):
            optimizer.zero_grad()
            ((model(xb) - yb) ** 2).mean().backward()
            optimizer.step()
            sampler.record_batch(batch_idx, 2)
            if hvd.rank() == 1 and state.epoch == 1 and batch_idx == 3 and not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(4)
            state.commit()
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()


train(state)
with open(os.path.join(args.dir, f"rank{hvd.rank()}.json"), "w") as f:
    json.dump({"starts": starts, "weights": [float(v) for v in torch.cat([p.detach().flatten()
                                                                          for p in model.parameters()])],
               "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
               "world": os.environ.get("WORLD_SIZE")}, f)
