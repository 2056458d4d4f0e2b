"""benchmarks/stream_profile.py's timeline arithmetic, on a hand-made trace (the script itself needs a GPU)."""
import importlib.util

import pytest

from conftest import ROOT

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
    assert r["busy"] == {"gemm": pytest.approx(16), "triton": pytest.approx(2)}
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
    assert (late["prev_kernel"], late["next_kernel"]) == ("triton:triton_poi_fused_add", "gemm:nvjet_sm90_gemm")
    assert late["ms"] == pytest.approx(8) and late["per_step"] * 0.001 == pytest.approx(1)  # once in the trace
    assert late["beside"] == {"nccl": pytest.approx(1)}
    assert early["ms"] == pytest.approx(5) and early["beside"] == {"nccl": pytest.approx(4), "memcpy": pytest.approx(3)}
    r["gaps"] = [late, early]
    assert "idle 8.00 ms (1000.0 a step) after triton:triton_poi_fused_add" in stream_profile.report(r, "t")


@pytest.mark.parametrize("name, cat", [
    ("ncclDevKernel_AllGather_RING_LL", "nccl"), ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "attention"),
    ("triton_red_fused__fused_rms_norm__to_copy_abs_max_0", "triton f8 cast"), ("triton_poi_fused_add_6", "triton"),
    ("nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN", "gemm"), ("_master_adamw_many_kernel", "optimizer (MasterAdamW)"),
    ("void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel", "fsdp copy"),
])
def test_kernel_categories(name, cat):
    assert stream_profile.category(name) == cat
