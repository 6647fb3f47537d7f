"""Fails on one rank: --raise-on R raises ValueError there; --exit-on R --code C calls sys.exit(C) there."""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--raise-on", type=int, default=-1)
parser.add_argument("--exit-on", type=int, default=-1)
parser.add_argument("--code", type=int, default=0)
args = parser.parse_args()
rank = int(os.environ["RANK"])


def train_step() -> None:
    raise ValueError(f"the loss is nan on rank {rank}")


if rank == args.raise_on:
    train_step()
if rank == args.exit_on:
    sys.exit(args.code)
