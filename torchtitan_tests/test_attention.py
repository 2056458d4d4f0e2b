"""Attention backends: numerics against `manual`, and the FA4 -> FA3 -> FA2 -> SDPA -> manual fallback chain.

The optional packages are made unimportable (sys.modules[name] = None makes `import name` raise
ImportError) or replaced by small stand-ins, so the chain is exercised on any machine.
"""

import importlib
import logging
import sys
import types

import pytest
import torch

from titanlite.ops import attention as A


def qkv(b=2, s=16, hq=4, hkv=4, d=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda h: torch.randn(b, s, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    return mk(hq), mk(hkv), mk(hkv)


def fwd_bwd(backend, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = backend(q, k, v)
    out.float().square().sum().backward()  # a non-trivial upstream gradient
    return out.detach().float(), [t.grad.float() for t in (q, k, v)]


def assert_matches_manual(name, q, k, v, atol, rtol):
    ref_out, ref_grads = fwd_bwd(A.build_attention("manual"), q, k, v)
    out, grads = fwd_bwd(A.build_attention(name), q, k, v)
    assert out.shape == ref_out.shape == q.shape
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)


@pytest.mark.parametrize("hkv", [4, 2, 1])  # MHA, GQA, MQA
def test_sdpa_matches_manual_on_cpu(hkv):
    assert_matches_manual("sdpa", *qkv(hkv=hkv), atol=1e-5, rtol=1e-5)


def test_manual_is_causal():
    q, k, v = qkv(s=8)
    out = A.build_attention("manual")(q, k, v)
    v2 = v.detach().clone()
    v2[:, 5:] += 10.0  # changing later positions must not change earlier outputs
    out2 = A.build_attention("manual")(q, k, v2)
    torch.testing.assert_close(out[:, :5], out2[:, :5])
    assert not torch.allclose(out[:, 5:], out2[:, 5:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [n for n in A.BACKENDS if n != "manual"])
@pytest.mark.parametrize("hkv", [8, 2])
def test_gpu_backends_match_manual(name, hkv):
    device = torch.device("cuda")
    if not A.BACKENDS[name].available(device):
        pytest.skip(f"{name} is not available here")
    q, k, v = qkv(b=2, s=256, hq=8, hkv=hkv, d=64, dtype=torch.bfloat16, device="cuda")
    # The yardstick is the error bf16 costs anyway: `manual` run in bf16 against `manual` in fp32 on
    # the same inputs. (A fixed tolerance against bf16 `manual` failed on 1 gradient element of 65536,
    # where the three fused kernels agreed with each other and bf16 `manual` was the one off.)
    manual = A.build_attention("manual")
    ref = fwd_bwd(manual, *(t.detach().float() for t in (q, k, v)))
    low = fwd_bwd(manual, q, k, v)
    got = fwd_bwd(A.build_attention(name), q, k, v)
    for what, x, lo, r in zip(["out", "dq", "dk", "dv"], [got[0], *got[1]], [low[0], *low[1]], [ref[0], *ref[1]]):
        assert x.shape == r.shape
        err, bf16_err = (x - r).abs().max().item(), (lo - r).abs().max().item()
        assert err <= 3 * bf16_err + 1e-3, f"{name} {what}: max error {err:.3g} vs bf16 manual's {bf16_err:.3g}"


# ----------------------------------------------------------------------------------- fallback chain
@pytest.fixture
def no_flash(monkeypatch):
    """No flash-attn package can be imported."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)


def fake_flash_module(monkeypatch, module: str, returns_tuple: bool):
    """A stand-in package whose flash_attn_func computes causal attention (B, S, H, D) like the real one."""
    manual = A.Manual()

    def flash_attn_func(q, k, v, causal):
        assert causal
        out = manual(q, k, v)
        return (out, None) if returns_tuple else out

    mod = types.ModuleType(module)
    mod.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, module, mod)


def fake_fa4_module(monkeypatch, calls: list | None = None):
    """A stand-in for flash-attn 4's kernel entry points (flash_attn.cute.interface), written out by hand:
    causal attention and its log-sum-exp forward, the softmax-attention gradients backward, with K/V
    kept at their own head count (GQA: each K/V head's gradient sums over the query heads it serves)."""

    def probs(q, k):  # (B, Hq, S, S) fp32 causal softmax, and the log-sum-exp of its logits
        k = A._repeat_kv(k, q.shape[2] // k.shape[2])
        s = q.shape[1]
        scores = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        return scores.softmax(-1), scores.logsumexp(-1)

    def _flash_attn_fwd(q, k, v, causal, return_lse):
        assert causal and return_lse and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        if calls is not None:
            calls.append(("fwd", k.shape[2]))
        p, lse = probs(q, k)
        out = torch.einsum("bhst,bthd->bshd", p, A._repeat_kv(v, q.shape[2] // v.shape[2]).float())
        return out.to(q.dtype), lse, None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, causal):
        assert causal and lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
        if calls is not None:
            calls.append(("bwd", k.shape[2]))
        n_rep = q.shape[2] // k.shape[2]
        p, _ = probs(q, k)
        do, vr, kr = dout.float(), A._repeat_kv(v, n_rep).float(), A._repeat_kv(k, n_rep).float()
        dp = torch.einsum("bshd,bthd->bhst", do, vr)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) / q.shape[-1] ** 0.5
        dq = torch.einsum("bhst,bthd->bshd", ds, kr)
        dk = torch.einsum("bhst,bshd->bthd", ds, q.float())
        dv = torch.einsum("bhst,bshd->bthd", p, do)
        fold = lambda g: g.unflatten(2, (k.shape[2], n_rep)).sum(3)  # query heads -> the K/V head they share
        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)

    mod = types.ModuleType("flash_attn.cute.interface")
    mod._flash_attn_fwd, mod._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", mod)


@pytest.fixture
def fake_hopper(monkeypatch):
    """Pretend a compute-capability 9.0 GPU is present (only capability queries are made)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return torch.device("cuda", 0)


def warnings_of(caplog):
    return [r.message for r in caplog.records if r.name == "titanlite" and r.levelno == logging.WARNING]


@pytest.mark.parametrize("requested", ["flash_attn_4", "flash_attn_3", "flash_attn", "sdpa_cudnn", "sdpa_flash",
                                       "sdpa_efficient"])
def test_missing_backends_fall_back_to_sdpa_on_cpu(no_flash, caplog, requested):
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend(requested, torch.device("cpu")) == "sdpa"
    (msg,) = warnings_of(caplog)  # a single warning naming what was asked and what runs
    assert f"'{requested}'" in msg and "using 'sdpa'" in msg


def test_available_backend_gives_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("manual", torch.device("cpu")) == "manual"
        assert A.resolve_backend("sdpa", torch.device("cpu")) == "sdpa"
        assert A.resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert warnings_of(caplog) == []


def test_chain_fa3_fa2_sdpa_with_packages_present_or_missing(monkeypatch, fake_hopper, caplog):
    fake_flash_module(monkeypatch, "flash_attn_interface", returns_tuple=True)
    fake_flash_module(monkeypatch, "flash_attn", returns_tuple=False)
    assert A.resolve_backend("flash_attn_3", fake_hopper) == "flash_attn_3"
    assert A.resolve_backend("auto", fake_hopper) == "flash_attn_3"

    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # FA3 missing: FA2 runs
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("flash_attn_3", fake_hopper) == "flash_attn"
    assert len(warnings_of(caplog)) == 1 and "using 'flash_attn'" in warnings_of(caplog)[0]
    # auto prefers cuDNN SDPA over FA2 (measured faster on H100 at the 1.36B shapes)
    assert A.resolve_backend("auto", fake_hopper) == "sdpa_cudnn"

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # both missing: SDPA runs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("flash_attn_3", fake_hopper) == "sdpa"
    assert len(warnings_of(caplog)) == 1


def test_fa4_first_in_the_chain_and_in_auto_only_where_its_row_lists_it(monkeypatch, fake_hopper, caplog):
    fake_fa4_module(monkeypatch)
    fake_flash_module(monkeypatch, "flash_attn_interface", returns_tuple=True)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert A.resolve_backend("flash_attn_4", fake_hopper) == "flash_attn_4"
    # auto follows the measured order of its GPU's row, which lists flash_attn_4 only for long sequences
    assert "flash_attn_4" not in A.AUTO_ORDER[9].backends
    assert A.resolve_backend("auto", fake_hopper) == "flash_attn_3"
    assert A.resolve_backend("auto", fake_hopper, seq_len=8192) == "flash_attn_3"
    monkeypatch.setitem(A.AUTO_ORDER, 9, A.AutoOrder(("flash_attn_4", *A.AUTO_ORDER[9].backends), "test"))
    assert A.resolve_backend("auto", fake_hopper) == "flash_attn_4"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # another GPU's row
    assert A.auto_order(fake_hopper) == A.AUTO_ORDER[0].backends
    assert A.resolve_backend("auto", fake_hopper) == "sdpa_flash"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)  # FA4 missing: FA3 runs, one warning
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("flash_attn_4", fake_hopper) == "flash_attn_3"
    assert len(warnings_of(caplog)) == 1 and "'flash_attn_4'" in warnings_of(caplog)[0]
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # FA4 and FA3 missing: SDPA runs
    assert A.resolve_backend("flash_attn_4", fake_hopper) == "sdpa"


REAL_IMPORT = importlib.import_module


def broken_import(monkeypatch, module: str, error: Exception):
    """importlib.import_module(`module`) raises `error`, as an installed package that fails at import does."""
    def import_module(name, package=None):
        if name == module:
            raise error
        return REAL_IMPORT(name, package)

    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(importlib, "import_module", import_module)


def test_an_installed_backend_that_does_not_load_is_named_with_its_error(monkeypatch, fake_hopper, caplog):
    # flash-attn 4 installed but its CuTe DSL raising at import: auto at seq 8192 passes it over and says why
    broken_import(monkeypatch, "flash_attn.cute.interface", RuntimeError("CuTe DSL: libcuda.so not found\nmore"))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("auto", fake_hopper, seq_len=8192) == "sdpa_cudnn"
        assert A.resolve_backend("auto", fake_hopper, seq_len=2048) == "sdpa_cudnn"  # not in auto's order there
    assert warnings_of(caplog) == ["model.attention_backend=auto: flash_attn_4 is installed but does not load here "
                                   "(RuntimeError: CuTe DSL: libcuda.so not found); using 'sdpa_cudnn'"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("flash_attn_4", fake_hopper) == "sdpa"
    assert warnings_of(caplog) == ["attention backend 'flash_attn_4' is not available on cuda (it is installed but "
                                   "does not load: RuntimeError: CuTe DSL: libcuda.so not found); using 'sdpa' instead"]
    # a dependency of the package missing is a broken install too; the package itself missing is not
    broken_import(monkeypatch, "flash_attn.cute.interface", ModuleNotFoundError("No module named 'cutlass'",
                                                                                name="cutlass"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        A.resolve_backend("auto", fake_hopper, seq_len=8192)
    assert [m.split("(")[1].split(")")[0] for m in warnings_of(caplog)] == ["ModuleNotFoundError: No module named 'cutlass'"]
    broken_import(monkeypatch, "flash_attn.cute.interface", ModuleNotFoundError("No module named 'flash_attn'",
                                                                                name="flash_attn"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("auto", fake_hopper, seq_len=8192) == "sdpa_cudnn"
    assert warnings_of(caplog) == []
    # a module that loads without the entry points titanlite calls is named too
    monkeypatch.setattr(importlib, "import_module", REAL_IMPORT)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", types.ModuleType("flash_attn.cute.interface"))
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("auto", fake_hopper, seq_len=8192) == "sdpa_cudnn"
    assert [m.split("(")[1].split(")")[0] for m in warnings_of(caplog)] == [
        "flash_attn.cute.interface has no _flash_attn_fwd or _flash_attn_bwd"]


def test_flash_attn_4_alone_does_not_make_flash_attn_2_look_broken(monkeypatch, fake_hopper, caplog):
    # flash-attn 4's wheel ships flash_attn/cute only: `import flash_attn` gives an empty namespace package
    namespace = types.ModuleType("flash_attn")
    namespace.__path__ = []  # a package, without __file__ as a namespace package has
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("flash_attn", fake_hopper) == "sdpa"
    assert warnings_of(caplog) == ["attention backend 'flash_attn' is not available on cuda; using 'sdpa' instead"]
    caplog.clear()
    namespace.__file__ = "/site/flash_attn/__init__.py"  # a real package without the function is named
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("flash_attn", fake_hopper) == "sdpa"
    assert "(it is installed but does not load: flash_attn has no flash_attn_func)" in warnings_of(caplog)[0]


def test_a_broken_package_for_another_gpu_is_not_named(monkeypatch, fake_hopper, caplog):
    # flash-attn 3 is Hopper's alone: on a Blackwell GPU auto's row starts with it, and a broken install of it
    # there is not what passed it over
    broken_import(monkeypatch, "flash_attn_interface", RuntimeError("built for sm90"))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        assert A.resolve_backend("auto", fake_hopper) == "sdpa_cudnn"
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("capability,available", [((9, 0), True), ((10, 0), True), ((8, 0), False), ((12, 0), False)])
def test_fa4_runs_on_hopper_and_blackwell(monkeypatch, fake_hopper, capability, available):
    fake_fa4_module(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert A.BACKENDS["flash_attn_4"].available(fake_hopper) is available
    assert not A.BACKENDS["flash_attn_4"].available(torch.device("cpu"))


def test_fa4_without_its_kernel_entry_points_counts_as_missing(monkeypatch):
    mod = types.ModuleType("flash_attn.cute.interface")
    mod._flash_attn_fwd = lambda *a, **k: None  # no _flash_attn_bwd: another release's layout
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", mod)
    assert A.FlashAttn4._load() is None


@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_fa4_ops_forward_and_backward_match_manual_with_native_gqa(monkeypatch, hkv):
    """The custom ops hand the kernels K/V at their own head count and route the gradients back."""
    calls = []
    fake_fa4_module(monkeypatch, calls)
    assert_matches_manual("flash_attn_4", *qkv(hkv=hkv), atol=1e-5, rtol=1e-5)
    assert calls == [("fwd", hkv), ("bwd", hkv)]


def test_fa4_compiles_fullgraph_as_one_op_each_way(monkeypatch):
    """torch.compile(fullgraph=True) traces the block through the ops' fake kernels, forward and
    backward (aot_eager: AOTAutograd's fake-tensor trace, then eager kernels), and gives eager's
    values; the forward op in the graph is the one selective activation checkpointing saves."""
    fake_fa4_module(monkeypatch)
    attn = A.build_attention("flash_attn_4")
    fn = lambda q, k, v: attn(q, k, v) * 2
    q, k, v = qkv(hkv=2)
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    ref, ref_grads = fwd_bwd(fn, q, k, v)
    out, grads = fwd_bwd(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-6)
    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=record)(q, k, v)
    assert "titanlite.flash_attn_4_forward.default" in seen
    assert isinstance(torch.ops.titanlite.flash_attn_4_forward.default, torch._ops.OpOverload)


def test_fa3_is_hopper_only(monkeypatch, fake_hopper):
    fake_flash_module(monkeypatch, "flash_attn_interface", returns_tuple=True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # Blackwell
    assert not A.BACKENDS["flash_attn_3"].available(fake_hopper)


@pytest.mark.parametrize("module,name,tup", [("flash_attn_interface", "flash_attn_3", True),
                                             ("flash_attn", "flash_attn", False)])
def test_flash_wrappers_pass_layout_and_unwrap_outputs(monkeypatch, module, name, tup):
    """The wrapper hands (B, S, H, D) tensors straight through and unwraps FA3's (out, lse)."""
    fake_flash_module(monkeypatch, module, returns_tuple=tup)
    assert_matches_manual(name, *qkv(hkv=2), atol=0, rtol=0)


def test_broken_package_counts_as_missing(monkeypatch):
    mod = types.ModuleType("flash_attn")  # imports, but has no flash_attn_func (a broken build)
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    assert A.FlashAttn._load() is None


def test_backend_in_use_goes_into_the_run_log(no_flash, tmp_cache):
    from titanlite.config import load_config
    from titanlite.train import Trainer

    t = Trainer(load_config(["--training.dataset", "synthetic", "--training.steps", "1", "--training.seq_len", "16",
                             "--training.local_batch_size", "1", "--model.attention_backend", "flash_attn",
                             "--validation.enable=false", "--metrics.progress_bar=false",
                             "--job.dump_folder", str(tmp_cache)]))
    assert t.run_log.data["startup_info"]["config"]["attention_backend"] == "sdpa"
    assert t.run_log.data["startup_info"]["config"]["model.attention_backend"] == "flash_attn"


@pytest.mark.parametrize("name,native", [("sdpa_cudnn", True), ("sdpa", True), ("sdpa_flash", False),
                                         ("sdpa_efficient", False)])
def test_grouped_kv_reach_the_kernels_that_take_them_unexpanded(monkeypatch, name, native):
    """cuDNN (and torch's own choice) get grouped K/V as they are, with enable_gqa; the kernels that do not
    take it get K/V expanded to the query heads. The output is the same either way."""
    import torch.nn.functional as F

    from titanlite.ops import attention as A

    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(A.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((k.shape[1], kw["enable_gqa"])) or sdpa(q, k, v, **kw))
    q, k, v = torch.randn(2, 16, 8, 32), torch.randn(2, 16, 2, 32), torch.randn(2, 16, 2, 32)  # B, S, H, D
    backend = A.build_attention(name)
    backend.unpin()  # the CPU runs what torch picks, with this backend's tensors
    out = backend(q, k, v)
    assert seen == [(2, True)] if native else [(8, False)]
    torch.testing.assert_close(out, A.Manual()(q, k, v), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode, forwards_per_block", [("selective", 1), ("full", 2)])
def test_selective_checkpointing_keeps_fa4s_output(monkeypatch, mode, forwards_per_block):
    """Selective 'op' checkpointing keeps flash-attn 4's forward output (titanlite's op is one the policy
    saves), so each block's backward runs the attention forward kernel no second time; full
    checkpointing recomputes it. (A policy that misses the op recomputes attention: slower, same values.)"""
    from titanlite.models import build_model, get_model_args
    from titanlite.parallel.apply import apply_ac
    from titanlite.parallel.settings import ActivationCheckpointSettings

    calls = []
    fake_fa4_module(monkeypatch, calls)
    args = get_model_args("llama", "debug")
    torch.manual_seed(0)
    model = build_model(args, "flash_attn_4", max_seq_len=32)
    model.init_weights()
    apply_ac(model, ActivationCheckpointSettings(mode, "op"))
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    model(tokens, tokens).backward()
    assert [c[0] for c in calls].count("bwd") == args.n_layers
    assert [c[0] for c in calls].count("fwd") == args.n_layers * forwards_per_block


@pytest.mark.parametrize("seq_len, picked", [(2048, "sdpa_cudnn"), (8191, "sdpa_cudnn"), (8192, "flash_attn_4"),
                                             (32768, "flash_attn_4")])
def test_auto_takes_fa4_on_hopper_from_seq_8192(monkeypatch, fake_hopper, seq_len, picked):
    """On Hopper with flash-attn 4 installed (and flash-attn 3 not), `auto` runs it from 8192 tokens a
    sequence, where it measured faster in the whole step, and cuDNN SDPA below; without it, cuDNN."""
    fake_fa4_module(monkeypatch)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert A.resolve_backend("auto", fake_hopper, seq_len=seq_len) == picked
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)
    assert A.resolve_backend("auto", fake_hopper, seq_len=seq_len) == "sdpa_cudnn"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))  # a row not measured
    fake_fa4_module(monkeypatch)
    assert A.resolve_backend("auto", fake_hopper, seq_len=seq_len) == "sdpa_cudnn"
