"""benchmarks/stream_profile.py's timeline arithmetic, on hand-made traces (its live profile needs a GPU; --trace
reads traces written before)."""
import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import ROOT, child_env

spec = importlib.util.spec_from_file_location("stream_profile", ROOT / "benchmarks" / "stream_profile.py")
stream_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stream_profile)


def kernel(name, ts, dur, stream):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_idle_exposed_communication_and_overlap(monkeypatch):
    # compute stream 7: GEMM 0-10 us, idle 10-15, GEMM 15-20, Triton 20-22 (idle 0 there), idle 22-30, GEMM 30-31;
    # NCCL on stream 20 runs 8-14 and 25-26; a copy-engine memcpy on stream 24 runs 12-16.
    events = [kernel("nvjet_sm90_gemm", 0, 10, 7), kernel("nvjet_sm90_gemm", 15, 5, 7),
              kernel("triton_poi_fused_add", 20, 2, 7), kernel("nvjet_sm90_gemm", 30, 1, 7),
              kernel("ncclDevKernel_AllGather", 8, 6, 20), kernel("ncclDevKernel_ReduceScatter", 25, 1, 20),
              {"cat": "gpu_memcpy", "name": "Memcpy PtoP", "ts": 12, "dur": 4, "args": {"stream": 24}},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99}]
    r = stream_profile.analyse(events, steps=0.001)  # 1 step of 1 us -> figures in us
    assert r["stream"] == 7
    assert r["span"] == pytest.approx(31)
    assert r["busy"] == {"gemm bf16": pytest.approx(16), "triton": pytest.approx(2)}
    assert r["idle"] == pytest.approx(5 + 8)
    assert r["idle_during_comm"] == pytest.approx(5 + 1)  # 10-15 (NCCL, then the copy) and 25-26
    assert r["nccl_active"] == pytest.approx(7)
    assert r["copies_active"] == pytest.approx(4)
    assert r["compute_overlapping_comm"] == pytest.approx(2 + 1)  # the first GEMM's 8-10, the second's 15-16
    assert r["other_streams"][24] == {"memcpy": pytest.approx(4)}
    assert "idle 13.0 (while communication runs: 6.0)" in stream_profile.report(r, "t")
    # the idle stretches, longest first, each by its kernels either side and what ran beside it; with the
    # floor at 6 us (this trace's gaps are microseconds long) the 5-us one is left out
    monkeypatch.setattr(stream_profile, "GAP_FLOOR_US", 1)
    (late, early) = stream_profile.analyse(events, steps=0.001)["gaps"]
    monkeypatch.setattr(stream_profile, "GAP_FLOOR_US", 6)
    assert [g["ms"] for g in stream_profile.analyse(events, steps=0.001)["gaps"]] == [pytest.approx(8)]
    assert (late["prev_kernel"], late["next_kernel"]) == ("triton:triton_poi_fused_add", "gemm bf16:nvjet_sm90_gemm")
    assert late["ms"] == pytest.approx(8) and late["per_step"] * 0.001 == pytest.approx(1)  # once in the trace
    assert late["beside"] == {"nccl": pytest.approx(1)}
    assert early["ms"] == pytest.approx(5) and early["beside"] == {"nccl": pytest.approx(4), "memcpy": pytest.approx(3)}
    r["gaps"] = [late, early]
    assert "idle 8.00 ms (1000.0 a step) after triton:triton_poi_fused_add" in stream_profile.report(r, "t")


# kernel names as torch.profiler shows them on H100/H200 (cuBLAS, cuDNN, flash-attn, Inductor, NCCL, titanlite)
KERNELS = {
    "nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN": "gemm bf16",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas":
        "gemm bf16",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>": "gemm bf16",
    "triton_tem_fused_mm_0": "gemm bf16",  # an autotuned Triton GEMM template
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64_cublas": "gemm float8",  # _scaled_mm forward
    "sm90_xmma_gemm_e5m2bf16_e4m3f32_f32_tn_n_tilesize128x128x64_cublas": "gemm float8",  # _scaled_mm, gradients
    # torch 2.11's cuBLAS on H200 names float8 GEMMs by type letters: q e4m3, r e5m2 (t bf16, s fp32)
    "nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN": "gemm float8",  # forward, e4m3 x e4m3
    "nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT": "gemm float8",  # gradients, e4m3 x e5m2
    "nvjet_sm90_tss_192x192_64x3_1x2_h_bz_coopB_NTN": "gemm bf16",  # bf16 operands, fp32 output
    "nvjet_hsh_64x8_64x16_2x1_v_bz_TNT": "gemm bf16",  # an older cuBLAS's name, without the architecture
    "nvjet_sm90_reduce_splitk_kernel": "gemm bf16",  # a word after the architecture is no type letters
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0": "attention fwd",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0": "attention bwd",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>":
        "attention fwd",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention bwd",
    "void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<128>>": "attention bwd",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention fwd",
    "fmha_cutlassB_bf16_aligned_64x128_k128_sm80": "attention bwd",
    "void flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, cute::tuple<>>>": "attention fwd",
    "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__0": "attention bwd",
    "triton_tem_fused_flex_attention_0": "attention fwd",
    "triton_tem_fused_flex_attention_backward_1": "attention bwd",
    # Inductor's kernels carry the ops they fuse: a cast next to _scaled_mm or the attention op stays Triton
    "triton_per_fused__scaled_dot_product_cudnn_attention__to_copy_abs_max_1": "triton f8 cast",
    "triton_poi_fused__scaled_mm__to_copy_clamp_mul_reciprocal_t_view_4": "triton f8 cast",
    "triton_red_fused__fused_rms_norm__to_copy_abs_max_0": "triton f8 cast",
    "triton_poi_fused_add_6": "triton",
    "triton_red_fused__fused_rms_norm_0": "triton",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul>>":
        "elementwise (aten)",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>":
        "elementwise (aten)",
    "_master_adamw_kernel": "optimizer (MasterAdamW)",
    "_master_adamw_many_kernel": "optimizer (MasterAdamW)",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, 2>>": "foreach",
    "void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel<c10::BFloat16>": "fsdp copy",
    "void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<c10::BFloat16, c10::BFloat16>": "fsdp copy",
    "ncclDevKernel_AllGather_RING_LL": "nccl",
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "nccl",
    "Memcpy DtoD (Device -> Device)": "memcpy",
    "Memset (Device)": "memset",
    "some_custom_kernel": "other",
}


@pytest.mark.parametrize("name, cat", KERNELS.items())
def test_kernel_categories(name, cat):
    assert stream_profile.category(name) == cat


def test_every_category_is_listed_and_reached():
    assert set(KERNELS.values()) == set(stream_profile.CATEGORIES)


def test_step_table_splits_the_step_by_category_and_idle_time():
    """The per-step table: each category's ms with its share of the span and its longest kernel, then the idle
    time (while communication runs, otherwise); the rows add up to the span. The compute stream is the one
    with the most GEMM time, float8 GEMMs counted."""
    events, t = [], 0.0  # durations in us, one step: the figures are ms per step
    for name, dur in [("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64_cublas", 300),
                      ("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN", 200),
                      ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", 100),
                      ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7", 150),
                      ("triton_poi_fused__scaled_mm__to_copy_clamp_mul_reciprocal_t_view_4", 50),
                      ("_master_adamw_many_kernel", 20)]:
        events.append(kernel(name, t, dur, 7))
        t += dur + 10  # 10 us idle between kernels: 50 us in all (none after the last)
    events.append(kernel("ncclDevKernel_AllGather_RING_LL", 0, 1000, 20))  # beside every idle stretch
    events.append(kernel("nvjet_sm90_tst_small", 0, 5, 21))  # a stream with less GEMM time is not the compute one
    r = stream_profile.analyse(events, steps=1)
    assert r["stream"] == 7 and r["span"] == pytest.approx(870 / 1000)
    rows = {c[0]: c for c in (ln.strip("| ").split(" | ") for ln in stream_profile.step_table(r).splitlines()[2:])}
    assert list(rows) == ["gemm bf16", "gemm float8", "attention fwd", "attention bwd", "triton f8 cast",
                          "optimizer (MasterAdamW)", "idle while communication runs", "idle otherwise",
                          "step (the stream's span)"]
    assert float(rows["gemm float8"][1]) == pytest.approx(0.3) and float(rows["gemm float8"][2]) == pytest.approx(34.5, abs=0.05)
    assert rows["attention bwd"][3].startswith("cudnn_generated_fort_native_sdpa_sm90_flash_bprop")
    assert float(rows["idle while communication runs"][1]) == pytest.approx(0.05)
    assert float(rows["idle otherwise"][1]) == pytest.approx(0.0)
    assert sum(float(c[1]) for k, c in rows.items() if k != "step (the stream's span)") == pytest.approx(0.87)
    assert stream_profile.step_table(r) in stream_profile.report(r, "t")


def test_own_options_come_before_the_training_options(capsys):
    opts, rest = stream_profile.own_options(["--ngpus", "4", "--out=/o", "--timeout", "150", "--model.flavor", "8B"])
    assert opts == {**stream_profile.OWN, "--ngpus": 4, "--out": "/o", "--timeout": 150} and rest == ["--model.flavor", "8B"]
    opts, rest = stream_profile.own_options(["--trace", "a.json", "--trace=b.json", "--steps", "3"])
    assert (opts["--trace"], opts["--steps"], rest) == (("a.json", "b.json"), 3, [])
    assert stream_profile.own_options(["--compile.enable"]) == (stream_profile.OWN, ["--compile.enable"])
    with pytest.raises(SystemExit) as e:
        stream_profile.own_options(["--timeout", "0"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == "stream_profile: --timeout takes a positive integer"


def trace_file(path, kernels, marks, bare=False):
    """A Chrome trace as torch.profiler writes it: `kernels` (name, start us, duration us) on stream 7, and
    `marks` ProfilerStep marks on the host, each with its twin on the GPU (which must not count twice).
    `bare`: the events as a plain list, the kernels without their args (streams unknown)."""
    events = [kernel(n, ts, dur, 7) for n, ts, dur in kernels]
    if bare:
        events = [{k: v for k, v in e.items() if k != "args"} for e in events]
    for i in range(marks):
        events += [{"cat": "user_annotation", "name": f"ProfilerStep#{i + 11}", "ts": 0, "dur": 1},
                   {"cat": "gpu_user_annotation", "name": f"ProfilerStep#{i + 11}", "ts": 0, "dur": 1}]
    path.write_text(json.dumps(events if bare else {"traceEvents": events}))
    return str(path)


def test_traces_written_before_are_read_per_step_and_side_by_side(tmp_path, capsys):
    """--trace: a trace's steps are its host ProfilerStep marks (else --steps); figures are ms per step; two
    traces meet kernel by kernel, Inductor's numbering of a fused kernel left out."""
    (tmp_path / "peer").mkdir(), (tmp_path / "ours").mkdir()
    peer = trace_file(tmp_path / "peer" / "rank0.json", [("nvjet_sm90_tst_192x192", 0, 4000),
                                                         ("triton_poi_fused_add_3", 4000, 1000),
                                                         ("nvjet_sm90_tst_192x192", 5000, 4000)], marks=2)
    ours = trace_file(tmp_path / "ours" / "rank0.json", [("nvjet_sm90_tst_192x192", 0, 9000),
                                                         ("triton_poi_fused_add_7", 9000, 600),
                                                         ("_master_adamw_many_kernel", 9600, 300)], marks=0, bare=True)
    assert stream_profile.read_traces([peer, ours], steps=3, out=str(tmp_path / "o")) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    side = lines[next(i for i, ln in enumerate(lines) if ln.startswith("| kernel | category")):]
    table = [ln.strip("| ").split(" | ") for ln in side if ln.startswith("| ")]
    assert table[0] == ["kernel", "category", "peer/rank0.json", "ours/rank0.json"]  # the files' shortest own names
    rows = {c[0]: c[2:] for c in table[1:]}
    assert list(rows) == ["nvjet_sm90_tst_192x192", "triton_poi_fused_add", "_master_adamw_many_kernel",
                          "compute-stream kernels"]                # longest first
    assert rows["nvjet_sm90_tst_192x192"] == ["4.00", "3.00"]      # 8 ms over 2 marked steps; 9 ms over --steps 3
    assert rows["triton_poi_fused_add"] == ["0.50", "0.20"]       # _3 and _7: the same kernel
    assert rows["_master_adamw_many_kernel"] == ["-", "0.10"]
    assert rows["compute-stream kernels"] == ["4.50", "3.30"]
    assert f"{peer}: 2 steps" in text and f"{ours}: 3 steps" in text
    written = (tmp_path / "o" / "stream_profile.md").read_text()
    assert written.startswith(f"stream_profile.py --steps 3 --trace {peer} --trace {ours}\n")
    assert written.count("| compute-stream kernels |") == 1


def test_a_trace_without_steps_or_kernels_is_refused_in_one_line(tmp_path, capsys):
    bare = trace_file(tmp_path / "bare.json", [("nvjet_sm90_tst", 0, 10)], marks=0)
    assert stream_profile.read_traces([bare]) == 2
    assert capsys.readouterr().err.strip() == (f"stream_profile: {bare} has no ProfilerStep marks: give --steps N, "
                                              "the steps it holds")
    host_only = tmp_path / "cpu.json"
    host_only.write_text(json.dumps([{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]))
    assert stream_profile.read_traces([str(host_only)], steps=1) == 2
    assert "holds no GPU kernels" in capsys.readouterr().err
    assert stream_profile.read_traces([str(tmp_path / "none.json")], steps=1) == 2
    assert capsys.readouterr().err.startswith(f"stream_profile: cannot read the trace {tmp_path / 'none.json'}: ")
    for i, body in enumerate(['{"traceEvents": null}', "3", "[1, 2]"]):
        odd = tmp_path / f"odd{i}.json"
        odd.write_text(body)
        assert stream_profile.read_traces([str(odd)], steps=1) == 2
        assert capsys.readouterr().err.strip() == (f"stream_profile: {odd} is not a Chrome trace (a list of events, "
                                                  "or an object with traceEvents)")


@pytest.mark.parametrize("argv, line", [
    (["--trace", "t.json", "--model.flavor", "8B"],
     "stream_profile: --trace reads traces written before: it takes no training options, --ngpus or --timeout "
     "(got --model.flavor)"),
    (["--ngpus", "2", "--trace", "t.json"],
     "stream_profile: --trace reads traces written before: it takes no training options, --ngpus or --timeout "
     "(got --ngpus)"),
    (["--trace"], "stream_profile: --trace takes a path"),
    (["--steps", "2", "--model.flavor", "8B"],
     "stream_profile: --steps counts the steps of a --trace file without ProfilerStep marks")])
def test_trace_options_out_of_place_are_one_line(argv, line):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream_profile.py"), *argv],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == line


def test_a_trace_is_read_from_the_command_line(tmp_path):
    """The whole --trace path through main(), as a user runs it on a machine without a GPU."""
    path = trace_file(tmp_path / "rank0.json", [("nvjet_sm90_tst_192x192", 0, 3000)], marks=0)
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream_profile.py"), "--steps", "3", "--trace", path],
                       capture_output=True, text=True, env=child_env(), timeout=60)
    assert r.returncode == 0 and r.stderr == ""
    assert f"== {path}: 3 steps" in r.stdout and "| gemm bf16 | 1.00 | 100.0 | nvjet_sm90_tst_192x192 (1.00) |" in r.stdout


def test_a_gzipped_trace_reads_as_the_plain_one(tmp_path, capsys):
    """torch's TensorBoard handler writes .json.gz: launch.trace_events opens it as it opens .json."""
    import gzip

    plain = trace_file(tmp_path / "rank0.json", [("nvjet_sm90_tst_192x192", 0, 3000)], marks=1)
    packed = tmp_path / "rank0.json.gz"
    with gzip.open(packed, "wt") as fh:
        fh.write((tmp_path / "rank0.json").read_text())
    assert stream_profile.read_traces([plain]) == 0
    first = capsys.readouterr().out.replace(plain, "T")
    assert stream_profile.read_traces([str(packed)]) == 0
    assert capsys.readouterr().out.replace(str(packed), "T") == first
