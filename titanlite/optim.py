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
    # torch's AdamW: without titanlite's kernel, CUDA runs torch's fused one all the same (its foreach
    # update moves each element about three times as often; over FSDP's DTensors it dispatches op by op)
    kw = dict(lr=lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused or device.type in TORCH_KERNEL_DEVICES)
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
    """eager_master_adamw_update_many on one parameter: the per-parameter form of the update, with the
    arguments of the CUDA kernel's per-parameter launch (titanlite.ops.master_adamw.master_adamw_update)
    and of MasterAdamW's `update`."""
    eager_master_adamw_update_many([p], [g], None if lo is None else [lo], [m], [v], lr, wd, beta1, beta2, eps,
                                   bias1, bias2_sqrt, grad_scale, keep, None if copy is None else [copy])


# The most elements eager_master_adamw_update_many works on at once. On a GPU its fp32 temporaries (a
# few at a time) span that many, so the optimizer phase holds a bounded amount beyond the model state
# whatever the model's size, while a chunk still holds many parameters (few launches). On the CPU,
# where a launch costs little, few enough that a chunk stays in cache from one op to the next (a
# large list streamed whole through each op ran slower there than parameter by parameter:
# benchmarks/eager_update.py measures both).
UPDATE_CHUNK = 1 << 26
CPU_UPDATE_CHUNK = 1 << 18
# Where the optimizer without titanlite's kernel runs torch's fused AdamW kernel (MasterAdamW:
# torch_fused_master_adamw_update_many; torch's AdamW: fused); elsewhere (the CPU) the foreach ops, the
# reference the tests hold the kernels to. Estimation's fake run adds the CPU, to hold what CUDA holds.
TORCH_KERNEL_DEVICES = {"cuda"}


def eager_master_adamw_update_many(ps, gs, los, ms, vs, lr, wd: float, beta1: float, beta2: float, eps: float,
                                   bias1, bias2_sqrt, grad_scale=None, keep=None, copies=None) -> None:
    """AdamW on fp32 master weights, rewriting what holds them, over lists of one kind of parameter (as
    titanlite.ops.master_adamw.master_adamw_update_many takes them). The masters are the bf16
    parameters `ps` with their low bits `los` (join_master; both are rewritten), or, with `los` None,
    the fp32 `ps` themselves, whose bf16 `copies` (titanlite.ops.master_linear), when given, are
    rewritten as their rounding.

    The moments `ms`, `vs` are fp32 or bf16 (optimizer.moments_dtype), the gradients fp32 or bf16; the
    arithmetic is fp32 either way. `grad_scale` (0-d; None: 1) divides the gradients (the grad-norm
    clip); where the 0-d bool `keep` is true nothing changes (a skipped step, decided on the device;
    None: never). `lr`, `bias1` (1 - beta1^t) and `bias2_sqrt` (its root for beta2) are 0-d tensors on
    the device. The formula is torch.optim.AdamW's:
        m <- lerp(m, g, 1 - beta1);  v <- v * beta2 + (1 - beta2) * g * g
        w <- w * (1 - lr * wd) - m / ((sqrt(v) + eps * bias2_sqrt) / (bias2_sqrt * lr / bias1))
    with the step size in the denominator, as torch's capturable AdamW has it, but applied after eps
    is added, so that an lr of 0 leaves the master as it is (rather than 0 / 0 where v is 0).

    This is the CPU path and the reference of titanlite's CUDA kernel (titanlite.ops.master_adamw),
    which does it all in one pass (CUDA without that kernel runs torch's:
    torch_fused_master_adamw_update_many). Here each step of the formula is one
    torch._foreach_* op over the whole list (a few kernels, not one per parameter), in place on the
    fp32 state; bf16 moments and the masters of bf16 parameters are worked on as fp32 temporaries and
    written back rounded (to nearest even). A list of more than UPDATE_CHUNK elements (CPU_UPDATE_CHUNK
    on the CPU) goes chunk by chunk.
    """
    if not ps:
        return
    decay = None if wd == 0 else 1 - lr * wd
    eps_root, per_step = eps * bias2_sqrt, bias2_sqrt * (lr / bias1)
    for part in _chunks(ps):
        _update_chunk(ps[part], gs[part], los and los[part], ms[part], vs[part], beta1, beta2, grad_scale, keep,
                      copies and copies[part], decay, eps_root, per_step)


def _chunks(ts: list[torch.Tensor]) -> list[slice]:
    """`ts` in consecutive runs of at most UPDATE_CHUNK elements (CPU_UPDATE_CHUNK on the CPU; a larger
    tensor alone)."""
    limit = CPU_UPDATE_CHUNK if ts[0].device.type == "cpu" else UPDATE_CHUNK
    cuts, total = [0], 0
    for i, t in enumerate(ts):
        if total and total + t.numel() > limit:
            cuts.append(i)
            total = 0
        total += t.numel()
    return [slice(a, b) for a, b in zip(cuts, cuts[1:] + [len(ts)]) if b > a]


def _update_chunk(ps, gs, los, ms, vs, beta1: float, beta2: float, grad_scale, keep, copies, decay, eps_root,
                  per_step) -> None:
    def update(ws, mw, vw):
        held = None if keep is None else _hold([ws, mw, vw], keep)
        g = _scaled_grads(gs, grad_scale)
        torch._foreach_lerp_(mw, g, 1 - beta1)
        torch._foreach_mul_(vw, beta2)
        torch._foreach_addcmul_(vw, g, g, value=1 - beta2)
        del g  # (each temporary goes as soon as it is used: the optimizer phase's peak holds one or two)
        denom = torch._foreach_sqrt(vw)
        torch._foreach_add_(denom, eps_root, alpha=1)  # alpha: the 0-d tensor overload (else a Scalar, read back)
        torch._foreach_div_(denom, per_step)
        if decay is not None:
            torch._foreach_mul_(ws, decay)
        torch._foreach_addcdiv_(ws, mw, denom, value=-1)
        del denom
        if held is not None:
            _put_back(held, keep)

    _on_fp32_state(ps, los, ms, vs, copies, update)


def torch_fused_master_adamw_update_many(ps, gs, los, ms, vs, lr, wd: float, beta1: float, beta2: float,
                                         eps: float, step, grad_scale=None, keep=None, copies=None) -> None:
    """eager_master_adamw_update_many's update done by torch's own fused AdamW kernel
    (torch._fused_adamw_, one pass over each element of fp32 lists): what MasterAdamW runs on CUDA
    without titanlite's kernel (optimizer.fused false). `step` is the 0-d step count after this update
    (torch's kernel derives the bias corrections from it); the other arguments are
    eager_master_adamw_update_many's.

    torch's kernel takes one dtype for all its lists, so what is not fp32 (bf16 moments and
    gradients, the masters of bf16 parameters) goes through fp32 temporaries, chunk by chunk as in
    eager_master_adamw_update_many, and is written back. The arithmetic is torch AdamW's: the same
    formula, in another order (m <- beta1 m + (1 - beta1) g; w <- w (1 - lr wd) - lr / bias1 * m /
    (sqrt(v) / bias2_sqrt + eps)), so it differs from the reference in the last bits. A skipped step
    (`keep`) changes nothing; fp32 gradients are left divided by `grad_scale` (the kernel writes the
    scaled gradient back).
    """
    if not ps:
        return
    found_inf = None if keep is None else keep.to(torch.float32)  # the kernel skips where it is 1
    for part in _chunks(ps):
        def update(ws, mw, vw, gs=gs[part]):
            torch._fused_adamw_(ws, _fp32(gs), mw, vw, [], [step] * len(ws), lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                                found_inf=found_inf)

        _on_fp32_state(ps[part], los and los[part], ms[part], vs[part], copies and copies[part], update)


def _on_fp32_state(ps, los, ms, vs, copies, update: Callable) -> None:
    """`update(ws, mw, vw)` in place on fp32 masters and moments: `ps` and the moments themselves where
    they are fp32, else fp32 temporaries (join_master for bf16 parameters) written back rounded to
    nearest even afterwards; the bf16 `copies` of fp32 masters are rewritten as their rounding."""
    ws = ps if los is None else _join_masters(ps, los)
    mw, vw = _fp32(ms), _fp32(vs)
    update(ws, mw, vw)
    for state, work in ((ms, mw), (vs, vw)):
        if work is not state:
            torch._foreach_copy_(state, work)
    if los is not None:
        _split_masters(ws, ps, los)
    if copies is not None:
        torch._foreach_copy_(copies, ws)


def _converted(ts: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """New tensors: `ts` converted to `dtype`, in one foreach copy."""
    out = [torch.empty_like(t, dtype=dtype) for t in ts]
    torch._foreach_copy_(out, ts)
    return out


def _fp32(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`ts` themselves where all are fp32, else fp32 copies of them."""
    return ts if all(t.dtype == torch.float32 for t in ts) else _converted(ts, torch.float32)


def _scaled_grads(gs: list[torch.Tensor], grad_scale) -> list[torch.Tensor]:
    """The gradients in fp32 divided by `grad_scale` (None: as they are), never written in place."""
    g = _fp32(gs)
    if grad_scale is None:
        return g
    if g is gs:
        return torch._foreach_div(g, grad_scale)
    torch._foreach_div_(g, grad_scale)
    return g


def _join_masters(ps: list[torch.Tensor], los: list[torch.Tensor]) -> list[torch.Tensor]:
    """join_master over lists: the fp32 masters, as new tensors. A bf16 value widened to fp32 has its bits
    in the high half, so the low bits are added to it as integers (int16 into int32: sign-extended)."""
    ws = _converted(ps, torch.float32)
    torch._foreach_add_([w.view(torch.int32) for w in ws], los)
    return ws


def _split_masters(ws: list[torch.Tensor], ps: list[torch.Tensor], los: list[torch.Tensor]) -> None:
    """Write the fp32 masters `ws` into their bf16 parameters `ps` and low bits `los` (master_low_bits
    over lists; `ws` are join_master's temporaries, used up here)."""
    torch._foreach_copy_(ps, ws)
    bits = [w.view(torch.int32) for w in ws]
    torch._foreach_sub_(bits, [p.view(torch.int16) for p in ps], alpha=65536)  # widened to int32 first
    torch._foreach_clamp_max_(bits, 32767)
    torch._foreach_copy_(los, bits)


def _hold(lists: list[list[torch.Tensor]], keep: torch.Tensor):
    """Before an update that `keep` (0-d bool) may cancel: the bits of the fp32 tensors in `lists` where
    it is true, zeros where not. In integers, so that _put_back gives NaN and -0 back exactly."""
    bits = [t.view(torch.int32) for ts in lists for t in ts]
    return bits, torch._foreach_mul(bits, keep.to(torch.int32))


def _put_back(held, keep: torch.Tensor) -> None:
    """After the update: each tensor _hold saw becomes what it was before where `keep` is true."""
    bits, before = held
    torch._foreach_mul_(bits, (~keep).to(torch.int32))
    torch._foreach_add_(bits, before)


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
    graph is captured; titanlite.ops.master_adamw); on CUDA without it torch's fused AdamW kernel
    (torch_fused_master_adamw_update_many), on the CPU `eager_master_adamw_update_many` over each
    group and kind's lists (the reference the kernels are tested against). `update`,
    when given, runs instead of both, parameter by parameter (same arguments as
    eager_master_adamw_update): estimation's fake run counts the kernel's bytes through it.
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
        keep = (self._found_inf > 0) if self._found_inf is not None else None  # None: no skip to decide
        (beta1, beta2), eps = self.defaults["betas"], self.defaults["eps"]  # one setting for all groups
        steps = [self.state[p]["step"] for _, p in work]
        step = steps[0] + 1 if keep is None else torch.where(keep, steps[0], steps[0] + 1)  # all step together
        bias1, bias2_sqrt = 1 - beta1 ** step, (1 - beta2 ** step).sqrt()
        scale, update, many = self._grad_scale, self._update, None
        if update is None and self.fused and device.type == "cuda":
            # here, not at the top: the kernels need triton, which only CUDA builds of torch bring
            from titanlite.ops.master_adamw import master_adamw_update as update
            if not torch.cuda.is_current_stream_capturing():  # the launch's tables are copied in per change
                from titanlite.ops.master_adamw import master_adamw_update_many as many
        if update is not None:  # a kernel's arguments: the scale and the skip always as tensors
            scale = scale if scale is not None else torch.ones((), device=device)
            keep = keep if keep is not None else torch.zeros((), dtype=torch.bool, device=device)
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
            if update is None:
                if device.type in TORCH_KERNEL_DEVICES:  # torch's fused kernel, over fp32 lists
                    torch_fused_master_adamw_update_many(ws, gs, los, ms, vs, *args[:5], step, scale, keep, copies)
                else:  # the CPU: the whole list at once, a few kernels per step of the formula
                    eager_master_adamw_update_many(ws, gs, los, ms, vs, *args, copies=copies)
                continue
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
