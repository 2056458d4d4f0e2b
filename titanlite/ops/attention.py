"""Causal self-attention backends behind one signature: attn(q, k, v) -> out.

q: (B, S, Hq, D); k, v: (B, S, Hkv, D) with Hq a multiple of Hkv (GQA); out: (B, S, Hq, D).
Each backend is a small class in BACKENDS; `resolve_backend` turns a requested name into one that
can run here, walking the fallback chain FA4 -> FA3 -> FA2 -> SDPA -> manual with a single warning.
`auto` takes the first available backend of its GPU's row in AUTO_ORDER (for the run's sequence length),
with a warning for each installed backend ahead of it that does not load (LOAD_ERRORS).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger("titanlite")

# Backends whose package is installed but raised on import in this process (backend name -> the error's first
# line), filled by _import during resolve_backend's availability checks, so that its warning can say why an
# installed, faster backend was passed over instead of falling back in silence.
LOAD_ERRORS: dict[str, str] = {}


def _import(name: str, module: str):
    """`module`, imported for backend `name`; None where its package is missing (silently: most runs have
    no flash-attn) or where it raises (recorded in LOAD_ERRORS: an installed package that does not load)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            return None  # the package itself (or a part of it) is not installed
        LOAD_ERRORS[name] = _first_line(e)  # installed, but something it imports is missing
        return None
    except Exception as e:  # a broken build or a failing JIT toolchain (the CuTe DSL) raising at import
        LOAD_ERRORS[name] = _first_line(e)
        return None
    return mod


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
    return line if len(line) <= 200 else line[:197] + "..."


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=2)


class Manual:
    """Reference: fp32 softmax(QK^T / sqrt(D) + causal mask) V. Runs anywhere."""

    name = "manual"

    @staticmethod
    def available(device: torch.device) -> bool:
        return True

    def __call__(self, q, k, v):
        n_rep = q.shape[2] // k.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)))
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = q.shape[-2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(dim=-1) @ v.float()
        return out.to(q.dtype).transpose(1, 2)


class SDPA:
    """torch's scaled_dot_product_attention, optionally pinned to one kernel."""

    kernel: str | None = None  # name in torch.nn.attention.SDPBackend, None = let torch choose
    # whether the pinned kernel takes grouped K/V as they are (enable_gqa); the others get K/V expanded
    # to the query heads, a copy the backward keeps
    native_gqa: bool = True

    def __init__(self):
        from torch.nn.attention import SDPBackend

        self._backends = [getattr(SDPBackend, self.kernel)] if self.kernel else None

    @classmethod
    def available(cls, device: torch.device) -> bool:
        if cls.kernel is None:
            return True
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability(device)
        # cuDNN attention is fast from Hopper on; flash SDPA needs sm80+.
        needs = {"CUDNN_ATTENTION": 9, "FLASH_ATTENTION": 8, "EFFICIENT_ATTENTION": 5}[cls.kernel]
        return major >= needs

    def unpin(self) -> None:
        """Let torch choose the kernel, keeping this backend's tensors (its K/V expansion): how a dry
        run on CPU fake tensors stands in for a GPU-only kernel."""
        self._backends = None

    def __call__(self, q, k, v):
        from torch.nn.attention import sdpa_kernel

        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = q.shape[1] != k.shape[1]
        if gqa and not self.native_gqa:  # expand explicitly for a kernel that does not take enable_gqa
            n_rep = q.shape[1] // k.shape[1]
            k, v, gqa = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1), False
        with sdpa_kernel(self._backends) if self._backends else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2)


class SDPAcuDNN(SDPA):
    # cuDNN takes grouped K/V unexpanded: faster and without the expanded copy the backward keeps
    # (benchmarks/results/2026-11-28_4xh200_8b-peers-float8-syncs.md)
    name, kernel = "sdpa_cudnn", "CUDNN_ATTENTION"


class SDPAFlash(SDPA):
    name, kernel, native_gqa = "sdpa_flash", "FLASH_ATTENTION", False


class SDPAEfficient(SDPA):
    name, kernel, native_gqa = "sdpa_efficient", "EFFICIENT_ATTENTION", False


class SDPAAny(SDPA):
    name, kernel = "sdpa", None


class FlashAttn:
    """Dao-AILab flash-attn packages; they take (B, S, H, D) and handle GQA natively."""

    name, module, func = "flash_attn", "flash_attn", "flash_attn_func"

    @classmethod
    def _load(cls):
        mod = _import(cls.name, cls.module)
        fn = getattr(mod, cls.func, None) if mod is not None else None
        # flash-attn 4's wheel alone makes `flash_attn` an empty namespace package (no __file__): not an install
        if fn is None and getattr(mod, "__file__", None) is not None:
            LOAD_ERRORS[cls.name] = f"{cls.module} has no {cls.func}"
        return fn

    @classmethod
    def available(cls, device: torch.device) -> bool:
        return device.type == "cuda" and cls._load() is not None

    def __init__(self):
        self._fn = self._load()

    def __call__(self, q, k, v):
        out = self._fn(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out  # FA3 returns (out, lse)


class FlashAttn3(FlashAttn):
    name, module, func = "flash_attn_3", "flash_attn_interface", "flash_attn_func"

    @classmethod
    def available(cls, device: torch.device) -> bool:
        # the GPU first: a package that could not run here is not looked at (nor named as not loading)
        return (device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9
                and super().available(device))


class FlashAttn4:
    """flash-attn 4 (package flash-attn-4: CuTe DSL kernels for Hopper and Blackwell), GQA native.

    Its Python API is an autograd.Function around JIT-compiled kernels; titanlite calls the kernels
    through two custom ops of its own (flash_attn_4_forward / _backward below), so a compiled block
    (fullgraph) holds one opaque op each way instead of tracing the package's Python, and selective
    activation checkpointing can save the forward's output by op name
    (torch.ops.titanlite.flash_attn_4_forward).
    """

    name, module = "flash_attn_4", "flash_attn.cute.interface"
    capabilities = (9, 10)  # the compute capabilities (major) its forward and backward kernels support

    @classmethod
    def _load(cls):
        """The interface module, or None when it is missing, does not load or lacks the kernel entry points."""
        mod = _import(cls.name, cls.module)
        if mod is None:
            return None
        missing = [f for f in ("_flash_attn_fwd", "_flash_attn_bwd") if not hasattr(mod, f)]
        if missing:
            LOAD_ERRORS[cls.name] = f"{cls.module} has no {' or '.join(missing)}"
            return None
        return mod

    @classmethod
    def available(cls, device: torch.device) -> bool:
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability(device)[0] in cls.capabilities and cls._load() is not None

    def __call__(self, q, k, v):
        # contiguous inputs keep the real kernels' outputs and the ops' fake (traced) ones alike
        return flash_attn_4_forward(q.contiguous(), k.contiguous(), v.contiguous())[0]


@torch.library.custom_op("titanlite::flash_attn_4_forward", mutates_args=())
def flash_attn_4_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention (B, S, Hq, D) and its log-sum-exp (B, Hq, S) in fp32, which the backward reads."""
    out, lse = FlashAttn4._load()._flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
    return out, lse


@flash_attn_4_forward.register_fake
def _fa4_forward_fake(q, k, v):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("titanlite::flash_attn_4_backward", mutates_args=())
def flash_attn_4_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = FlashAttn4._load()._flash_attn_bwd(q, k, v, out, dout, lse, causal=True)[:3]
    return dq, dk, dv


@flash_attn_4_backward.register_fake
def _fa4_backward_fake(dout, q, k, v, out, lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fa4_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _fa4_backward(ctx, dout, dlse):  # the log-sum-exp is an internal output: its gradient is unused
    q, k, v, out, lse = ctx.saved_tensors
    return flash_attn_4_backward(dout.contiguous(), q, k, v, out, lse)


flash_attn_4_forward.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)


BACKENDS = {b.name: b for b in (FlashAttn4, FlashAttn3, FlashAttn, SDPAcuDNN, SDPAFlash, SDPAEfficient, SDPAAny,
                                 Manual)}
CHOICES = ["auto", *BACKENDS]  # what model.attention_backend accepts

# Where an unavailable explicit request falls back to.
FALLBACK = {
    "flash_attn_4": "flash_attn_3", "flash_attn_3": "flash_attn", "flash_attn": "sdpa", "sdpa_cudnn": "sdpa",
    "sdpa_flash": "sdpa", "sdpa_efficient": "sdpa", "sdpa": "manual",
}


class AutoOrder(NamedTuple):
    backends: tuple[str, ...]  # fastest first: `auto` runs the first one available
    source: str  # the measurement (or the reason) behind the order
    long: tuple[str, ...] = ()  # the order from `long_from` tokens a sequence on, where it differs
    long_from: int = 0


# What `auto` tries on a CUDA GPU of each compute capability (major); key 0: any other device.
# A backend moves up a row only after benchmarks/attention.py (kernel) and benchmarks/compare_peer.py
# or launch.py (whole step) measured it faster on that GPU; the figures are in docs/performance.md.
_SDPA_ORDER = ("flash_attn_3", "sdpa_cudnn", "flash_attn", "sdpa_flash", "sdpa", "manual")
AUTO_ORDER: dict[int, AutoOrder] = {
    9: AutoOrder(_SDPA_ORDER, "sdpa_cudnn over sdpa_flash: benchmarks/attention.py on 1 x H100; flash_attn_3 "
                              "first as its authors publish (not measured here); flash_attn_4 from seq 8192: on 1 "
                              "x H200 its kernel ran 1.11-1.13x cuDNN's at the 8B shapes and the whole step gained "
                              "2.0-2.2% at seq 8192 (LLaMA-3.1-8B, Qwen3-8B; 3.2-3.8% at LLaMA 1.36B, 3.3% at Qwen3 "
                              "1.8B) and 4.7-5.4% at 32768, 1.9% under fsdp on 2 x H200 at 8192; below it cuDNN: at "
                              "seq 2048 a call of flash_attn_4 took about 1.1 ms at batch 4 and 8 alike and Qwen3's "
                              "grouped K/V ran slower (docs/performance.md)",
                 long=("flash_attn_3", "flash_attn_4", *_SDPA_ORDER[1:]), long_from=8192),
    0: AutoOrder(_SDPA_ORDER, "unmeasured GPUs: availability filters the same order (cuDNN SDPA needs sm90+)"),
}


def auto_order(device: torch.device, seq_len: int = 0) -> tuple[str, ...]:
    """The backends `auto` tries on `device` for sequences of `seq_len` tokens, fastest first."""
    major = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" and torch.cuda.is_available() else 0
    row = AUTO_ORDER.get(major, AUTO_ORDER[0])
    return row.long if row.long and seq_len >= row.long_from else row.backends


def resolve_backend(requested: str, device: torch.device, seq_len: int = 0) -> str:
    """Name of the backend that will run for `requested` on `device`, for sequences of `seq_len` tokens
    (auto's order can depend on it); warns once on fallback, and where an installed backend that `auto`
    would have taken first does not load, says so with its error."""
    LOAD_ERRORS.clear()  # what this resolution's availability checks find
    if requested == "auto":
        order = auto_order(device, seq_len)
        name = next(n for n in order if BACKENDS[n].available(device))
        for passed in order[:order.index(name)]:
            if passed in LOAD_ERRORS:
                logger.warning(f"model.attention_backend=auto: {passed} is installed but does not load here "
                               f"({LOAD_ERRORS[passed]}); using '{name}'")
        return name
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend '{requested}'; choose from auto, {', '.join(BACKENDS)}")
    name = requested
    while not BACKENDS[name].available(device):
        name = FALLBACK[name]
    if name != requested:
        why = f" (it is installed but does not load: {LOAD_ERRORS[requested]})" if requested in LOAD_ERRORS else ""
        logger.warning(f"attention backend '{requested}' is not available on {device.type}{why}; using '{name}' instead")
    return name


def build_attention(name: str):
    return BACKENDS[name]()
