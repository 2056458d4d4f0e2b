"""AdamW and the learning-rate schedule."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device, dp_mode: str = "none") -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm weights and biases are not decayed).

    dp_mode "zero1": ZeroRedundancyOptimizer shards the AdamW state over the data-parallel ranks
    (each rank steps its share of the parameters, then broadcasts them); the update is the same.
    training.cuda_graphs on CUDA: capturable AdamW with the lr as a device tensor (the scheduler
    writes it in place) and the step counters on device, so a captured step can be replayed.
    """
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type == "cuda" if o.fused == "auto" else o.fused == "true"
    kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)
    if cfg.training.cuda_graphs and device.type == "cuda":
        kw.update(lr=torch.tensor(o.lr, device=device), capturable=True)
    if dp_mode == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kw)
    return torch.optim.AdamW(groups, **kw)


def lr_factor(step: int, total: int, warmup: int, decay_type: str, min_factor: float, decay_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up, then decay."""
    last = total - 1  # the final optimizer step reaches min_factor exactly
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if decay_type == "wsd":
        decay_start = max(warmup, int(total * (1.0 - decay_ratio)))
        if step < decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, last - decay_start)
        return 1.0 - (1.0 - min_factor) * min(1.0, progress)
    progress = min(1.0, (step - warmup) / max(1, last - warmup))
    if decay_type == "linear":
        return 1.0 - (1.0 - min_factor) * progress
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    s, total = cfg.lr_scheduler, cfg.training.steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, s.warmup_steps, s.decay_type, s.min_lr_factor, s.decay_ratio))
