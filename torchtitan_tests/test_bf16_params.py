"""titanlite.optim.MasterAdamW and optimizer.moments_dtype=bfloat16, and how training.bf16_params
maps onto the modes.

MasterAdamW's masters are fp32 parameters whose bf16 copy it rewrites (training.bf16_params' block
matrices), or bf16 parameters holding each master's high 16 bits with the low 16 in the optimizer
state (float8's matrices under training.bf16_params; the tests below build those directly).
The update must be torch's AdamW (same formula, same clip and skip semantics) applied to the fp32
masters, with each bf16 parameter or copy the rounding of its master; bf16 moments must be the
rounding of what the fp32 arithmetic gives; checkpoints must keep the masters exact. The bf16
copies' GEMMs, fp32 gradient accumulation, loss parity with autocast, ddp / zero1 and checkpoints
are in test_master_linear.py.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titanlite.config import ConfigError, load_config
from titanlite.config.manager import check_combination
from titanlite.ops.master_linear import MasterWeights
import titanlite.optim
from titanlite.optim import (MasterAdamW, eager_master_adamw_update, eager_master_adamw_update_many, join_master,
                             master_low_bits, torch_fused_master_adamw_update_many)

SHAPES = [(64, 32), (32,), (48, 64)]


def pair(fused: bool = False, device: str = "cpu", moments=torch.float32):
    """torch AdamW on fp32 parameters, and MasterAdamW on their bf16 twins (bf16-exact start)."""
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s, device=device).bfloat16().float()) for s in SHAPES]
    low = [torch.nn.Parameter(p.detach().bfloat16()) for p in ref]
    groups = lambda ps: [{"params": [ps[0], ps[2]], "weight_decay": 0.1}, {"params": [ps[1]], "weight_decay": 0.0}]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    return ref, low, torch.optim.AdamW(groups(ref), **kw), MasterAdamW(groups(low), fused=fused,
                                                                      moments_dtype=moments, **kw)


def steps(ref, low, a, b, n: int, scale: float = 2.0):
    """n steps with the same bf16 gradients; MasterAdamW divides by the clip's scale (the fused clip's
    interface), torch's gets them divided."""
    for _ in range(n):
        for r, w in zip(ref, low):
            g = torch.randn(r.shape, device=r.device).bfloat16()
            r.grad, w.grad = g.float() / scale, g
        b.scale_next_step(torch.tensor(scale, device=r.device), None)
        a.step()
        b.step()


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("fused, device", [(False, "cpu"), pytest.param(True, "cuda", marks=GPU),
                                           pytest.param(False, "cuda", marks=GPU)],
                         ids=["eager", "triton-cuda", "torch-cuda"])
def test_update_is_torch_adamw_on_the_masters(fused, device):
    ref, low, a, b = pair(fused, device)
    steps(ref, low, a, b, 5)
    for r, w in zip(ref, low):
        st = b.state[w]
        assert st["master_lo"].dtype == torch.int16 and st["exp_avg"].dtype == torch.float32
        assert w.dtype == torch.bfloat16
        torch.testing.assert_close(b.master(w), r.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(st["exp_avg"], a.state[r]["exp_avg"], rtol=1e-6, atol=1e-7)
        assert torch.equal(w.detach(), b.master(w).bfloat16())  # the parameter is its master, rounded
        assert st["step"].item() == 5
    assert (low[0].cpu().float() != pair()[1][0].float()).any()  # it moved


@pytest.mark.parametrize("fused, device", [(False, "cpu"), pytest.param(True, "cuda", marks=GPU),
                                           pytest.param(False, "cuda", marks=GPU)],
                         ids=["eager", "triton-cuda", "torch-cuda"])
def test_found_inf_skips_everything_on_device(fused, device):
    ref, low, a, b = pair(fused, device)
    steps(ref, low, a, b, 2)
    before = {id(w): {k: v.clone() for k, v in b.state[w].items()} for w in low}
    params = [w.detach().clone() for w in low]
    for w in low:
        w.grad = torch.full(w.shape, float("inf"), dtype=torch.bfloat16, device=device)
    b.scale_next_step(None, torch.tensor(1.0, device=device))
    b.step()
    for w, p in zip(low, params):
        assert torch.equal(w.detach(), p)
        for k, v in b.state[w].items():
            assert torch.equal(v, before[id(w)][k]), k  # step counter included
    steps(ref, low, a, b, 1)  # and the next finite step is torch's third
    for r, w in zip(ref, low):
        torch.testing.assert_close(b.master(w), r.detach(), rtol=1e-6, atol=1e-6)


def test_master_is_the_parameter_and_its_low_bits():
    """master_low_bits / join_master give back every fp32 value exactly, but those halfway between two
    bf16 numbers that round down, which move by one fp32 ulp and still round to the same bf16."""
    torch.manual_seed(0)
    w = torch.cat([torch.randn(100_000) * 0.02, torch.randn(1000) * 1e4, torch.tensor([0.0, -0.0, 1e-40, -1e-40])])
    w[:2000] = ((w[:2000].view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)  # exactly halfway
    half = (w.view(torch.int32) & 0xFFFF) == 0x8000  # these, and the odd random one
    p = w.bfloat16()
    back = join_master(p, master_low_bits(w, p))
    assert torch.equal(back[~half], w[~half]) and torch.equal(back.bfloat16(), p)
    moved = (back.view(torch.int32) - w.view(torch.int32)).abs()
    assert moved.max() == 1 and 500 < moved[half].sum() < 1500  # the ties that rounded to the even below


def test_bf16_moments_are_the_rounded_fp32_moments():
    """optimizer.moments_dtype=bfloat16: the arithmetic is fp32 and only the stored moments round, so
    the first step's masters equal the fp32-moment optimizer's and its moments are their rounding;
    over 20 steps the masters stay within a few 1e-4 of torch's fp32 AdamW (lr 1e-2)."""
    _, low, _, b32 = pair()
    ref, low16, a, b16 = pair(moments=torch.bfloat16)
    for w, w16 in zip(low, low16):
        w.grad = w16.grad = torch.randn(w.shape).bfloat16()
    b32.step()
    b16.step()
    for w, w16 in zip(low, low16):
        assert torch.equal(b16.master(w16), b32.master(w))
        for k in ("exp_avg", "exp_avg_sq"):
            assert b16.state[w16][k].dtype == torch.bfloat16
            assert torch.equal(b16.state[w16][k], b32.state[w][k].bfloat16()), k
    ref, low16, a, b16 = pair(moments=torch.bfloat16)
    steps(ref, low16, a, b16, 20)
    for r, w in zip(ref, low16):
        assert (b16.master(w) - r.detach()).abs().max() < 1e-3
        assert (b16.master(w) - r.detach()).abs().max() > 0  # the rounding is there


def _same_bits(a: list[dict], b: list[dict]) -> bool:
    """Every tensor of `a` holds the bits of its twin in `b` (equal bits, not only equal values: NaN, -0)."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.int16: torch.int16}
    return all(torch.equal(x[k].view(as_int[x[k].dtype]), y[k].view(as_int[y[k].dtype]))
               for x, y in zip(a, b) for k in x)


class _NoReadBack(TorchDispatchMode):
    """Fails where a tensor's value is read back to the host (.item(), or a 0-d tensor taken for an op's
    Scalar overload): on CUDA each read is a sync."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, "a value read back to the host"
        return func(*args, **(kwargs or {}))


# Mixed sizes for the list updates, cut into chunks (CPU_UPDATE_CHUNK 3000: one tensor larger than a
# chunk), with an empty local shard among them (FSDP can leave a rank one)
LIST_SIZES = [(64, 32), (0,), (5000,), (7, 3), (1,), (40, 40)]


# (step, clip scale, skip) of each update of the list tests; the skipped step does not count, and the
# fourth update has neither a scale nor a skip to decide (None)
LIST_SCHEDULE = [(1, 2.0, False), (2, 0.5, False), (3, 3.0, True), (3, None, None), (4, 1.5, False)]


@pytest.fixture
def list_masters(monkeypatch) -> list[torch.Tensor]:
    """fp32 masters of LIST_SIZES, the CPU's update chunk made small enough to cut them."""
    monkeypatch.setattr(titanlite.optim, "CPU_UPDATE_CHUNK", 3000)
    torch.manual_seed(0)
    return [torch.randn(s) for s in LIST_SIZES]


def list_grads(state: list[dict], skip: bool) -> list[torch.Tensor]:
    """A gradient for each parameter of `state`, in its dtype; all infinite for a step to skip."""
    grads = [torch.randn(s["p"].shape).to(s["p"].dtype) for s in state]
    return [g.fill_(float("inf")) for g in grads] if skip else grads


def list_master(s: dict) -> torch.Tensor:
    """The fp32 master list_state's entry `s` holds."""
    return join_master(s["p"], s["lo"]) if "lo" in s else s["p"]


def list_state(masters: list[torch.Tensor], kind: str, moments: torch.dtype) -> list[dict]:
    """Per fp32 master, what MasterAdamW holds for its kind: the parameter ("p": the master itself, or
    its bf16 rounding with the low bits "lo"), a bf16 "copy" for kind "copy", and zero moments."""
    out = []
    for w in masters:
        p = w.bfloat16() if kind == "lo" else w.clone()
        s = {"p": p, "m": torch.zeros(w.shape, dtype=moments), "v": torch.zeros(w.shape, dtype=moments)}
        s.update({"lo": master_low_bits(w, p)} if kind == "lo" else {"copy": w.bfloat16()} if kind == "copy" else {})
        out.append(s)
    return out


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32_moments", "bf16_moments"])
@pytest.mark.parametrize("kind", ["own", "copy", "lo"])
def test_list_update_is_the_per_parameter_update(kind, moments, list_masters):
    """The eager update over a list (what MasterAdamW runs per group and kind, off CUDA's fused kernel)
    writes, bit for bit, what it writes parameter by parameter, for each kind of master: mixed sizes cut
    into chunks (one tensor larger than a chunk), an empty local shard among them (FSDP can leave a
    rank one), the clip's scale; a skipped step (`keep`) leaves every bit as it was, infinite gradients
    and all; no scale and no skip (None) are a scale of 1 and a `keep` of False. It reads no value back
    to the host (the skip and the scalars stay on the device)."""
    whole, each = list_state(list_masters, kind, moments), list_state(list_masters, kind, moments)
    los, copies = ([s[k] for s in whole] if k in whole[0] else None for k in ("lo", "copy"))
    lr = torch.tensor(1e-2)
    for t, scale, keep in LIST_SCHEDULE:
        grads = list_grads(whole, bool(keep))
        before = [{k: x.clone() for k, x in s.items()} for s in whole]
        step = torch.tensor(float(t))
        args = (lr, 0.1, 0.9, 0.95, 1e-8, 1 - 0.9 ** step, (1 - 0.95 ** step).sqrt())
        with _NoReadBack():
            eager_master_adamw_update_many([s["p"] for s in whole], grads, los, [s["m"] for s in whole],
                                           [s["v"] for s in whole], *args, None if scale is None else torch.tensor(scale),
                                           None if keep is None else torch.tensor(keep), copies=copies)
        for s, g in zip(each, grads):
            eager_master_adamw_update(s["p"], g, s.get("lo"), s["m"], s["v"], *args, torch.tensor(scale or 1.0),
                                      torch.tensor(bool(keep)), s.get("copy"))
        assert _same_bits(whole, each), t
        if keep:
            assert _same_bits(whole, before)
    for s, w in zip(whole, list_masters):  # it moved; each bf16 copy or parameter is its master's rounding
        master = list_master(s)
        assert w.numel() == 0 or not torch.equal(master, w)
        assert kind == "own" or torch.equal(s.get("copy", s["p"]), master.bfloat16())


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16], ids=["fp32_moments", "bf16_moments"])
@pytest.mark.parametrize("kind", ["own", "copy", "lo"])
def test_torch_kernel_is_the_eager_update(kind, moments, list_masters):
    """torch's fused AdamW over fp32 lists (optimizer.fused false on CUDA; its CPU kernel here) follows
    the reference list update for each kind of master, chunked, with an empty shard, the clip's scale,
    no scale, and a skipped step that leaves every bit as it was: masters within fp32 rounding, each
    bf16 parameter or copy its master's rounding, the low bits and the moments stored as the reference
    stores them but where the two fp32 results straddle a rounding boundary."""
    ours, ref = list_state(list_masters, kind, moments), list_state(list_masters, kind, moments)
    lists = lambda st, k: [s[k] for s in st] if k in st[0] else None
    lr = torch.tensor(1e-2)
    for t, scale, keep in LIST_SCHEDULE:
        grads = list_grads(ours, bool(keep))
        before = [{k: x.clone() for k, x in s.items()} for s in ours]
        step = torch.tensor(float(t))
        scale, keep = (None if scale is None else torch.tensor(scale)), (None if keep is None else torch.tensor(keep))
        torch_fused_master_adamw_update_many(lists(ours, "p"), [g.clone() for g in grads], lists(ours, "lo"),
                                             lists(ours, "m"), lists(ours, "v"), lr, 0.1, 0.9, 0.95, 1e-8, step,
                                             scale, keep, lists(ours, "copy"))
        eager_master_adamw_update_many(lists(ref, "p"), grads, lists(ref, "lo"), lists(ref, "m"), lists(ref, "v"),
                                       lr, 0.1, 0.9, 0.95, 1e-8, 1 - 0.9 ** step, (1 - 0.95 ** step).sqrt(), scale,
                                       keep, copies=lists(ref, "copy"))
        if keep:
            assert _same_bits(ours, before)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(list_master(a), list_master(b), rtol=2e-6, atol=1e-7)
            assert torch.equal(a.get("copy", a["p"]), list_master(a).to(a.get("copy", a["p"]).dtype))
            for k in ("m", "v"):
                torch.testing.assert_close(a[k].float(), b[k].float(), atol=1e-7,
                                           rtol=1e-5 if moments == torch.float32 else 2 ** -7)
    for s, w in zip(ours, list_masters):  # it moved
        assert w.numel() == 0 or not torch.equal(list_master(s), w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("launch", ["one per group", "one per parameter"])
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_kernel_is_the_eager_update(moments, launch, monkeypatch):
    """The Triton kernel writes what the eager reference writes: the masters within fp32 rounding, each
    bf16 parameter its master's rounding, the moments within fp32 rounding (bf16 moments: one bf16
    step where the two fp32 results straddle a rounding boundary). bf16 moments one step only: after
    such a one-step difference the next update differs by lr x that step. Both launches: all of a
    group's parameters at once, and parameter by parameter (what runs under CUDA graph capture)."""
    import titanlite.ops.master_adamw as kernels

    if launch == "one per parameter":
        monkeypatch.setattr(kernels, "master_adamw_update_many", lambda *a, **k: False)
    torch.manual_seed(0)
    masters = [torch.randn(s) for s in SHAPES + [(5000,)]]  # off the bf16 grid: the low bits are not zero

    def build(device, fused):
        params = [torch.nn.Parameter(w.to(device).bfloat16()) for w in masters[:-1]]
        kept = MasterWeights()
        for p, w in zip(params, masters):
            kept.initial[p] = w.to(device)
        params.append(torch.nn.Parameter(masters[-1].to(device)))  # an fp32 parameter: its own master
        groups = [{"params": [params[0], params[2], params[3]], "weight_decay": 0.1},
                  {"params": [params[1]], "weight_decay": 0.0}]
        return params, MasterAdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=fused, moments_dtype=moments,
                                   masters=kept)

    (low, eager), (low_gpu, fused) = build("cpu", False), build("cuda", True)
    assert all(torch.equal(eager.master(w), m) for w, m in zip(low, masters))
    for _ in range(3 if moments == torch.float32 else 1):
        for w, wg in zip(low, low_gpu):
            w.grad = torch.randn(w.shape).to(w.dtype)
            wg.grad = w.grad.cuda()
        eager.step()
        fused.step()
    launched = sum("table" in c for c in fused._launch_cache.values())  # (group, dtype) pairs launched at once
    assert launched == (3 if launch == "one per group" else 0)
    for w, wg in zip(low, low_gpu):
        torch.testing.assert_close(fused.master(wg).cpu(), eager.master(w), rtol=1e-6, atol=1e-7)
        assert torch.equal(wg.detach(), fused.master(wg).to(wg.dtype))
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[wg][k].cpu().float(), eager.state[w][k].float(),
                                       rtol=1e-5 if moments == torch.float32 else 2 ** -7, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("launch", ["one per group", "one per parameter"])
def test_kernel_writes_the_bf16_copies(launch, monkeypatch):
    """fp32 masters with bf16 copies (training.bf16_params' matrices) beside one without: the kernel
    updates the masters as the eager reference does (within fp32 rounding) and writes each copy as
    the exact rounding of its new master."""
    import titanlite.ops.master_adamw as kernels

    if launch == "one per parameter":
        monkeypatch.setattr(kernels, "master_adamw_update_many", lambda *a, **k: False)
    torch.manual_seed(0)
    masters = [torch.randn(s) for s in [(64, 32), (48, 64), (5000,)]]

    def build(device, fused):
        params = [torch.nn.Parameter(w.to(device, copy=True)) for w in masters]  # (on the CPU, not `masters` itself)
        kept = MasterWeights()
        for p in params[:2]:
            kept.copies[p] = p.detach().bfloat16()
        return params, MasterAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                   fused=fused, masters=kept)

    (ref, eager), (gpu, fused) = build("cpu", False), build("cuda", True)
    for _ in range(3):
        for w, wg in zip(ref, gpu):
            w.grad = torch.randn(w.shape)
            wg.grad = w.grad.cuda()
        eager.step()
        fused.step()
    assert sum("table" in c for c in fused._launch_cache.values()) == (2 if launch == "one per group" else 0)
    for w, wg in zip(ref, gpu):
        torch.testing.assert_close(wg.detach().cpu(), w.detach(), rtol=1e-6, atol=1e-7)
        assert "master_lo" not in fused.state[wg]
    for wg in gpu[:2]:
        copy = fused.masters.copies[wg]
        assert torch.equal(copy, wg.detach().bfloat16())
        assert not torch.equal(copy.cpu(), masters[0 if wg.shape == (64, 32) else 1].bfloat16())  # it moved


def test_state_dict_round_trip_is_exact():
    """torch's Optimizer.load_state_dict casts state to the parameter dtype (bf16 here): ours must not;
    moments saved in one moments_dtype load into the other."""
    ref, low, a, b = pair()
    steps(ref, low, a, b, 3)
    sd = b.state_dict()
    _, low2, _, b2 = pair()
    b2.load_state_dict(sd)
    for w, w2 in zip(low, low2):
        for k, v in b.state[w].items():
            assert b2.state[w2][k].dtype == v.dtype and torch.equal(b2.state[w2][k], v), k
    _, low3, _, b3 = pair(moments=torch.bfloat16)
    b3.load_state_dict(sd)
    for w, w3 in zip(low, low3):
        assert torch.equal(b3.state[w3]["exp_avg"], b.state[w]["exp_avg"].bfloat16())
    b2.sync_masters()  # after a model-only load, the masters follow the parameters
    assert all(torch.equal(b2.master(w), w.float()) for w in low2)


@pytest.mark.parametrize("extra, world, device, copies, autocast", [
    ([], 1, "cuda", True, True),  # the default on one GPU
    (["--parallelism.data_parallel", "ddp"], 2, "cuda", True, True),
    (["--parallelism.data_parallel", "zero1"], 2, "cuda", True, True),
    (["--parallelism.data_parallel", "fsdp"], 2, "cuda", False, False),  # FSDP's policy gathers bf16 instead
    (["--parallelism.data_parallel", "hsdp"], 2, "cuda", False, False),
    (["--parallelism.data_parallel", "fsdp"], 1, "cuda", True, True),  # one rank runs the single-device path
    (["--training.bf16_params=false"], 1, "cuda", False, True),  # plain autocast
    (["--training.mixed_precision_param", "float32"], 1, "cuda", False, False),  # nothing in bf16
    ([], 1, "cpu", False, False),  # auto: CPU computes in fp32
    (["--training.mixed_precision_param", "bfloat16"], 1, "cpu", True, True),
])
def test_bf16_params_by_mode_and_precision(extra, world, device, copies, autocast):
    """training.bf16_params is on by default and refused nowhere: where the run computes in bf16, one
    device, ddp and zero1 keep bf16 copies of the matrices (with autocast for the rest); fsdp/hsdp
    get bf16 from FSDP's policy, without autocast."""
    from titanlite.config import parallel_settings, run_mode
    from titanlite.parallel.policy import autocasts, bf16_copies

    cfg = load_config(extra)
    check_combination(cfg, world)
    precision, mode = parallel_settings(cfg).precision, run_mode(cfg, world)
    assert bf16_copies(precision, mode, device) == copies and autocasts(precision, mode, device) == autocast


@pytest.mark.parametrize("extra, world, needle", [
    (["--parallelism.data_parallel", "fsdp"], 2, "moments_dtype=bfloat16 with parallelism.data_parallel=fsdp"),
    (["--optimizer.beta2", "0.999"], 1, "beta2=0.999: the second moment would change by less than bf16"),
])
def test_bf16_moments_unsupported_combinations_are_refused(extra, world, needle):
    with pytest.raises(ConfigError, match=needle):
        check_combination(load_config(["--optimizer.moments_dtype", "bfloat16", *extra]), world)
    for mode in ("ddp", "zero1"):  # zero1 runs MasterAdamW as its per-rank optimizer
        check_combination(load_config(["--optimizer.moments_dtype", "bfloat16", "--parallelism.data_parallel", mode]),
                          2)


def test_supported_combinations_pass():
    check_combination(load_config(["--training.bf16_params", "--parallelism.data_parallel", "ddp"]), 2)
    check_combination(load_config(["--training.bf16_params", "--parallelism.data_parallel", "fsdp"]), 1)  # 1 rank
    check_combination(load_config(["--training.bf16_params", "--training.cuda_graphs"]), 1)


def test_initial_load_gives_the_copies_the_loaded_weights(tmp_path, monkeypatch):
    """checkpoint.initial_load_path loads the model alone (here by writing into the parameters, not
    through load_state_dict): the bf16 copies must follow the loaded masters, or the first steps
    would compute with the random initialisation."""
    import titanlite.checkpoint.hf as hf
    from titanlite.train import Trainer

    def fake_load(model, folder, info):  # stands in for reading safetensors: recognisable weights
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.fill_(0.01 * (i + 1))

    monkeypatch.setattr(hf, "load_hf_into", fake_load)
    t = Trainer(load_config(["--training.mixed_precision_param", "bfloat16", "--training.dataset", "synthetic",
                             "--training.seq_len", "32", "--training.local_batch_size", "2",
                             "--metrics.progress_bar=false", "--data.num_workers", "0", "--job.dump_folder",
                             str(tmp_path), "--checkpoint.initial_load_path", str(tmp_path)]))
    try:
        copies = 0
        for i, p in enumerate(t.model.parameters()):
            loaded = torch.full(p.shape, 0.01 * (i + 1), device=p.device)
            assert torch.equal(t.optimizer.master(p), loaded)
            if t.masters.has_copy(p):
                copies += torch.equal(t.masters.copies[p], loaded.bfloat16())
        assert copies == len(t.masters.copies) > 0
    finally:
        t.close()


def test_captured_iteration_updates_as_the_eager_step(tmp_path):
    """What training.cuda_graphs captures (CudaGraphStep.step_fn) must update like the eager step:
    with MasterAdamW the clip goes into the optimizer (an fp32 norm), not a bf16 rescale of the grads."""
    from titanlite.step import CudaGraphStep
    from titanlite.train import Trainer

    argv = ["--training.mixed_precision_param", "bfloat16", "--training.dataset", "synthetic",
            "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--metrics.progress_bar=false", "--data.num_workers", "0",
            "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "0.1"]
    eager, captured = (Trainer(load_config(argv + ["--job.dump_folder", str(tmp_path / n)])) for n in "ab")
    assert type(captured.optimizer) is MasterAdamW
    try:
        eager.train_step()
        graph = CudaGraphStep(captured.step, captured.device, 1, "none")
        norm = graph.step_fn([captured.next_batch()].__getitem__).grad_norm
        assert norm > 0.1  # the clip was active
        for a, b in zip(eager.model.parameters(), captured.model.parameters()):
            assert torch.equal(a, b)
    finally:
        eager.close()
        captured.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [True, False], ids=["triton", "torch-kernel"])
def test_a_captured_update_replays_as_the_eager_one(fused):
    """MasterAdamW's step captured in a CUDA graph (the lr a device tensor, bf16 moments, each kind of
    master) and replayed on new gradients writes what the same steps write eagerly: with torch's kernel
    (optimizer.fused false) bit for bit, with titanlite's (one launch per parameter under capture, one
    per group eagerly) within fp32 rounding."""
    def build():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(512, 256, device="cuda").bfloat16()),
              torch.nn.Parameter(torch.randn(256, 128, device="cuda")), torch.nn.Parameter(torch.randn(128, device="cuda"))]
        kept = MasterWeights()
        kept.copies[ps[1]] = ps[1].detach().bfloat16()
        groups = [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]
        return ps, MasterAdamW(groups, lr=torch.tensor(1e-2, device="cuda"), betas=(0.9, 0.95), fused=fused,
                               moments_dtype=torch.bfloat16, masters=kept)

    (eager_ps, eager), (graph_ps, captured) = build(), build()
    grads = [[torch.randn(p.shape, device="cuda").to(p.dtype) for p in eager_ps] for _ in range(6)]
    static = [torch.zeros_like(p) for p in graph_ps]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as CudaGraphStep does
        for gs in grads[:2]:
            for p, g in zip(graph_ps, gs):
                p.grad = g.clone()
            captured.step()
    torch.cuda.current_stream().wait_stream(side)
    for p, s in zip(graph_ps, static):
        p.grad = s
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.step()
    for i, gs in enumerate(grads):
        if i >= 2:
            for s, g in zip(static, gs):
                s.copy_(g)
            graph.replay()
        for p, g in zip(eager_ps, gs):
            p.grad = g.clone()
        eager.step()
    torch.cuda.synchronize()
    assert captured.state[graph_ps[0]]["step"].item() == 6
    same = torch.testing.assert_close if fused else (lambda a, b, **_: torch.equal(a, b) or pytest.fail("bits differ"))
    for a, b in zip(eager_ps, graph_ps):
        same(captured.master(b), eager.master(a), rtol=1e-6, atol=1e-7)
        for k in ("exp_avg", "exp_avg_sq"):
            same(captured.state[b][k].float(), eager.state[a][k].float(), rtol=2 ** -7, atol=1e-7)
        assert torch.equal(b.detach(), captured.master(b).to(b.dtype))  # each parameter its master's rounding
    assert torch.equal(captured.masters.copies[graph_ps[1]], captured.master(graph_ps[1]).bfloat16())


def test_fused_clip_norm_covers_both_dtypes():
    """With MasterAdamW the clip takes the norm over bf16 and fp32 gradients (grouped by dtype for
    torch's multi-tensor kernel) and hands the optimizer's next step norm / max_norm (and, skipping
    non-finite steps, whether the norm is finite), through the FusedClip interface."""
    from titanlite.parallel.grads import FusedClip, clip_grad_norm, fused_clip_target

    _, low, _, b = pair()
    assert isinstance(b, FusedClip) and fused_clip_target(b) is b

    class Handed:  # what the clip hands over: a FusedClip that keeps it
        def scale_next_step(self, grad_scale, found_inf):
            self.grad_scale, self.found_inf = grad_scale, found_inf

    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(low + [torch.nn.Parameter(torch.randn(40))])  # one fp32 parameter
    for p in model.parameters():
        p.grad = torch.randn(p.shape, dtype=p.dtype)
    handed = Handed()
    norm = clip_grad_norm(model, 1.0, handed, skip_nonfinite=True)
    expected = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm()
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    assert handed.grad_scale.item() == pytest.approx(expected.item() / 1.0, rel=1e-6) and handed.found_inf.item() == 0
    clip_grad_norm(model, 0.0, handed)  # measure only: no scale, no skip flag
    assert handed.grad_scale is None and handed.found_inf is None


def test_fused_clip_reaches_torchs_fused_adamw():
    """torch's fused AdamW takes the clip through its own protocol (GradScaler's attributes), behind
    fused_clip_target's adapter: a scale handed over divides the gradients as dividing them first does,
    and found_inf skips the step. Not where torch's AdamW cannot (unfused, or capturable)."""
    from titanlite.parallel.grads import fused_clip_target

    torch.manual_seed(0)
    start, grad = torch.randn(8, 4), torch.randn(8, 4)
    w1, w2 = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    a = torch.optim.AdamW([w1], lr=1e-2, fused=True)
    b = torch.optim.AdamW([w2], lr=1e-2, fused=True)
    assert fused_clip_target(torch.optim.AdamW([torch.nn.Parameter(start)], fused=False)) is None
    assert fused_clip_target(torch.optim.AdamW([torch.nn.Parameter(start)], fused=True, capturable=True)) is None
    w1.grad, w2.grad = grad / 4, grad.clone()
    fused_clip_target(b).scale_next_step(torch.tensor(4.0), None)
    a.step()
    b.step()
    torch.testing.assert_close(w2.detach(), w1.detach())
    moved = w2.detach().clone()
    fused_clip_target(b).scale_next_step(None, torch.tensor(1.0))
    b.step()
    assert torch.equal(w2.detach(), moved)
