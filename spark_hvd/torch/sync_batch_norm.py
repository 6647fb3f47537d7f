"""``SyncBatchNorm``: batch normalisation with the statistics of the whole job's batch (Horovod's and torch's).

In training mode every rank sums its count, sum and sum of squares per channel, one differentiable allreduce
(``Sum``) adds them over ranks, and the normalisation uses the job's mean and variance. Autograd goes through that
allreduce, whose backward is again a ``Sum`` allreduce, so the input gradient is that of the sum of every rank's
loss, as torch's ``SyncBatchNorm`` computes it. Running statistics are updated with the job's unbiased variance. In
eval mode (or at size 1) it is a plain ``BatchNorm``.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from spark_hvd import _binding_common as common
from spark_hvd.torch.collectives import allreduce


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` whose batch statistics span every rank.

    Args are those of ``torch.nn.BatchNorm*d``. Inputs are ``(N, C, ...)`` with at least 2 dimensions.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002 - torch's name
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {input.dim()} dimensions")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        self._check_input_dim(input)
        use_batch = self.training or not self.track_running_stats
        if not use_batch or not common.is_initialized() or common.size() == 1:
            return super().forward(input)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        momentum = self.momentum
        if momentum is None:  # cumulative moving average, as torch does
            momentum = 1.0 / float(self.num_batches_tracked) if self.num_batches_tracked is not None else 0.0

        channels = input.shape[1]
        flat = input.transpose(0, 1).reshape(channels, -1)
        wide = flat.double() if flat.dtype in (torch.float16, torch.bfloat16, torch.float32) else flat
        count = torch.full((1,), float(flat.shape[1]), dtype=wide.dtype)
        stats = torch.cat([count, wide.sum(1), (wide * wide).sum(1)])
        total = allreduce(stats, op=common.Sum, name=None)
        n = total[0]
        if int(n.item()) <= 1:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel over the job, got {int(n.item())}")
        mean = total[1:1 + channels] / n
        var = (total[1 + channels:] / n - mean * mean).clamp_min(0)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
                unbiased = var * n / (n - 1)
                self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.to(input.dtype).view(shape)) * torch.rsqrt(var + self.eps).to(input.dtype).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

