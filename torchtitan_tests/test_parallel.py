"""Data-parallel modes, accumulation, activation checkpointing, float8 and CUDA-graph fallback on CPU.

Parity: every rank reads its slice of one seeded global sample order (titanlite/data/loader.py), so
2 ranks x local batch b see exactly the samples a single process sees in its batch of 2b. Every
mode must then give the single process's per-step losses (within 1e-5 relative).
"""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from titanlite.config import ConfigError, load_config
from titanlite.metrics import run_log
from titanlite.train import Trainer

from conftest import ROOT, free_port, gloo_rank, spawn

STEPS = 8


def base_args(folder, local_batch: int, *extra: str) -> list[str]:
    # lr high enough and warm-up short enough that the losses move visibly in 8 steps
    return ["--training.dataset", "python_stdlib", "--training.steps", str(STEPS), "--training.seq_len", "32",
            "--training.local_batch_size", str(local_batch), "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--validation.enable=false",
            "--metrics.progress_bar=false", "--data.num_workers", "0", "--job.dump_folder", str(folder), *extra]


def step_losses(trainer) -> list[float]:
    return [v for e in trainer.run_log.data["training_iterations"] for v in e["step_losses"]]


def run_single(folder, local_batch: int, *extra: str) -> list[float]:
    t = Trainer(load_config(base_args(folder, local_batch, *extra)))
    t.train()
    return step_losses(t)


# Each distributed run: name -> (local batch per rank, extra args). Global batch 8 everywhere.
DIST_RUNS = {
    "ddp": (4, ["--parallelism.data_parallel", "ddp"]),
    "zero1": (4, ["--parallelism.data_parallel", "zero1"]),
    "fsdp": (4, ["--parallelism.data_parallel", "fsdp"]),
    "hsdp_2x1": (4, ["--parallelism.data_parallel", "hsdp", "--parallelism.replicate_degree", "2"]),
    "hsdp_1x2": (4, ["--parallelism.data_parallel", "hsdp", "--parallelism.shard_degree", "2"]),
    "ddp_accum2": (2, ["--parallelism.data_parallel", "ddp", "--training.global_batch_size", "8"]),
    "fsdp_accum2": (2, ["--parallelism.data_parallel", "fsdp", "--training.global_batch_size", "8"]),
    "fsdp_reshard_never": (4, ["--parallelism.data_parallel", "fsdp", "--parallelism.fsdp_reshard_after_forward",
                               "never"]),
    "fsdp_ac_full": (4, ["--parallelism.data_parallel", "fsdp", "--activation_checkpoint.mode", "full"]),
    # blocks grouped (the first block alone, then two a group); then three a group with each group's gathers
    # freed after forward and the blocks recomputed in backward
    "fsdp_groups2": (4, ["--parallelism.data_parallel", "fsdp", "--parallelism.fsdp_blocks_per_group", "2"]),
    "fsdp_groups3_ac_reshard": (4, ["--parallelism.data_parallel", "fsdp", "--parallelism.fsdp_blocks_per_group", "3",
                                    "--activation_checkpoint.mode", "full",
                                    "--parallelism.fsdp_reshard_after_forward", "always"]),
    # bf16 compute under fsdp, its float32 gradient reduction as NCCL's reduce-scatter or as an all-to-all of
    # the bf16 gradients summed in float32 by each shard's owner
    "fsdp_bf16": (4, ["--parallelism.data_parallel", "fsdp", "--training.mixed_precision_param", "bfloat16",
                      "--parallelism.fsdp_gradient_transport", "reduce_dtype"]),
    "fsdp_bf16_transport": (4, ["--parallelism.data_parallel", "fsdp", "--training.mixed_precision_param", "bfloat16",
                                "--parallelism.fsdp_gradient_transport", "bfloat16"]),
    "hsdp_1x2_bf16_transport": (4, ["--parallelism.data_parallel", "hsdp", "--parallelism.shard_degree", "2",
                                    "--training.mixed_precision_param", "bfloat16"]),  # auto: the transport
    # ... and with two micro-steps a step, whose reduce carries float32 sums: NCCL's reduce-scatter either way
    "fsdp_bf16_accum2": (2, ["--parallelism.data_parallel", "fsdp", "--training.mixed_precision_param", "bfloat16",
                             "--parallelism.fsdp_gradient_transport", "reduce_dtype", "--training.global_batch_size", "8"]),
    "fsdp_bf16_accum2_transport": (2, ["--parallelism.data_parallel", "fsdp", "--training.mixed_precision_param",
                                       "bfloat16", "--training.global_batch_size", "8"]),
    # every micro-step reduce-scatters into the shard (fsdp_accumulate=sharded): the same float32 sums, and with
    # bf16 compute each micro-step's bf16 gradients cross in the transport's all-to-all; hsdp's replicas (2 x 1:
    # no shard to scatter to) all-reduce once a step, the first micro-step's sums kept for it
    "fsdp_accum2_sharded": (2, ["--parallelism.data_parallel", "fsdp", "--training.global_batch_size", "8",
                                "--parallelism.fsdp_accumulate", "sharded"]),
    "hsdp_2x1_accum2_sharded": (2, ["--parallelism.data_parallel", "hsdp", "--parallelism.replicate_degree", "2",
                                    "--training.global_batch_size", "8", "--parallelism.fsdp_accumulate", "sharded"]),
    "fsdp_bf16_accum2_sharded": (2, ["--parallelism.data_parallel", "fsdp", "--training.mixed_precision_param",
                                     "bfloat16", "--training.global_batch_size", "8",
                                     "--parallelism.fsdp_accumulate", "sharded"]),
    "ddp_bf16_reduce": (4, ["--parallelism.data_parallel", "ddp", "--parallelism.ddp_reduce_dtype", "bfloat16"]),
    "ddp_bf16_params": (4, ["--parallelism.data_parallel", "ddp", "--training.mixed_precision_param", "bfloat16"]),
}
# bf16 gradients or bf16 compute: close to the reference, not equal
LOSSY = {"ddp_bf16_reduce", "ddp_bf16_params", "fsdp_bf16", "fsdp_bf16_transport", "hsdp_1x2_bf16_transport",
         "fsdp_bf16_accum2", "fsdp_bf16_accum2_transport", "fsdp_bf16_accum2_sharded"}


def _worker(rank: int, world: int, port: int, out_dir: str, runs: dict) -> None:
    with gloo_rank(rank, world, port, out_dir) as results:
        _runs(rank, out_dir, runs, results)


def _runs(rank: int, out_dir: str, runs: dict, results: dict) -> None:
    all_to_all = dist.all_to_all_single
    # FSDP's reduce-scatter: reduce_scatter_single from torch 2.13 on, reduce_scatter_tensor before
    scatter_names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    reduce_scatters = {n: getattr(dist, n) for n in scatter_names}
    for name, (local, extra) in runs.items():
        t = Trainer(load_config(base_args(os.path.join(out_dir, name), local, *extra)))
        calls = []  # the all-to-alls the run made (fsdp_gradient_transport=bfloat16: one per FSDP group a step)
        scatters = []  # and its reduce-scatters (FSDP's float32 one: one per FSDP group a reduce)
        dist.all_to_all_single = lambda *a, **k: (calls.append(1), all_to_all(*a, **k))[1]
        for n, f in reduce_scatters.items():
            setattr(dist, n, lambda *a, f=f, **k: (scatters.append(1), f(*a, **k))[1])
        try:
            t.train()
        finally:
            dist.all_to_all_single = all_to_all
            for n, f in reduce_scatters.items():
                setattr(dist, n, f)
        if rank == 0:
            params = list(t.model.parameters())
            full = sum(p.numel() for p in params)  # a DTensor shard counts as its whole tensor here
            local = lambda x: (x.to_local() if hasattr(x, "to_local") else x).numel()
            own_optimizer = getattr(t.optimizer, "optim", t.optimizer)  # zero1: the one stepping this rank's share
            results[name] = {"losses": step_losses(t), "mode": t.run_log.data["startup_info"]["config"]["data_parallel"],
                             "accum": t.grad_accum, "world": t.dims.world_size,
                             # what this rank holds, as a fraction of the model: parameters and AdamW state
                             "params_held": sum(local(p) for p in params) / full,
                             "state_held": sum(local(st["exp_avg"]) for st in own_optimizer.state.values()) / full,
                             "bf16_copies": bool(t.masters.copies),
                             "mesh": list(params[0].device_mesh.shape) if hasattr(params[0], "device_mesh") else None,
                             # the job's one mesh, built where the process group started: its dims, and
                             # the wrapper's collectives over it (DDP's group, FSDP's mesh)
                             "job_mesh": dict(zip(t.dims.mesh.mesh_dim_names, t.dims.mesh.shape)),
                             "dp": [t.dims.dp_size, t.dims.dp_rank],
                             "block_groups": block_groups(t.model),
                             "all_to_all": len(calls), "reduce_scatter": len(scatters),
                             "wrapper_on_job_mesh": (t.model.process_group is t.dims.mesh.get_group("dp_replicate")
                                                     if hasattr(t.model, "process_group")
                                                     else params[0].device_mesh == t.dims.mesh)}


def block_groups(model) -> list[list[str]] | None:
    """The transformer blocks of each FSDP group, in order (None when the model is not sharded)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not hasattr(model, "layers"):  # a DDP wrapper
        return None
    states = {}
    for name, block in model.layers.items():
        if not isinstance(block, FSDPModule):
            return None
        states.setdefault(id(fully_shard.state(block)), []).append(name)
    return list(states.values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process losses, local batch 8 x accumulation 1 (also builds the python_stdlib cache once)."""
    return run_single(tmp_path_factory.mktemp("single"), 8)


def test_reference_learns(reference):
    # guards the parity test against a degenerate run where nothing changes
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.05


def test_data_parallel_modes_match_single_process(reference, tmp_path):
    spawn(_worker, args=(2, free_port(), str(tmp_path), DIST_RUNS), nprocs=2)
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == set(DIST_RUNS)
    # each mode really ran as itself: what a rank holds of the parameters and the AdamW state, the mesh
    held = lambda name: (results[name]["params_held"], results[name]["state_held"])
    assert held("ddp") == (1.0, 1.0)  # replicas, each with all the state
    assert held("zero1")[0] == 1.0 and 0.3 < held("zero1")[1] < 0.7  # replicas, the state partitioned
    assert all(0.3 < x < 0.7 for x in held("fsdp")) and results["fsdp"]["mesh"] == [2]  # both sharded
    assert results["hsdp_2x1"]["mesh"] == [2, 1] and results["hsdp_1x2"]["mesh"] == [1, 2]
    assert results["ddp"]["job_mesh"] == results["zero1"]["job_mesh"] == {"dp_replicate": 2}
    assert results["fsdp"]["job_mesh"] == {"dp_shard": 2}
    assert results["hsdp_2x1"]["job_mesh"] == {"dp_replicate": 2, "dp_shard": 1}
    # the blocks' FSDP groups as set (the test model's four blocks: auto makes one group each)
    assert results["fsdp"]["block_groups"] == [["0"], ["1"], ["2"], ["3"]] and results["ddp"]["block_groups"] is None
    assert results["fsdp_groups2"]["block_groups"] == [["0"], ["1", "2"], ["3"]]
    assert results["fsdp_groups3_ac_reshard"]["block_groups"] == [["0"], ["1", "2", "3"]]
    for name, r in results.items():
        assert r["world"] == 2 and r["mode"] == DIST_RUNS[name][1][1]
        assert r["dp"] == [2, 0] and r["wrapper_on_job_mesh"], name
        assert r["accum"] == (2 if "accum" in name else 1)
        if name in LOSSY:
            continue
        assert r["losses"] == pytest.approx(reference, rel=1e-5), name
    # the bf16 all-reduce really ran (step 1's loss precedes any update; later ones move) and stays close
    bf16 = results["ddp_bf16_reduce"]["losses"]
    assert bf16[0] == pytest.approx(reference[0], rel=1e-6) and bf16[1:] != pytest.approx(reference[1:], rel=1e-6)
    assert bf16 == pytest.approx(reference, rel=2e-3)
    # bf16 compute under ddp (bf16 copies of fp32 masters, the default there): the master-weight optimizer,
    # and the single bf16 process's losses (test_master_linear.py holds the detailed checks)
    r = results["ddp_bf16_params"]
    assert r["bf16_copies"] and held("ddp_bf16_params") == (1.0, 1.0)  # replicas of fp32 masters with bf16 copies
    single = run_single(tmp_path / "single_bf16", 8, "--training.mixed_precision_param", "bfloat16")
    assert r["losses"][0] == pytest.approx(single[0], rel=1e-6) and r["losses"] == pytest.approx(single, rel=2e-3)
    # fsdp's bf16 gradients summed in float32 on their shard's owner: NCCL's float32 reduction exactly (a sum of
    # two, halved), through all-to-alls (one a group a step: the four blocks, the head, the root) instead
    fsdp, moved = results["fsdp_bf16"], results["fsdp_bf16_transport"]
    assert moved["losses"] == fsdp["losses"] and fsdp["losses"] == pytest.approx(single, rel=2e-3)
    assert fsdp["all_to_all"] == 0 and moved["all_to_all"] == 6 * STEPS
    # hsdp's shard groups reduce the same way (auto takes the transport with bf16 compute)
    hsdp = results["hsdp_1x2_bf16_transport"]
    assert hsdp["losses"] == fsdp["losses"] and hsdp["all_to_all"] == 6 * STEPS
    # accumulated gradients are float32 sums that bf16 would round: the transport leaves them to NCCL
    accum, accum_auto = results["fsdp_bf16_accum2"], results["fsdp_bf16_accum2_transport"]
    assert accum_auto["losses"] == accum["losses"] and accum_auto["all_to_all"] == accum["all_to_all"] == 0
    assert accum["losses"] == pytest.approx(single, rel=2e-3)
    assert results["fsdp"]["all_to_all"] == 0  # float32 compute: float32 gradients, NCCL's reduce-scatter
    # accumulated in the shard: each micro-step's bf16 gradients reduced as they come (twice the all-to-alls of a
    # step of one micro-step), the losses those of the accumulation that reduces its float32 sums once
    sharded = results["fsdp_bf16_accum2_sharded"]
    assert sharded["all_to_all"] == 2 * 6 * STEPS and sharded["losses"] == pytest.approx(accum["losses"], rel=1e-4)
    # float32: a reduce-scatter a group for each micro-step instead of each step (both match the reference above)
    assert results["fsdp_accum2"]["reduce_scatter"] == 6 * STEPS
    assert results["fsdp_accum2_sharded"]["reduce_scatter"] == 2 * 6 * STEPS


def test_two_accumulated_micro_batches_give_the_larger_batchs_losses(reference, tmp_path):
    """local 4 x accumulation 2 gives the same losses as local 8 x accumulation 1."""
    assert run_single(tmp_path, 4, "--training.global_batch_size", "8") == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("ac", [["full"], ["selective", "op"], ["selective", "2"]])
def test_activation_checkpointing_changes_no_loss(reference, tmp_path, ac):
    extra = ["--activation_checkpoint.mode", ac[0]] + (["--activation_checkpoint.selective_option", ac[1]]
                                                       if len(ac) > 1 else [])
    from titanlite.models.transformer import TransformerBlock

    t = Trainer(load_config(base_args(tmp_path, 8, *extra)))
    t.train()
    assert step_losses(t) == pytest.approx(reference, rel=1e-5)
    runs = {}  # block -> forwards started in one forward and backward: 2 where the backward recomputes it
    for name, wrapped in t.model.layers.named_children():
        block = next(m for m in wrapped.modules() if isinstance(m, TransformerBlock))
        block.register_forward_pre_hook(lambda *_, name=name: runs.__setitem__(name, runs.get(name, 0) + 1))
    tokens = torch.randint(0, t.model_args.vocab_size, (2, 16))
    t.step.forward_loss(tokens, tokens).backward()
    assert sorted(n for n, k in runs.items() if k == 2) == (["0", "2"] if ac[-1] == "2" else ["0", "1", "2", "3"])
    assert set(runs.values()) == {1, 2} if ac[-1] == "2" else set(runs.values()) == {2}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_initial_weights_do_not_depend_on_the_techniques_applied(name):
    """float8 (emulated), AC and compile wrap modules on meta; materialise + init still gives the
    very weights of the plain model (what makes the modes comparable), and ties stay tied."""
    from titanlite.config import parallel_settings
    from titanlite.models import build_model, get_model_args
    from titanlite.parallel.apply import parallelize
    from titanlite.parallel.dims import parallel_dims
    from titanlite.parallel.launcher_env import Launch

    def build(*extra):
        settings = parallel_settings(load_config(["--model.name", name, *extra]))
        with torch.device("meta"):
            model = build_model(get_model_args(name, "debug"), "sdpa", 32)
        return parallelize(model, settings, parallel_dims(settings.data_parallel, Launch(), torch.device("cpu"))).model

    def weights(model):  # canonical names: wrappers add _orig_mod / _checkpoint_wrapped_module
        strip = lambda n: n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        return {strip(n): p.detach() for n, p in model.named_parameters()}

    plain = weights(build())
    for extra in (["--activation_checkpoint.mode", "full"], ["--compile.enable"],
                  ["--float8.enable", "--float8.emulate", "--activation_checkpoint.mode", "selective",
                   "--compile.enable"]):
        got = weights(build(*extra))
        assert got.keys() == plain.keys(), extra
        for k in plain:
            assert torch.equal(got[k], plain[k]), (extra, k)
    model = build()
    if model.args.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight


def test_selective_op_policy_saves_matmuls_and_attention():
    """selective 'op' keeps bf16 and float8 matmul outputs and attention, recomputes the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    from titanlite.parallel.apply import save_matmuls_policy

    aten, policy = torch.ops.aten, save_matmuls_policy()
    for op in (aten.mm.default, aten._scaled_mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.mul.Tensor, aten.silu.default, aten.add.Tensor):
        assert policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


def test_selective_op_policy_saves_flash_attention_custom_ops():
    """flash-attn 2 and 3 register their forward as torch custom ops once imported; the policy built
    afterwards keeps their outputs (stand-ins registered under the packages' op names here)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from titanlite.parallel.apply import save_matmuls_policy

    for ns in ("flash_attn", "flash_attn_3"):
        if not hasattr(getattr(torch.ops, ns), "_flash_attn_forward"):
            torch.library.custom_op(f"{ns}::_flash_attn_forward", mutates_args=())(_attention_stand_in)
        assert save_matmuls_policy()(None, getattr(torch.ops, ns)._flash_attn_forward.default) \
            == CheckpointPolicy.MUST_SAVE, ns


def _attention_stand_in(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return q.clone()


def test_trainer_resolves_attention_for_its_sequence_length(tmp_path, monkeypatch):
    """auto's order can depend on the sequence length (titanlite.ops.attention.AUTO_ORDER): the trainer
    asks for its run's, and builds the model with the backend that comes back."""
    import titanlite.train as train_module

    asked = []

    def resolve(requested, device, seq_len=0):
        asked.append((requested, seq_len))
        return "manual"

    monkeypatch.setattr(train_module, "resolve_backend", resolve)
    trainer = Trainer(load_config(base_args(tmp_path, 2, "--training.seq_len", "48")))
    assert asked == [("auto", 48)]
    assert trainer.attention_backend == "manual"
    assert {type(b.attention.attn).__name__ for b in trainer.model.layers.values()} == {"Manual"}


def test_bad_selective_option_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="activation_checkpoint.selective_option"):
        Trainer(load_config(base_args(tmp_path, 4, "--activation_checkpoint.mode", "selective",
                                      "--activation_checkpoint.selective_option", "half")))


def test_hsdp_degrees_must_cover_the_world():
    from titanlite.config import parallel_settings
    from titanlite.parallel.launcher_env import Launch
    from titanlite.parallel.policy import hsdp_shape

    dp = lambda *args: parallel_settings(load_config(list(args))).data_parallel
    with pytest.raises(ConfigError, match=r"replicate_degree \(3\) x parallelism.shard_degree"):
        hsdp_shape(dp("--parallelism.replicate_degree", "3"), 4)
    assert hsdp_shape(dp("--parallelism.replicate_degree", "2"), 8) == (2, 4)
    assert hsdp_shape(dp("--parallelism.shard_degree", "2"), 8) == (4, 2)
    assert hsdp_shape(dp(), 8, ranks_per_host=4) == (2, 4)  # two nodes of 4: shard per node, replicate across
    assert hsdp_shape(dp(), 8) == (1, 8)  # the launcher does not say: one replica
    # the launcher's record reaches the check where the config loads (torchrun's LOCAL_WORLD_SIZE, read once)
    with pytest.raises(ConfigError, match=r"replicate_degree \(1\) x parallelism.shard_degree \(3\)"):
        load_config(["--parallelism.data_parallel", "hsdp"], Launch(world_size=4, ranks_per_host=3))
    load_config(["--parallelism.data_parallel", "hsdp"], Launch(world_size=4, ranks_per_host=2))


def test_the_job_has_one_mesh_with_named_dims():
    """parallel_dims lays the ranks out once, over the process group that is up, as the mode's named
    dimensions; ParallelDims answers the data-parallel size and rank from it (here rank 5 of 8 on a fake
    process group, two hosts of 4)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from titanlite.config import parallel_settings
    from titanlite.parallel.dims import parallel_dims
    from titanlite.parallel.launcher_env import Launch

    def dims(mode, rank=5, **launch):
        dp = parallel_settings(load_config(["--parallelism.data_parallel", mode])).data_parallel
        return parallel_dims(dp, Launch(**{"world_size": 8, "rank": rank, **launch}), torch.device("cpu"))

    assert dims("fsdp", 0, world_size=1).mesh is None and dims("fsdp", 0, world_size=1).dp_size == 1
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        hsdp = dims("hsdp", ranks_per_host=4)
        assert dict(zip(hsdp.mesh.mesh_dim_names, hsdp.mesh.shape)) == {"dp_replicate": 2, "dp_shard": 4}
        assert (hsdp.size("dp_replicate"), hsdp.size("dp_shard"), hsdp.dp_size, hsdp.dp_rank) == (2, 4, 8, 5)
        assert hsdp.mesh.get_group("dp_shard").size() == 4 and hsdp.ranks_per_host == 4
        for mode, dim in (("fsdp", "dp_shard"), ("ddp", "dp_replicate"), ("zero1", "dp_replicate")):
            d = dims(mode)
            assert d.mesh.mesh_dim_names == (dim,) and (d.size(dim), d.dp_size, d.dp_rank) == (8, 8, 5), mode
            assert d.size("dp_replicate" if dim == "dp_shard" else "dp_shard") == 1
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ float8
def test_float8_on_cpu_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"float8.enable needs a GPU .* float8.emulate=true"):
        Trainer(load_config(base_args(tmp_path, 4, "--float8.enable")))


def test_float8_filter_skips_output_and_odd_shapes():
    import torch.nn as nn

    from titanlite.parallel.apply import float8_eligible

    assert float8_eligible(nn.Linear(128, 384), "layers.0.feed_forward.w1")
    assert not float8_eligible(nn.Linear(128, 2048), "output")
    assert not float8_eligible(nn.Linear(128, 100), "layers.0.attention.wq")


@pytest.mark.parametrize("name,flavor", [("llama", "1.36B"), ("qwen3", "1.8B")])
def test_float8_weight_casts_benchmark_covers_what_float8_converts(name, flavor):
    """benchmarks/float8_weight_casts.py times the block linears (attention q, k, v, o and the SwiGLU),
    as the model arguments give them, and not the output layer."""
    import importlib.util

    from titanlite.models import get_model_args

    spec = importlib.util.spec_from_file_location("float8_weight_casts", ROOT / "benchmarks" / "float8_weight_casts.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = get_model_args(name, flavor)
    head_dim = args.head_dim or args.dim // args.n_heads
    q, kv = args.n_heads * head_dim, (args.n_kv_heads or args.n_heads) * head_dim
    block = [(q, args.dim), (kv, args.dim), (kv, args.dim), (args.dim, q),
             (args.ffn_dim, args.dim), (args.ffn_dim, args.dim), (args.dim, args.ffn_dim)]
    assert sorted(bench.float8_weight_shapes(name, flavor)) == sorted(block * args.n_layers)


def test_float8_emulated_converts_and_trains(tmp_path):
    """float8.emulate swaps the eligible linears for torchao's Float8Linear and still learns."""
    t = Trainer(load_config(base_args(tmp_path, 4, "--float8.enable", "--float8.emulate",
                                      "--training.steps", "3")))
    from torchao.float8.float8_linear import Float8Linear

    assert not isinstance(t.model.get_submodule("output"), Float8Linear)
    assert isinstance(t.model.get_submodule("layers.0.feed_forward.w1"), Float8Linear)
    t.train()
    losses = step_losses(t)
    assert all(map(torch.isfinite, torch.tensor(losses)))


@pytest.mark.parametrize("fast", [False, True])
def test_float8_backward_fast_accum_reaches_the_backward_gemms(tmp_path, fast):
    """float8.backward_fast_accum sets fast accumulation on the two backward GEMMs of every Float8Linear;
    the forward GEMM has it either way (torchao's default)."""
    t = Trainer(load_config(base_args(tmp_path, 4, "--float8.enable", "--float8.emulate",
                                      f"--float8.backward_fast_accum={str(fast).lower()}")))
    from torchao.float8.float8_linear import Float8Linear

    configs = [m.config for m in t.model.modules() if isinstance(m, Float8Linear)]
    assert configs and all(c.gemm_config_output.use_fast_accum for c in configs)
    assert all(c.gemm_config_grad_input.use_fast_accum == c.gemm_config_grad_weight.use_fast_accum == fast
               for c in configs)
    t.close()


def _fsdp_float8_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from titanlite.parallel.grads import local_tensor

    with gloo_rank(rank, world, port, out_dir) as results:
        for fused in ("true", "false"):
            t = Trainer(load_config(base_args(os.path.join(out_dir, fused), 4, "--parallelism.data_parallel", "fsdp",
                                              "--float8.enable", "--float8.emulate", "--optimizer.fused", fused,
                                              "--training.steps", "4")))
            held = []  # what the fused kernel is handed for each parameter and its state: type, address, aliasing
            for p in t.model.parameters():
                local = local_tensor(p)
                state = [local_tensor(v) for v in t.optimizer.state[p].values() if v.ndim]
                with torch.no_grad():  # a write through the plain tensor must reach the parameter
                    before = local.flatten()[:1].clone()
                    local.flatten()[:1] += 1
                    reaches = bool((local_tensor(p.detach()).flatten()[:1] != before).all())
                    local.flatten()[:1] -= 1
                held.append([type(local) is torch.Tensor and local.data_ptr() != 0, reaches,
                             all(type(x) is torch.Tensor and x.data_ptr() != 0 for x in state)])
            t.train()
            # the scales the post-step hook set for the next all-gather, against torchao's own precompute
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
            weights = [p for p in t.model.parameters() if hasattr(p._local_tensor, "_precomputed_scale")]
            ours = [p._local_tensor._precomputed_scale for p in weights]
            precompute_float8_dynamic_scale_for_fsdp(t.model)
            theirs = [p._local_tensor._precomputed_scale for p in weights]
            if rank == 0:
                results[fused] = {"held": held, "losses": step_losses(t), "optimizer": type(t.optimizer).__name__,
                                  "scales": [len(weights), all(a is not None and torch.equal(a, b)
                                                               for a, b in zip(ours, theirs))]}


def test_fsdp_float8_weights_reach_the_fused_update_as_plain_tensors(tmp_path):
    """Under FSDP's float8 all-gather torchao wraps each float8 weight in a tensor subclass that owns no
    storage (data_ptr() 0): the fused update kernel, which takes addresses, must get the tensor inside it,
    and writing there updates the parameter. The fused optimizer (its eager path here) then trains as
    torch's unfused AdamW does (to 1e-3: the two clip and update in different orders, and float8's
    rounding of the weights carries a last-bit difference on into the next step's loss). The scales set
    after each step for the next float8 all-gather are torchao's."""
    spawn(_fsdp_float8_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    r = json.load(open(tmp_path / "results.json"))
    assert r["true"]["optimizer"] == "MasterAdamW" and r["false"]["optimizer"] != "MasterAdamW"
    assert all(all(h) for h in r["true"]["held"]), r["true"]["held"]
    # titanlite's scale precompute (one all-reduce over plain shards) sets what torchao's would, every weight
    assert r["true"]["scales"][0] > 0 and r["true"]["scales"][1] and r["false"]["scales"][1]
    assert torch.allclose(torch.tensor(r["true"]["losses"]), torch.tensor(r["false"]["losses"]), rtol=1e-3)


def _ddp_release_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import titanlite.step as step_module

    with gloo_rank(rank, world, port, out_dir) as results:
        release = step_module.release_grads
        for local, name in ((4, "single"), (2, "accumulated")):  # global batch 8: one micro-step, or two
            t = Trainer(load_config(base_args(os.path.join(out_dir, name), local, "--parallelism.data_parallel", "ddp",
                                              "--training.steps", "3", "--training.global_batch_size", "8",
                                              "--training.mixed_precision_param", "bfloat16")))
            seen = []

            def recording(model, optimizer, masters=None, micro_steps=1):
                release(model, optimizer, masters, micro_steps)
                kept = [p for p in model.parameters() if p.grad is not None]
                seen.append({"rebuilt": model._has_rebuilt_buckets, "kept": len(kept),
                             "masters": sum(masters.has_copy(p) for p in model.parameters())})

            step_module.release_grads = recording
            try:
                t.train()
            finally:
                step_module.release_grads = release
            results[f"{name}{rank}"] = seen


def test_ddp_keeps_no_gradient_view_through_its_bucket_rebuild(tmp_path):
    """Under ddp the bf16 copies' fp32 masters keep their gradients as views of DDP's buckets between
    steps, except after the first of steps of one micro-step: DDP rebuilds its buckets in the second
    step's forward and frees the old ones first unless a gradient still views them, which would hold the
    gradients' size twice. Steps of several micro-steps keep them (their no_sync micro-steps would grow a
    gradient beside the buckets otherwise)."""
    spawn(_ddp_release_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = json.load(open(tmp_path / "results.json"))
    single, accumulated = results["single0"], results["accumulated0"]
    assert [s["rebuilt"] for s in single] == [s["rebuilt"] for s in accumulated] == [False, True, True]
    assert single[0]["kept"] == 0
    assert all(s["kept"] == s["masters"] > 0 for s in single[1:] + accumulated)


# ------------------------------------------------------------------------------------- CUDA graphs
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback: with a GPU the run captures")
def test_cuda_graphs_on_cpu_log_once_and_match_eager(reference, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        t = Trainer(load_config(base_args(tmp_path, 8, "--training.cuda_graphs", "--training.cuda_graphs_warmup",
                                          "2")))
        t.train()
    notes = [r.message for r in caplog.records if "cuda_graphs" in r.message]
    assert len(notes) == 1 and "unavailable" in notes[0] and "cpu" in notes[0]
    assert step_losses(t) == reference  # the very same eager computation


def test_forced_capture_failure_falls_back_cleanly(reference, tmp_path, caplog, monkeypatch):
    """Capture is attempted after warm-up; when it raises, the same batches run eagerly, once logged."""
    from titanlite.step import CudaGraphStep

    attempts = []

    def broken_capture(self, batches):
        attempts.append(len(batches))
        raise RuntimeError("forced capture failure\nsecond line")

    monkeypatch.setattr(CudaGraphStep, "available", staticmethod(lambda device: (True, "")))
    monkeypatch.setattr(CudaGraphStep, "_capture", broken_capture)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        t = Trainer(load_config(base_args(tmp_path, 8, "--training.cuda_graphs", "--training.cuda_graphs_warmup", "3")))
        t.train()
    notes = [r.message for r in caplog.records if "CUDA graph" in r.message]
    assert attempts == [1]  # one attempt, after 3 warm-up steps
    assert notes == ["CUDA graph capture failed (RuntimeError: forced capture failure); continuing without CUDA graphs"]
    assert step_losses(t) == pytest.approx(reference, rel=1e-5)
    # the log entry holding the capture step is warm-up, whatever the steady rule's cutoff
    its = t.run_log.data["training_iterations"]
    assert [e["iter"] for e in its if e.get("warmup")] == [4]
    assert 4 not in [e["iter"] for e in run_log.steady(its, warmup_steps=0).entries]


def test_cuda_graphs_refuse_fsdp_naming_why():
    from titanlite.config.manager import check_cuda_graphs
    from titanlite.parallel.modes import MODES

    graphs = lambda *extra: load_config(["--training.cuda_graphs", *extra])
    with pytest.raises(ConfigError, match="data_parallel=fsdp: FSDP2 allocates and frees"):
        check_cuda_graphs(graphs("--parallelism.data_parallel", "fsdp"), 2)
    with pytest.raises(ConfigError, match="zero1"):
        check_cuda_graphs(graphs("--parallelism.data_parallel", "zero1"), 2)
    check_cuda_graphs(graphs("--parallelism.data_parallel", "ddp"), 2)  # allowed
    with pytest.raises(ConfigError, match="ddp_reduce_dtype=bfloat16: the bf16 hook"):
        check_cuda_graphs(graphs("--parallelism.data_parallel", "ddp", "--parallelism.ddp_reduce_dtype", "bfloat16"), 2)
    with pytest.raises(ConfigError, match="on_nan=stop"):
        check_cuda_graphs(graphs("--training.on_nan", "skip"), 1)
    # run_train.sh's pre-flight check refuses them before torchrun: one line, exit 2, no worker traceback
    r = subprocess.run([sys.executable, "-m", "titanlite.config.check", "--world-size", "2", "--training.cuda_graphs",
                        "--parallelism.data_parallel", "fsdp"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: training.cuda_graphs with parallelism.data_parallel=fsdp: " + MODES["fsdp"].refuses["training.cuda_graphs"]]


def test_ddp_does_not_sync_buffers_every_forward_and_does_not_warn():
    """RoPE tables are the only buffers and never change, so DDP must not broadcast them before every
    forward; the switch is named differently on torch 2.11 and 2.13, and the old name warns on 2.13."""
    import warnings

    import torch.nn as nn

    from torch.distributed.device_mesh import init_device_mesh

    from titanlite.config import parallel_settings
    from titanlite.ops.master_linear import MasterWeights
    from titanlite.parallel.ddp import apply_ddp
    from titanlite.parallel.dims import ParallelDims

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.Linear(2, 2)
        model.register_buffer("table", torch.zeros(2))
        dims = ParallelDims("ddp", 0, 1, torch.device("cpu"), init_device_mesh("cpu", (1,), mesh_dim_names=("dp_replicate",)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ddp = apply_ddp(model, parallel_settings(load_config(["--parallelism.data_parallel", "ddp"])), dims,
                            MasterWeights())
        assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------- copy-engine all-gather
def _copy_engine_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("titanlite").addHandler(handler)
    logging.getLogger("titanlite").setLevel(logging.INFO)  # as titanlite.train's main sets it
    try:
        lines = {}
        for setting in ("on", "auto"):
            try:
                Trainer(load_config(base_args(os.path.join(out_dir, setting), 4, "--parallelism.data_parallel",
                                              "fsdp", "--parallelism.fsdp_copy_engine_all_gather", setting)))
                lines[setting] = [r.getMessage() for r in records if "fsdp_copy_engine_all_gather" in r.getMessage()]
            except ConfigError as e:
                lines[setting] = str(e)
    finally:
        logging.getLogger("titanlite").removeHandler(handler)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(lines, fh)
    dist.destroy_process_group()


def test_copy_engine_all_gather_refuses_what_cannot_use_it(tmp_path):
    """Only FSDP gathers parameters (ddp refused before torchrun, in one line); FSDP on gloo/CPU has no
    NCCL symmetric memory to gather into: `on` makes every rank say so instead of failing inside NCCL,
    `auto` (the default) trains with NCCL's ordinary gathers and the main rank says why, once."""
    r = subprocess.run([sys.executable, "-m", "titanlite.config.check", "--world-size", "2",
                        "--parallelism.data_parallel", "ddp", "--parallelism.fsdp_copy_engine_all_gather", "on"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: parallelism.fsdp_copy_engine_all_gather=on with parallelism.data_parallel=ddp: "
        "only fsdp and hsdp gather parameters"]
    spawn(_copy_engine_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    for rank in range(2):
        lines = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert lines["on"] == "parallelism.fsdp_copy_engine_all_gather=on needs CUDA GPUs and NCCL, not cpu with gloo"
        assert lines["auto"] == (["parallelism.fsdp_copy_engine_all_gather=auto: off: it needs CUDA GPUs and NCCL, "
                                  "not cpu with gloo"] if rank == 0 else [])


H100 = ("NVIDIA H100 80GB HBM3", 450.0)


@pytest.mark.parametrize("setting,refusal,shard,per_host,gpu,why", [
    ("auto", None, 8, 8, H100, "on"),                 # one 8-GPU node
    ("auto", None, 2, 8, H100, "on"),                 # hsdp: shards of 2 inside each node
    ("auto", None, 8, 8, ("NVIDIA B200", 900.0), "on"),
    ("auto", None, 16, 8, H100, "off: a gather group of 16 ranks spans hosts of 8"),  # fsdp over two nodes
    ("auto", None, 3, 4, H100, "off: a gather group of 3 ranks spans hosts of 4"),
    ("auto", None, 1, 8, H100, "off: a gather group of one rank gathers nothing"),    # hsdp, shard_degree 1
    ("auto", None, 8, None, H100, "off: the launcher does not say how many ranks share a host"),
    ("auto", None, 4, 4, ("NVIDIA H100 PCIe", 64.0), "off: NVIDIA H100 PCIe links at 64 GB/s"),
    ("auto", None, 4, 4, ("NVIDIA RTX 9000", None), "off: NVIDIA RTX 9000 is not in titanlite.hardware"),
    ("auto", "needs CUDA GPUs and NCCL, not cpu with gloo", 2, 2, ("cpu", None),
     "off: it needs CUDA GPUs and NCCL, not cpu with gloo"),
    ("on", None, 16, 8, ("NVIDIA H100 PCIe", 64.0), "on"),      # asked for: taken as asked
    ("off", None, 8, 8, H100, "off"),
])
def test_copy_engine_auto_takes_the_gathers_that_qualify(setting, refusal, shard, per_host, gpu, why):
    from titanlite.parallel.copy_engine import copy_engine_decision

    got, reason = copy_engine_decision(setting, refusal, shard, per_host, *gpu)
    assert got is (why == "on") and reason.startswith(why), reason


def test_copy_engine_on_refuses_where_it_cannot():
    from titanlite.parallel.copy_engine import copy_engine_decision, nccl_refusal

    assert nccl_refusal((2, 28, 9)) is None and nccl_refusal((2, 30, 0, "+cuda13")) is None
    old = nccl_refusal((2, 27, 3))
    assert old == "needs NCCL 2.28 or newer for copy-engine collectives; this torch runs 2.27.3"
    with pytest.raises(ConfigError, match=r"^parallelism\.fsdp_copy_engine_all_gather=on needs NCCL 2\.28"):
        copy_engine_decision("on", old, 2, 2, *H100)
    assert copy_engine_decision("auto", old, 2, 2, *H100) == (False, "off: it " + old)


def test_coordinate_descent_tuning_reaches_inductor(tmp_path, monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "coordinate_descent_tuning", False)  # restored after the test
    Trainer(load_config(base_args(tmp_path, 4, "--compile.enable", "--training.steps", "1"))).close()
    assert inductor_config.coordinate_descent_tuning is False
    Trainer(load_config(base_args(tmp_path, 4, "--compile.enable", "--compile.coordinate_descent_tuning",
                                  "--training.steps", "1"))).close()
    assert inductor_config.coordinate_descent_tuning is True
    with pytest.raises(ConfigError, match="coordinate_descent_tuning needs compile.enable"):
        Trainer(load_config(base_args(tmp_path, 4, "--compile.coordinate_descent_tuning")))


def test_fsdp_head_group_warning_of_torch_2_11_is_dropped_only_for_the_output():
    """torch 2.11 warns that the [norm, output] group's output layer ran no forward, which the chunked loss
    does by design: the warning naming that layer is dropped, any other (another module, other text) kept."""
    import logging

    import torch.nn as nn

    from torch.distributed.fsdp._fully_shard import _fsdp_state

    from titanlite.parallel.fsdp import quiet_head_group

    log = _fsdp_state.logger  # the logger FSDP warns through
    name = log.name
    out = nn.Linear(8, 32, bias=False)
    quiet_head_group(out)
    quiet_head_group(out)  # a second run in the process: one filter
    assert sum(type(f).__name__ == "_HeadRunsInsideTheLoss" for f in log.filters) == 1

    def kept(modules: str, text: str = "did not run forward before backward") -> bool:
        msg = (f"1 of the 2 modules passed to fully_shard {text}, which is error-prone. "
               f"Modules that did not run forward: [{modules}]")
        return log.filter(logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, None))

    assert not kept(repr(out))
    assert kept(repr(nn.Linear(8, 16, bias=False)))  # another layer
    assert kept(f"{out!r}, {nn.LayerNorm(8)!r}")  # more than the output
    assert kept(repr(out), "ran twice")  # another warning


def _owner_sum_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from titanlite.parallel.fsdp import OwnerSumReduceScatter

    with gloo_rank(rank, world, port, out_dir) as results:
        comm = OwnerSumReduceScatter(world, torch.float32)
        n = 1000  # this rank's shard; FSDP pads every reduce to a multiple of the ranks
        # FSDP asks for the input (every rank's pieces) and then the output (its shard), both in the reduce dtype
        pieces, shard = comm.allocate((world * n,), dtype=torch.float32, device="cpu"), comm.allocate(
            (n,), dtype=torch.float32, device="cpu")
        g = torch.Generator().manual_seed(rank)
        pieces.copy_(torch.randn(world * n, generator=g) * 10 ** torch.randint(-3, 4, (world * n,), generator=g))
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            comm(shard, pieces, None, op)
            scattered = torch.empty(n)  # the process group's float32 reduce-scatter of the same bf16 values
            dist.reduce_scatter_tensor(scattered, pieces.float(), op=dist.ReduceOp.SUM)
            if op == dist.ReduceOp.AVG:
                scattered /= world
            if rank == 0:
                results[str(op)] = {"dtypes": [str(pieces.dtype), str(shard.dtype)],
                                    "max_rel": ((shard - scattered).abs() / scattered.abs().clamp_min(1e-30)).max().item()}


def test_owner_sum_is_the_float32_reduce_scatter_at_half_the_bytes(tmp_path):
    """OwnerSumReduceScatter on 4 ranks: the input FSDP asks for comes back bf16 (the bytes that cross), the
    output float32, and the shard each rank sums is the float32 reduce-scatter of the same bf16 values up to
    the order of the additions (values spread over seven orders of magnitude)."""
    spawn(_owner_sum_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results) == 2
    for r in results.values():
        assert r["dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert r["max_rel"] < 1e-6


@pytest.mark.parametrize("setting,extra,device,shard,why", [
    ("auto", [], "cuda", 8, "bfloat16"),
    ("bfloat16", [], "cuda", 2, "bfloat16"),
    ("bfloat16", ["--training.mixed_precision_param", "bfloat16"], "cpu", 2, "bfloat16"),
    ("reduce_dtype", [], "cuda", 8, "reduce_dtype"),
    ("auto", [], "cpu", 8, "reduce_dtype: training.mixed_precision_param=auto gives float32 gradients on cpu"),
    ("auto", ["--training.mixed_precision_param", "float32"], "cuda", 8,
     "reduce_dtype: training.mixed_precision_param=float32 gives float32 gradients"),
    ("auto", ["--parallelism.fsdp_reduce_dtype", "bfloat16"], "cuda", 8,
     "reduce_dtype: parallelism.fsdp_reduce_dtype=bfloat16 already reduces bf16"),
    ("auto", [], "cuda", 1, "reduce_dtype: a shard group of one rank reduces nothing"),  # hsdp, shards of one
    ("bfloat16", [], "cuda", 1, "reduce_dtype: a shard group of one rank reduces nothing"),
])
def test_gradient_transport_takes_bf16_where_it_saves_bytes(setting, extra, device, shard, why):
    from titanlite.config import parallel_settings
    from titanlite.parallel.fsdp import gradient_transport

    cfg = load_config(["--parallelism.fsdp_gradient_transport", setting, *extra])
    use, reason = gradient_transport(parallel_settings(cfg), device, shard)
    assert use is (why == "bfloat16") and reason == why, reason


def test_fsdp_accumulate_auto_shards_where_the_sums_are_large_beside_the_gpu_and_sharded_needs_shards():
    """auto accumulates into the shard where the whole model's float32 sums would take more than 1/8 of the
    GPU's memory (an 8B model's 30 GiB; LLaMA 1.36B's 4.8 GiB and Qwen3 1.8B's 6.8 on neither an H100 nor an H200); never
    off CUDA; `sharded` with a mode that shards nothing is refused in one line."""
    from titanlite.models import get_model_args
    from titanlite.parallel.fsdp import ACCUMULATE_UNSHARDED_SHARE, accumulates_sharded

    h100, h200 = int(79.19 * 2**30), int(139.81 * 2**30)
    sums = {f: get_model_args(n, f).num_params() * 4 for n, f in (("llama", "1.36B"), ("qwen3", "1.8B"), ("llama", "8B"))}
    assert [accumulates_sharded("auto", b, m) for b in sums.values() for m in (h100, h200)] == [False] * 4 + [True] * 2
    assert accumulates_sharded("auto", 8 * 10**9, None) is False  # not on a GPU
    limit = int(ACCUMULATE_UNSHARDED_SHARE * h200)
    assert accumulates_sharded("auto", limit, h200) is False and accumulates_sharded("auto", limit + 1, h200) is True
    assert [accumulates_sharded(s, 1, h200) for s in ("sharded", "unsharded")] == [True, False]
    for mode in ("ddp", "zero1"):
        with pytest.raises(ConfigError, match=rf"^parallelism\.fsdp_accumulate=sharded with parallelism\.data_parallel="
                                              rf"{mode}: only fsdp and hsdp shard the gradients$"):
            load_config(["--parallelism.data_parallel", mode, "--parallelism.fsdp_accumulate", "sharded"])
    load_config(["--parallelism.data_parallel", "hsdp", "--parallelism.fsdp_accumulate", "sharded"])


def test_gradient_transport_bfloat16_refuses_where_it_cannot(tmp_path):
    """Asked for where there are no bf16 gradients to carry: one line before torchrun, exit 2 (on this
    machine without a GPU also for the default precision, which computes float32 here); at start-up, a
    ConfigError."""
    from titanlite.config import parallel_settings
    from titanlite.parallel.fsdp import gradient_transport

    for extra, why in ((["--parallelism.data_parallel", "ddp"], "parallelism.data_parallel=ddp reduces no FSDP gradients"),
                       (["--parallelism.fsdp_reduce_dtype", "bfloat16"],
                        "parallelism.fsdp_reduce_dtype=bfloat16 already reduces bf16"),
                       (["--training.mixed_precision_param", "float32"],
                        "training.mixed_precision_param=float32 gives float32 gradients"),
                       ([], "training.mixed_precision_param=auto gives float32 gradients on cpu")):
        r = subprocess.run([sys.executable, "-m", "titanlite.config.check", "--world-size", "2", *extra,
                            "--parallelism.fsdp_gradient_transport", "bfloat16"], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2 and r.stderr.strip().splitlines() == [
            f"error: parallelism.fsdp_gradient_transport=bfloat16: {why}; set it to auto or reduce_dtype"], r.stderr
    cfg = load_config(["--parallelism.fsdp_gradient_transport", "bfloat16"])
    with pytest.raises(ConfigError, match=r"^parallelism\.fsdp_gradient_transport=bfloat16: training\.mixed_precision_param=auto"):
        gradient_transport(parallel_settings(cfg), "cpu", 2)


def test_hsdp_replicas_all_reduce_what_the_bf16_transport_reduced(tmp_path):
    """hsdp over 4 ranks, 2 replicas x 2 shards, bf16 compute: each shard group reduces through the
    all-to-all and the float32 sum, then the replicas all-reduce the float32 shards; the same losses as
    NCCL's reduce-scatter in the shard groups (a sum of two, the same all-reduce after it)."""
    hsdp = ["--parallelism.data_parallel", "hsdp", "--parallelism.replicate_degree", "2",
            "--training.mixed_precision_param", "bfloat16", "--parallelism.fsdp_gradient_transport"]
    runs = {"nccl": (2, hsdp + ["reduce_dtype"]), "transport": (2, hsdp + ["bfloat16"])}
    spawn(_worker, args=(4, free_port(), str(tmp_path), runs), nprocs=4)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["transport"]["mesh"] == results["nccl"]["mesh"] == [2, 2]
    assert results["transport"]["losses"] == results["nccl"]["losses"]
    assert results["nccl"]["all_to_all"] == 0 and results["transport"]["all_to_all"] == 6 * STEPS


# The collectives titanlite itself calls (torch's own, inside DDP, FSDP, DCP or ZeroRedundancyOptimizer,
# take the groups those were built over and are not listed)
SPIED = ("all_reduce", "all_gather_object", "barrier", "broadcast", "all_gather_into_tensor", "all_to_all_single")


def _mesh_groups_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlite.ops.master_linear import MasterWeights
    from titanlite.optim import build_optimizer
    from titanlite.parallel.ddp import apply_ddp
    from titanlite.parallel.dims import ParallelDims
    from titanlite.config import parallel_settings

    with gloo_rank(rank, world, port, out_dir) as results:
        calls = []  # (caller "file:function" under titanlite/, the group object, its backend and ranks then)
        originals = {name: getattr(dist, name) for name in SPIED}

        def spy(name):
            def call(*args, group=None, **kwargs):
                caller = sys._getframe(1)
                path = os.path.relpath(caller.f_code.co_filename, ROOT)
                if path.startswith("titanlite"):  # a group may be gone by the end: what it was, at the call
                    calls.append((f"{path}:{caller.f_code.co_name}", group, None if group is None else
                                  (dist.get_backend(group), dist.get_process_group_ranks(group))))
                return originals[name](*args, group=group, **kwargs)
            return call

        for name in SPIED:
            setattr(dist, name, spy(name))
        try:
            # hsdp, 2 replicas x 2 shards: checkpoints (manager, preemption), validation, log steps' breakdowns
            t = Trainer(load_config(base_args(os.path.join(out_dir, "hsdp"), 2, "--parallelism.data_parallel", "hsdp",
                                              "--parallelism.replicate_degree", "2", "--training.steps", "4",
                                              "--checkpoint.enable", "--checkpoint.interval", "2",
                                              "--validation.enable", "--validation.freq", "2", "--validation.steps", "1")))
            t.train()
            dims = t.dims
            seen = {}
            for where, group, (backend, ranks) in ((w, g, b or (None, None)) for w, g, b in calls):
                kind = ("default" if group is None else "dp" if group is dims.dp_group else
                        "job, host-side" if backend == "gloo" and ranks == dims.ranks else "other")
                seen.setdefault(where, set()).add(kind if group is None else f"{kind} {ranks}")
            results[f"hsdp{rank}"] = {k: sorted(v) for k, v in seen.items()}
            results[f"mesh{rank}"] = {d: dist.get_process_group_ranks(dims.group(d)) for d in dims.mesh.mesh_dim_names}

            # zero1's optimizer over the replicate dimension of the same 2 x 2 mesh: DDP averages over that
            # group, and the AdamW state is sharded over the same two ranks, not over all four
            settings = parallel_settings(load_config(base_args(os.path.join(out_dir, "zero1"), 2,
                                                               "--parallelism.data_parallel", "zero1")))
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            zdims = ParallelDims("zero1", rank, world, torch.device("cpu"), mesh)
            torch.manual_seed(0)
            model = apply_ddp(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), settings, zdims,
                              MasterWeights())
            opt = build_optimizer(model, t.cfg, torch.device("cpu"), "zero1", group=zdims.group("dp_replicate"))
            torch.manual_seed(1 + rank)
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            local = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            replicas = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(replicas, flat)
            results[f"zero1_{rank}"] = {"ddp": dist.get_process_group_ranks(model.process_group),
                                        "optimizer": dist.get_process_group_ranks(opt.process_group),
                                        "held": local / sum(p.numel() for p in model.parameters()),
                                        "same_as": [r for r in range(world) if torch.equal(replicas[r], flat)]}
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def test_every_collective_takes_its_group_from_the_mesh(tmp_path):
    """hsdp on 4 CPU ranks, 2 replicas x 2 shards: the step's loss and validation averages run over the
    data-parallel ranks (the mesh's dimensions together), the checkpoint's agreements, the preemption flag
    and the log step's breakdown over the job's ranks on the host; no titanlite collective falls back to
    the default group; the copy-engine decision is agreed over the mesh's ranks. zero1 on the same mesh shards its AdamW state over the replicate dimension that
    its DDP averages over."""
    spawn(_mesh_groups_worker, args=(4, free_port(), str(tmp_path)), nprocs=4)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["mesh0"] == {"dp_replicate": [0, 2], "dp_shard": [0, 1]}
    every = "[0, 1, 2, 3]"
    assert results["hsdp0"] == {
        "titanlite/step.py:global_step_losses": [f"dp {every}"],
        "titanlite/step.py:validation_loss": [f"dp {every}"],
        # fsdp_copy_engine_all_gather=auto: every rank of the mesh agrees before building the gather groups
        "titanlite/parallel/copy_engine.py:gathers_on_copy_engines": [f"dp {every}"],
        "titanlite/checkpoint/manager.py:_barrier": [f"job, host-side {every}"],
        "titanlite/checkpoint/preemption.py:requested": [f"job, host-side {every}"],
        "titanlite/metrics/breakdown.py:gather_breakdown": [f"job, host-side {every}"],
        "titanlite/train.py:agree_on_config": [f"job, host-side {every}"],
    }
    assert results["zero1_0"] == {"ddp": [0, 2], "optimizer": [0, 2], "held": 0.5, "same_as": [0, 2]}


def test_local_tensor_reads_a_wrapper_types_layout_once(monkeypatch):
    """local_tensor runs for every parameter, gradient and moment at every optimizer step; torchao's float8
    weight's __tensor_flatten__ tests its scale tensor for truth, a host sync on a GPU each time. The
    inner tensor's attribute is found once per wrapper type, and every later call returns the same tensor."""
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from titanlite.parallel import grads

    calls = []
    flatten = WeightWithDynamicFloat8CastTensor.__tensor_flatten__
    monkeypatch.setattr(WeightWithDynamicFloat8CastTensor, "__tensor_flatten__",
                        lambda self: calls.append(1) or flatten(self))
    monkeypatch.setattr(grads, "_INNER", {})
    inner = [torch.randn(8, 4, dtype=torch.bfloat16) for _ in range(3)]
    weights = [WeightWithDynamicFloat8CastTensor(t, LinearMMConfig(), torch.float8_e4m3fn, torch.tensor(2.0))
               for t in inner]
    for _ in range(4):
        assert all(grads.local_tensor(w) is t for w, t in zip(weights, inner))
    assert len(calls) == 1
