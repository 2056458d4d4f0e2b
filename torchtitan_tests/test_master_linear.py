"""training.bf16_params (the default where a run computes in bf16): the blocks' matrices are fp32
master parameters that multiply bf16 copies of themselves, with fp32 weight gradients
(titanlite.ops.master_linear) and MasterAdamW rewriting the copies.

What must hold: each weight gradient is produced and accumulated in fp32 (closer to the exact sum
than autocast's, far closer than a bf16 accumulation); the run computes what autocast computes
(step 1 bit for bit); under ddp and zero1 it gives the single process's losses; compile and
activation checkpointing change nothing; resume is exact and checkpoints load across autocast and
the default both ways. CPU runs compute in fp32 unless training.mixed_precision_param=bfloat16,
which these tests set. MasterAdamW itself and the per-mode mapping are in test_bf16_params.py.
"""

import contextlib
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.utils._python_dispatch

from titanlite.config import load_config
from titanlite.ops.master_linear import MasterLinear, use_bf16_copy
from titanlite.optim import MasterAdamW
from titanlite.step import StepHooks
from titanlite.train import Trainer

from conftest import free_port, gloo_rank, spawn
from test_checkpoint import args as ckpt_args, losses
from test_parallel import base_args, step_losses

BF16 = ["--training.mixed_precision_param", "bfloat16"]  # CPU runs are fp32 by default
AUTOCAST = BF16 + ["--training.bf16_params=false"]


def run_single(folder, local_batch: int, *extra: str) -> tuple[Trainer, list[float]]:
    t = Trainer(load_config(base_args(folder, local_batch, *extra)))
    t.train()
    t.close()
    return t, step_losses(t)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops run inside the context (autograd's own accumulation into .grad included)."""

    def __init__(self, log: bool = False):
        super().__init__()
        self.seen = set()
        # (op, its output's dtype and size) in order; not the tensor itself, whose extra reference
        # would make autograd copy a gradient it could otherwise take as it is
        self.log = [] if log else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func)
        out = func(*args, **(kwargs or {}))
        if self.log is not None and isinstance(out, torch.Tensor):
            self.log.append((func, out.dtype, out.numel()))
        return out


# ------------------------------------------------------------------------------ gradients, one layer
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_gradient_sums_in_fp32_over_64_micro_steps(compiled, device):
    """64 micro-steps into one .grad: within fp32 rounding of the exact sum, added in place (the
    first micro-step's tensor is kept; on CUDA the GEMM adds into it). Summed in bf16 (what a bf16
    parameter's gradient did), and even autocast's way (each product rounded to bf16, then added in
    fp32), most elements land outside that bound."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False, device=device)
    use_bf16_copy(lin)
    f = torch.compile(lin, fullgraph=True) if compiled else lin
    xs = [torch.randn(16, 64, device=device).bfloat16() for _ in range(64)]
    gys = [torch.randn(16, 32, device=device).bfloat16() for _ in range(64)]
    first = None
    for x, gy in zip(xs, gys):  # x needs no gradient: the weight's is still produced
        with contextlib.nullcontext(OpRecorder()) if compiled else OpRecorder() as ops:  # (compile refuses modes)
            f(x).backward(gy)
        first = first or lin.weight.grad.data_ptr()
        assert lin.weight.grad.dtype == torch.float32 and lin.weight.grad.data_ptr() == first
        assert torch.ops.aten.add_.Tensor not in ops.seen  # no separate add: the GEMM accumulates
    exact = sum(gy.double().t() @ x.double() for x, gy in zip(xs, gys))
    # each element: 16 products summed per micro-step, then 64 additions, each rounding at most 2^-24
    # of a partial sum no larger than the sum of the terms' magnitudes
    bound = (16 + 64) * 2 ** -24 * sum(gy.double().abs().t() @ x.double().abs() for x, gy in zip(xs, gys))
    assert ((lin.weight.grad.double() - exact).abs() <= bound).all()
    in_bf16 = torch.zeros(32, 64, dtype=torch.bfloat16, device=device)
    autocast_way = torch.zeros(32, 64, device=device)
    for x, gy in zip(xs, gys):
        in_bf16 += gy.t() @ x
        autocast_way += (gy.t() @ x).float()
    for other in (in_bf16, autocast_way):
        assert ((other.double() - exact).abs() > bound).float().mean() > 0.5


def test_selective_checkpointing_saves_the_bf16_gemm():
    """selective 'op' AC's policy sees the copy's GEMM as an mm (so it keeps its output), and the
    recomputed backward gives the same gradients."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from titanlite.parallel.apply import save_matmuls_policy

    policy, saved = save_matmuls_policy(), []

    def recording(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if decision == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            saved.append(op)
        return decision

    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    use_bf16_copy(lin)
    x = torch.randn(8, 64, requires_grad=True)
    lin(x).float().square().sum().backward()
    plain = (lin.weight.grad.clone(), x.grad.clone())
    lin.weight.grad = x.grad = None
    out = checkpoint(lin, x, use_reentrant=False,
                     context_fn=lambda: create_selective_checkpoint_contexts(recording))
    out.float().square().sum().backward()
    assert torch.ops.aten.mm.default in saved
    assert torch.equal(lin.weight.grad, plain[0]) and torch.equal(x.grad, plain[1])


# ---------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("loss", ["chunked", "cross_entropy"])
def test_default_computes_what_autocast_computes(tmp_path, loss):
    """The blocks' matrices (and under the full cross-entropy, which calls the output layer, its
    matrix too) stay fp32 parameters equal to autocast's (same init), their copies are the bf16
    roundings autocast would make, so step 1's loss is bit for bit autocast's; later steps differ by
    the weight gradients no longer rounded to bf16 and the optimizer's order of arithmetic
    (accumulation 2 here)."""
    accum = ["--training.global_batch_size", "8", "--training.loss", loss]
    t = Trainer(load_config(base_args(tmp_path / "default", 4, *BF16, *accum)))
    ref = Trainer(load_config(base_args(tmp_path / "autocast", 4, *AUTOCAST, *accum)))
    assert type(t.optimizer) is MasterAdamW and type(ref.optimizer) is torch.optim.AdamW
    copies = {n: p for n, p in t.model.named_parameters() if t.masters.has_copy(p)}
    assert "layers.0.attention.wq.weight" in copies and "layers.3.feed_forward.w2.weight" in copies
    assert ("output.weight" in copies) == (loss == "cross_entropy")
    assert not copies.keys() & {"tok_embeddings.weight", "norm.weight", "layers.0.ffn_norm.weight"}
    init = dict(ref.model.named_parameters())
    for n, p in t.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, init[n]), n
    t.train()
    ref.train()
    for n, p in copies.items():
        assert isinstance(t.model.get_submodule(n.removesuffix(".weight")), MasterLinear)
        assert torch.equal(t.masters.copies[p], p.detach().bfloat16()), n  # rewritten with every update
    ours, theirs = step_losses(t), step_losses(ref)
    assert ours[0] == theirs[0] and ours == pytest.approx(theirs, rel=5e-4) and ours != theirs
    t.close()
    ref.close()


def test_compile_and_selective_checkpointing_change_nothing(tmp_path):
    """Compiled blocks (fullgraph) under selective 'op' activation checkpointing accumulate the
    gradients of two micro-batches as the eager blocks do: within bf16 noise (the compiled kernels
    round differently), where a lost or doubled weight gradient would be off by its whole size."""
    eager = Trainer(load_config(base_args(tmp_path / "eager", 4, *BF16)))
    compiled = Trainer(load_config(base_args(tmp_path / "compiled", 4, *BF16, "--compile.enable",
                                             "--activation_checkpoint.mode", "selective")))
    assert all(type(b).__name__ == "OptimizedModule" for b in compiled.model.layers.values())
    batches = [eager.next_batch() for _ in range(2)]
    for t in (eager, compiled):
        for inputs, labels in batches:
            (t.step.forward_loss(inputs, labels) / 2).backward()
    grads = dict(eager.model.named_parameters())
    strip = lambda n: n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
    checked = 0
    for n, p in compiled.model.named_parameters():
        ref = grads[strip(n)].grad
        assert p.grad.dtype == torch.float32 and (p.grad - ref).norm() < 1e-2 * ref.norm(), n
        checked += compiled.masters.has_copy(p)
    assert checked == 4 * 7  # every block matrix of the debug model
    eager.close()
    compiled.close()


# ---------------------------------------------------------------------------- ddp and zero1
DIST_RUNS = {  # name -> (local batch per rank, extra args); global batch 8 x accumulation 2 everywhere
    "ddp": (2, BF16 + ["--parallelism.data_parallel", "ddp"]),
    "zero1": (2, BF16 + ["--parallelism.data_parallel", "zero1"]),
    "ddp_autocast": (2, AUTOCAST + ["--parallelism.data_parallel", "ddp"]),
}
ACCUM = ["--training.global_batch_size", "8"]


def first_step_grads(t) -> dict[str, torch.Tensor]:
    """The gradients of the first optimizer step's micro-batches, reduced as the step reduces them."""
    from titanlite.parallel.grads import grad_sync

    for micro in range(t.grad_accum):
        with grad_sync(t.model, micro == t.grad_accum - 1):
            (t.step.forward_loss(*t.next_batch()) / t.grad_accum).backward()
    return {n.removeprefix("module."): p.grad.clone() for n, p in t.model.named_parameters()}


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port, out_dir) as results:
        _runs(rank, out_dir, results)


def _runs(rank: int, out_dir: str, results: dict) -> None:
    for name, (local, extra) in DIST_RUNS.items():
        t = Trainer(load_config(base_args(os.path.join(out_dir, name), local, *extra, *ACCUM)))
        if name == "ddp":  # from a twin run: these micro-batches are then gone from its data stream
            probe = Trainer(load_config(base_args(os.path.join(out_dir, "probe"), local, *extra, *ACCUM)))
            grads = first_step_grads(probe)
            if rank == 0:
                torch.save(grads, os.path.join(out_dir, "grads.pt"))
            probe.close()
        t.train()
        stale = sum(not torch.equal(copy, p.detach().bfloat16()) for p, copy in t.masters.copies.items())
        if rank == 0:
            results[name] = {"losses": step_losses(t), "optimizer": type(t.optimizer).__name__,
                             "local": type(getattr(t.optimizer, "optim", t.optimizer)).__name__,
                             "accum": t.grad_accum, "stale": stale}
        t.close()


def test_ddp_and_zero1_match_one_process(tmp_path):
    """2 gloo ranks x local 2 x accumulation 2 against one process with local 4 x accumulation 2.
    ddp all-reduces fp32 gradients: the first step's gradients are the single process's up to the
    order of fp32 sums (a bf16 all-reduce would be off by about 1e-3). zero1 updates each parameter
    on its owner with the same MasterAdamW and refreshes the other ranks' copies: ddp's losses. The
    losses agree with the single process as closely as autocast's own (bf16 runs drift apart by
    up to about 4e-4 in 8 steps at this lr from last-bit differences)."""
    spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r = json.loads((tmp_path / "results.json").read_text())
    _, single = run_single(tmp_path / "single", 4, *BF16, *ACCUM)
    reference = Trainer(load_config(base_args(tmp_path / "single_grads", 4, *BF16, *ACCUM)))
    expected = first_step_grads(reference)
    reference.close()
    grads = torch.load(tmp_path / "grads.pt")
    assert grads.keys() == expected.keys()
    for n, g in grads.items():
        assert g.dtype == torch.float32 and (g - expected[n]).norm() <= 1e-5 * expected[n].norm(), n
    assert (r["ddp"]["optimizer"], r["zero1"]["optimizer"], r["zero1"]["local"]) == (
        "MasterAdamW", "ZeroMasterAdamW", "MasterAdamW")
    for name in DIST_RUNS:
        assert r[name]["accum"] == 2 and r[name]["losses"][0] == pytest.approx(single[0], rel=1e-6), name  # fp32 sums
        assert r[name]["losses"] == pytest.approx(single, rel=5e-4), name
    assert r["ddp"]["stale"] == r["zero1"]["stale"] == 0  # every rank's copies follow the masters
    assert r["zero1"]["losses"] == pytest.approx(r["ddp"]["losses"], rel=1e-6)


def _bucket_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world, port, out_dir) as results:
        t = Trainer(load_config(base_args(os.path.join(out_dir, "ddp"), 2, *BF16, *ACCUM,
                                          "--parallelism.data_parallel", "ddp")))
        params = list(t.model.parameters())
        masters = {p.numel() for p in params if t.masters.has_copy(p)}
        recorder = OpRecorder(log=True)
        held = []  # per micro-step: storage -> bytes of every gradient's storage at its end

        class InBackward(StepHooks):
            def __init__(self, record_ops):
                self.record_ops = record_ops

            def backward(self, micro, last):
                return recorder if self.record_ops else contextlib.nullcontext()

            @contextlib.contextmanager
            def micro_step(self, micro, last):
                yield
                held.append({p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                             for p in params if p.grad is not None})

        storages, outside = [], []
        for step in range(4):  # DDP lays out its buckets anew in step 2; from step 3 on they stay
            held.clear()
            t.step(lambda micro: t.next_batch(), InBackward(step == 3))
            storages.append({p.grad.untyped_storage().data_ptr() for p in params if t.masters.has_copy(p)})
            # after the synced backward every gradient is a view of its bucket: what the accumulating
            # micro-step held beyond those storages was a second copy of some gradients
            outside.append(sum(n for ptr, n in held[0].items() if ptr not in held[-1]))
        copied = [str(f) for f, dtype, numel in recorder.log
                  if f in (torch.ops.aten.copy_.default, torch.ops.aten.mul.out, torch.ops.aten.div_.Tensor,
                           torch.ops.aten.div_.Scalar)
                  and dtype == torch.float32 and numel in masters]
        if rank == 0:
            results.update(copied=copied, buckets=len(storages[3]), same=storages[2] == storages[3], outside=outside,
                           others=sum(p.numel() * p.element_size() for p in params if not t.masters.has_copy(p)))
        t.close()


def test_ddp_masters_reduce_in_their_buckets(tmp_path):
    """ddp keeps the masters' fp32 gradients in its reduce buckets between steps (released as stale):
    each weight GEMM writes its gradient there, so DDP copies no master gradient into a bucket and
    divides none (the mean is the all-reduce's own), over 2 gloo ranks with accumulation 2. From the
    first step on: while a no_sync micro-step accumulates, the only gradients outside the buckets are
    the other parameters' (set to None after each update, a fresh tensor each step), never a second
    copy of the masters'. The losses stay the single process's (test_ddp_and_zero1_match_one_process)."""
    spawn(_bucket_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["copied"] == []
    assert r["outside"] == [r["others"]] * 4
    assert r["same"] and r["buckets"] < 4  # the gradients live in the same few bucket storages step to step


@GPU
def test_cuda_compiled_and_captured_steps(tmp_path):
    """On CUDA: compiled blocks, the fp32-output GEMMs and the update kernel writing the copies,
    captured as a CUDA graph after 2 eager steps and replayed, train as the eager uncompiled steps
    do (within bf16 noise), with accumulation 2."""
    gpu = ["--training.seq_len", "128", "--training.global_batch_size", "8"]
    _, eager = run_single(tmp_path / "eager", 4, *gpu)
    t, replayed = run_single(tmp_path / "graphs", 4, *gpu, "--compile.enable", "--training.cuda_graphs",
                             "--training.cuda_graphs_warmup", "2")
    assert t.cuda_graph is not None and not t.cuda_graph.failed and type(t.optimizer) is MasterAdamW
    params = [p for p in t.model.parameters() if t.masters.has_copy(p)]
    assert params and all(torch.equal(t.masters.copies[p], p.detach().bfloat16()) for p in params)
    assert replayed == pytest.approx(eager, rel=2e-3)


# -------------------------------------------------------------------------------- checkpoints
def _ckpt_args(folder, *extra: str) -> list[str]:
    return ckpt_args(folder, "--checkpoint.keep_latest_k", "0", *extra)  # every checkpoint kept


def _train(folder, *extra: str) -> Trainer:
    t = Trainer(load_config(_ckpt_args(folder, *extra)))
    t.train()
    t.close()
    return t


def test_default_resumes_exactly(tmp_path):
    """The fp32 masters and moments are the saved state; the bf16 copies are rebuilt from the
    loaded masters, so resuming from step 4 repeats steps 5 and 6 bit for bit."""
    whole = losses(_train(tmp_path, *BF16))
    t = _train(tmp_path, *BF16, "--checkpoint.load_step", "4")
    assert losses(t) == {5: whole[5], 6: whole[6]}
    params = [p for p in t.model.parameters() if t.masters.has_copy(p)]
    assert params and all(torch.equal(t.masters.copies[p], p.detach().bfloat16()) for p in params)


@pytest.mark.parametrize("saved, loaded", [(AUTOCAST, BF16), (BF16, AUTOCAST)], ids=["autocast->default",
                                                                                   "default->autocast"])
def test_checkpoints_load_across_autocast_and_the_default(tmp_path, saved, loaded):
    """The same keys and dtypes either way (fp32 weights; step and moments per parameter): a run
    resumed in the other setting starts from the saved masters (the copies follow them) and goes on
    as the saving setting would, up to the small difference between the two."""
    whole = losses(_train(tmp_path, *saved))
    probe = Trainer(load_config(_ckpt_args(tmp_path, *loaded, "--checkpoint.load_step", "4")))
    reference = Trainer(load_config(_ckpt_args(tmp_path, *saved, "--checkpoint.load_step", "4")))
    assert probe.state.step == 4 and type(probe.optimizer) is not type(reference.optimizer)
    for p, q in zip(probe.model.parameters(), reference.model.parameters()):
        assert torch.equal(p, q)
        if probe.masters.has_copy(p):
            assert torch.equal(probe.masters.copies[p], p.detach().bfloat16())
    mine, theirs = probe.optimizer.state_dict()["state"], reference.optimizer.state_dict()["state"]
    for i, st in theirs.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[i][k], st[k]), (i, k)
        assert float(mine[i]["step"]) == float(st["step"]) == 4
    reference.close()
    probe.train()
    probe.close()
    resumed = losses(probe)
    assert sorted(resumed) == [5, 6] and [resumed[5], resumed[6]] == pytest.approx([whole[5], whole[6]], rel=1e-3)


def test_hf_export_and_initial_load_carry_the_masters(tmp_path):
    """Hugging Face export writes the fp32 masters (the copies are no state), and loading that folder
    with checkpoint.initial_load_path gives a run whose masters are the exported weights and whose
    copies are their rounding."""
    from safetensors.torch import load_file

    from titanlite.checkpoint.export import export

    t = _train(tmp_path / "run", *BF16, "--training.steps", "2")
    folder = export(str(tmp_path / "run" / "checkpoint"), str(tmp_path / "hf"))
    exported = {}
    for f in sorted(folder.glob("*.safetensors")):
        exported.update(load_file(f))
    assert all(v.dtype == torch.float32 for v in exported.values())
    wq = t.model.layers["0"].attention.wq.weight
    assert any(torch.equal(v, wq.detach()) for v in exported.values())  # the master, not its rounding
    loaded = Trainer(load_config(base_args(tmp_path / "loaded", 2, *BF16, "--checkpoint.initial_load_path",
                                           str(folder))))
    for p, q in zip(loaded.model.parameters(), t.model.parameters()):
        assert torch.equal(p, q)
        if loaded.masters.has_copy(p):
            assert torch.equal(loaded.masters.copies[p], q.detach().bfloat16())
    loaded.close()


@pytest.mark.parametrize("mode", ["none", "zero1"])
def test_float8_matrices_keep_their_own_form(mode):
    """float8 (emulated here): torchao's Float8Linear keeps a bf16 weight whose fp32 master (the fp32
    initialisation) MasterAdamW holds as low bits; no bf16 copy is made for it. Under zero1, whose
    ZeroRedundancyOptimizer takes one dtype, the weights stay fp32 and torchao casts them itself."""
    from titanlite.config import parallel_settings
    from titanlite.models import build_model, get_model_args
    from titanlite.optim import build_optimizer
    from titanlite.parallel.apply import apply_bf16_params, apply_float8, materialize

    cfg = load_config([*BF16, "--float8.enable", "--float8.emulate"])
    with torch.device("meta"):
        model = build_model(get_model_args("llama", "debug"), "sdpa", 32)
    apply_float8(model, parallel_settings(cfg).float8)
    materialize(model, torch.device("cpu"), 0)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    masters = apply_bf16_params(model, mode)
    assert not masters.copies and len(masters.initial) == (0 if mode == "zero1" else 4 * 7)
    f8 = {n: p for n, p in model.named_parameters() if type(model.get_submodule(n.rsplit(".", 1)[0])).__name__
          == "Float8Linear"}
    assert len(f8) == 4 * 7 and not any(isinstance(m, MasterLinear) for m in model.modules())
    assert all(p.dtype == (torch.float32 if mode == "zero1" else torch.bfloat16) for p in f8.values())
    if mode == "none":
        opt = build_optimizer(model, cfg, torch.device("cpu"), masters=masters)
        assert type(opt) is MasterAdamW and not masters.initial  # the optimizer took the fp32 initial values
        for n, p in f8.items():
            assert torch.equal(opt.master(p).bfloat16(), p.detach())
            assert (opt.master(p).view(torch.int32) - init[n].view(torch.int32)).abs().max() <= 1  # see master_low_bits
