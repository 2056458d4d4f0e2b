"""AdamW and the learning-rate schedule."""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from titanlite.ops.master_linear import MasterWeights
from titanlite.parallel.grads import local_tensor
from titanlite.parallel.modes import MODES


def build_optimizer(model: torch.nn.Module, cfg, device: torch.device, dp_mode: str = "none",
                    masters: MasterWeights | None = None, update: Callable | None = None,
                    group=None) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm weights and biases are not decayed).

    Master weights (parameters with a bf16 copy in `masters`, or stored in bf16: see
    training.bf16_params and titanlite.parallel.apply.apply_bf16_params) or
    optimizer.moments_dtype=bfloat16: titanlite's MasterAdamW (it rewrites the copies and keeps the
    masters of bf16 parameters; moments in either dtype). `update` replaces its per-parameter update
    (see MasterAdamW); torch's AdamW has no such seam and ignores it.
    dp_mode "zero1": ZeroRedundancyOptimizer shards the AdamW state over `group`, the ranks DDP
    averages the gradients over (the mesh's dp_replicate group: ParallelDims.group); each rank steps
    its share of the parameters, then broadcasts them there. The update is the same.
    training.cuda_graphs on CUDA: capturable AdamW with the lr as a device tensor (the scheduler
    writes it in place) and the step counters on device, so a captured step can be replayed.
    """
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type == "cuda" if o.fused == "auto" else o.fused == "true"
    graphs = cfg.training.cuda_graphs and device.type == "cuda"
    lr = torch.tensor(o.lr, device=device) if graphs else o.lr
    zero = MODES[dp_mode].optimizer == "zero"
    # Sharded modes step their local shards with MasterAdamW's fused kernel too (fused: CUDA's default): one
    # launch over every shard, the clip's scale inside it (torch's fused AdamW over DTensors clips in a pass
    # of its own)
    sharded_fused = MODES[dp_mode].shards_params and fused
    masters = masters or MasterWeights()
    if o.moments_dtype == "bfloat16" or sharded_fused or any(has_master(p, masters) for p in params):  # capturable
        kw = dict(lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused,
                  moments_dtype=getattr(torch, o.moments_dtype), masters=masters, update=update)
        return zero_master_adamw(groups, process_group=group, **kw) if zero else MasterAdamW(groups, **kw)
    kw = dict(lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused)
    if graphs:
        kw.update(capturable=True)
    if zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # on first use: it imports much of torch.distributed

        return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=group, **kw)
    return torch.optim.AdamW(groups, **kw)


def has_master(p: torch.Tensor, masters: MasterWeights) -> bool:
    """Does `p` need MasterAdamW: an fp32 master with a bf16 copy to rewrite (in `masters`), or a bf16
    parameter whose fp32 master the optimizer keeps?"""
    return p.dtype == torch.bfloat16 or masters.has_copy(p)


def master_low_bits(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The int16 that, with `p` (bf16, `w` rounded to nearest even), gives back the fp32 `w` exactly.

    An fp32 number is its bf16 rounding's 16 bits followed by 16 more; as integers, the fp32 bits are
    bf16 bits x 65536 plus a signed remainder, and the remainder of a nearest rounding fits in 16
    bits, with one exception: a value exactly halfway between two bf16 numbers that rounded down (to
    the even one) leaves +32768. It is stored as 32767, moving that master by one fp32 unit in the
    last place (2^-24 of it) to where it rounds to the same bf16 number. So MasterAdamW's masters
    cost 2 bytes a parameter, not 4, and each step moves 2 fewer.
    """
    lo = w.view(torch.int32) - p.view(torch.int16).to(torch.int32) * 65536
    return lo.clamp_(max=32767).to(torch.int16)


def join_master(p: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master of the bf16 parameter `p` and its low bits `lo` (master_low_bits)."""
    return (p.view(torch.int16).to(torch.int32) * 65536 + lo).view(torch.float32)


def eager_master_adamw_update(p, g, lo, m, v, lr, wd: float, beta1: float, beta2: float, eps: float,
                         bias1, bias2_sqrt, grad_scale, keep, copy=None) -> None:
    """AdamW on one fp32 master weight, rewriting what holds it. The master is the bf16 parameter `p`
    with its low bits `lo` (join_master; both are rewritten), or, with `lo` None, the fp32 `p` itself,
    whose bf16 copy `copy` (titanlite.ops.master_linear), when given, is rewritten as its rounding.

    All tensors arrive flattened to 1-D. The moments `m`, `v` are fp32 or bf16 (optimizer.moments_dtype);
    the arithmetic is fp32 either way. This is the CPU path and the reference of the CUDA kernel
    (titanlite.ops.master_adamw), which does it in one pass. `grad_scale` divides the gradient (the
    grad-norm clip); where `keep` is true nothing changes (a skipped step, decided on the device).
    The formula is torch.optim.AdamW's.
    """
    w = p if lo is None else join_master(p, lo)
    g = g.float() / grad_scale
    m_new = m.float().lerp(g, 1 - beta1)
    v_new = v.float() * beta2 + (1 - beta2) * g * g
    w_new = torch.where(keep, w, w * (1 - lr * wd) - (lr / bias1) * m_new / (v_new.sqrt() / bias2_sqrt + eps))
    m.copy_(torch.where(keep, m.float(), m_new))  # rounds to nearest even where the moments are bf16
    v.copy_(torch.where(keep, v.float(), v_new))
    p.copy_(w_new)
    if lo is not None:
        lo.copy_(master_low_bits(w_new, p))
    if copy is not None:
        copy.copy_(w_new)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master weights (training.bf16_params), with fp32 or bf16 moments
    (optimizer.moments_dtype).

    Three kinds of parameters, each updated as torch's AdamW updates an fp32 parameter:
    - fp32 with a bf16 copy (in `masters`, the blocks' matrices: titanlite.ops.master_linear): the
      parameter is the master; the update also rewrites the copy, as its rounding.
    - bf16 (float8's matrices under training.bf16_params): the optimizer state holds the low 16 bits
      of the fp32 master (`master_lo`: the parameter holds the high ones, see master_low_bits;
      `master(p)` gives the fp32 value), started from the fp32 value `masters` holds for it.
    - fp32 without a copy (embeddings, norms, output head): its own master, plain AdamW.
    The state also holds the moments and the step. On CUDA with `fused` the update is one Triton
    pass over each parameter, launched once per group and kind (once per parameter while a CUDA
    graph is captured; titanlite.ops.master_adamw); elsewhere `eager_master_adamw_update` runs eagerly
    (the reference the kernel is tested against). `update`, when given, runs instead of both (same
    arguments as eager_master_adamw_update): estimation's fake run counts the kernel's bytes through it.
    It takes the clip inside its update (titanlite.parallel.grads.FusedClip: `scale_next_step`).
    State is created up front, so checkpoints load into it in place (DCP needs no warm-up step).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, fused: bool = False, moments_dtype: torch.dtype = torch.float32,
                 masters: MasterWeights | None = None, update: Callable | None = None):
        # torch's AdamW keeps these in its parameter groups too, here with the values that describe this
        # update: checkpoints of either optimizer then hold every key the other asks for (DCP loads key by key)
        adamw = dict(amsgrad=False, maximize=False, foreach=None, capturable=isinstance(lr, torch.Tensor),
                     differentiable=False, fused=fused, decoupled_weight_decay=True)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **adamw))
        self.fused = fused
        self.masters = masters or MasterWeights()
        self._update = update
        self._grad_scale = self._found_inf = None  # the fused clip's, for the next step (scale_next_step)
        self._launch_cache: dict = {}  # per (group, kind of parameter): the fused launch's tables
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in (torch.float32, torch.bfloat16):
                    raise ValueError(f"MasterAdamW holds fp32 and bf16 parameters, not {p.dtype}")
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "exp_avg": torch.zeros_like(p, dtype=moments_dtype),
                                 "exp_avg_sq": torch.zeros_like(p, dtype=moments_dtype)}
                master = self.masters.take_initial(p)  # the fp32 init that apply_bf16_params kept
                if p.dtype == torch.bfloat16:  # the parameter is its master's rounding; none kept: equal
                    self.state[p]["master_lo"] = (torch.zeros_like(p, dtype=torch.int16) if master is None
                                                  else master_low_bits(master, p.detach()))

    def scale_next_step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """The fused clip (titanlite.parallel.grads.FusedClip): the next step divides each gradient by
        `grad_scale` and changes nothing where `found_inf` is nonzero."""
        self._grad_scale, self._found_inf = grad_scale, found_inf

    def master(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master weight of parameter `p` (`p` itself when it is fp32)."""
        lo = self.state[p].get("master_lo")
        return p.detach() if lo is None else join_master(p.detach(), lo)

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Take the masters from the parameters (after weights were loaded into the model alone): the
        low bits of bf16 parameters go, bf16 copies are rewritten."""
        for group in self.param_groups:
            for p in group["params"]:
                if "master_lo" in self.state[p]:
                    self.state[p]["master_lo"].zero_()
            self.masters.refresh(group["params"])

    def load_state_dict(self, state_dict) -> None:
        # torch's loader casts every floating-point state tensor to its parameter's dtype, which would
        # round fp32 moments to bf16: copy the saved values into this optimizer's state instead (which
        # also converts moments saved in the other optimizer.moments_dtype).
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        own = {p: dict(self.state[p]) for g in self.param_groups for p in g["params"]}
        super().load_state_dict(state_dict)  # checks the groups, takes their hyperparameters
        params = [p for g in self.param_groups for p in g["params"]]
        with torch.no_grad():
            for i, p in zip(ids, params):
                for k, t in own[p].items():
                    t.copy_(saved[i][k])
                self.state[p] = own[p]

    def _kind(self, p: torch.Tensor) -> str:
        """"own": fp32, its own master; "copy": fp32 with a bf16 copy; "lo": bf16 with its master's low bits."""
        return "lo" if "master_lo" in self.state[p] else "copy" if self.masters.has_copy(p) else "own"

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterAdamW.step takes no closure")
        work = [(i, p) for i, group in enumerate(self.param_groups) for p in group["params"] if p.grad is not None]
        if not work:
            return None
        launches: dict[tuple[int, str], list] = {}  # (group, kind) -> its parameters: one launch each
        for i, p in work:
            # FSDP's parameters, gradients and moments are DTensors: each rank updates its local shards
            # (an uneven split can leave a rank an empty one)
            if local_tensor(p).numel():
                launches.setdefault((i, self._kind(p)), []).append(p)
        device = work[0][1].device
        scale = self._grad_scale if self._grad_scale is not None else torch.ones((), device=device)
        keep = (self._found_inf > 0) if self._found_inf is not None else torch.zeros((), dtype=torch.bool, device=device)
        (beta1, beta2), eps = self.defaults["betas"], self.defaults["eps"]  # one setting for all groups
        steps = [self.state[p]["step"] for _, p in work]
        step = torch.where(keep, steps[0], steps[0] + 1)  # every parameter steps together
        bias1, bias2_sqrt = 1 - beta1 ** step, (1 - beta2 ** step).sqrt()
        update, many = self._update or eager_master_adamw_update, None
        if self._update is None and self.fused and device.type == "cuda":
            # here, not at the top: the kernels need triton, which only CUDA builds of torch bring
            from titanlite.ops.master_adamw import master_adamw_update as update
            if not torch.cuda.is_current_stream_capturing():  # the launch's tables are copied in per change
                from titanlite.ops.master_adamw import master_adamw_update_many as many
        # The kernel reads the lr from the device: a tensor already under CUDA graphs (the scheduler
        # writes it in place), else one 0-d copy per distinct value
        lr_on_device = {}
        for (i, kind), ps in launches.items():
            group = self.param_groups[i]
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                lr_on_device[lr] = lr
            elif lr not in lr_on_device:
                lr_on_device[lr] = torch.tensor(lr, dtype=torch.float32).to(device, non_blocking=True)
            args = (lr_on_device[lr], group["weight_decay"], beta1, beta2, eps, bias1, bias2_sqrt, scale, keep)
            st = [self.state[p] for p in ps]
            los = [local_tensor(s["master_lo"]) for s in st] if kind == "lo" else None
            copies = [self.masters.copies[p] for p in ps] if kind == "copy" else None
            ws, gs = [local_tensor(p) for p in ps], [local_tensor(p.grad) for p in ps]
            ms, vs = [local_tensor(s["exp_avg"]) for s in st], [local_tensor(s["exp_avg_sq"]) for s in st]
            if many is not None and many(ws, gs, los, ms, vs, *args, copies=copies,
                                         cache=self._launch_cache.setdefault((i, kind), {})):
                continue
            for j, w in enumerate(ws):
                update(w.view(-1), gs[j].view(-1), None if los is None else los[j].view(-1),
                       ms[j].view(-1), vs[j].view(-1), *args, None if copies is None else copies[j].view(-1))
        torch._foreach_copy_(steps, [step] * len(steps))
        self._grad_scale = self._found_inf = None
        return None


def zero_master_adamw(groups, moments_dtype: torch.dtype, masters: MasterWeights, update: Callable | None = None,
                      process_group=None, **kw) -> torch.optim.Optimizer:
    """zero1 over MasterAdamW: a ZeroRedundancyOptimizer over `process_group` (build_optimizer's `group`)
    whose per-rank optimizer (of its share of the parameters) is MasterAdamW; `kw` are MasterAdamW's
    hyperparameters. (The moments' dtype, the masters and the update are bound to the class, not passed
    through ZeroRedundancyOptimizer, which would copy them into every parameter group and so into
    checkpoints, where a ddp run's would lack them.)"""
    local = functools.partial(MasterAdamW, moments_dtype=moments_dtype, masters=masters, update=update)
    return _zero_master_adamw_class()(groups, masters, optimizer_class=local, process_group=process_group, **kw)


@functools.cache
def _zero_master_adamw_class():
    from torch.distributed.optim import ZeroRedundancyOptimizer  # on first use: it imports much of torch.distributed

    class ZeroMasterAdamW(ZeroRedundancyOptimizer):
        """ZeroRedundancyOptimizer broadcasts the updated fp32 masters from their owners; each rank then
        rewrites the bf16 copies of the parameters it did not update (the update kernel wrote those of
        its own). The fused clip (`scale_next_step`) goes to the local MasterAdamW."""

        def __init__(self, params, masters: MasterWeights, **kw):
            super().__init__(params, **kw)
            self.masters = masters
            local = {p for g in self.optim.param_groups for p in g["params"]}
            self.others = [p for g in self.param_groups for p in g["params"]
                           if p not in local and masters.has_copy(p)]

        def scale_next_step(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
            self.optim.scale_next_step(grad_scale, found_inf)

        def step(self, closure=None):
            loss = super().step(closure)
            self.refresh_others()
            return loss

        def refresh_others(self) -> None:
            self.masters.refresh(self.others)

        def sync_masters(self) -> None:
            self.optim.sync_masters()
            self.refresh_others()

    return ZeroMasterAdamW


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


def schedule_warning(s, total: int, lr: float) -> str | None:
    """One line naming the schedule a run really follows when its warm-up (the lr_scheduler section
    `s`) is not shorter than its `total` steps, else None: the lr then climbs to a fraction of its peak
    and never decays."""
    if s.warmup_steps < total:
        return None
    end = lr_factor(total - 1, total, s.warmup_steps, s.decay_type, s.min_lr_factor, s.decay_ratio)
    return (f"warning: lr_scheduler.warmup_steps ({s.warmup_steps}) is not shorter than training.steps ({total}): "
            f"the lr rises linearly to {end:.0%} of its peak ({end * lr:.2e} of {lr:.2e}) at the last step and "
            f"never decays; set training.steps above {s.warmup_steps} or lower lr_scheduler.warmup_steps")


def fitting_warmup(warmup: int, total: int) -> int:
    """`warmup`, or a tenth of `total` steps where `warmup` is not shorter than `total` (so the lr
    peaks and then follows its decay)."""
    return warmup if warmup < total else total // 10


def build_lr_scheduler(optimizer: torch.optim.Optimizer, s, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The lr_scheduler section `s`'s schedule over `total` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total, s.warmup_steps, s.decay_type, s.min_lr_factor, s.decay_ratio))
