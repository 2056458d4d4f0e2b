"""Starting a job (titanlite.launch): a failed job's one line and exit code, out of memory included
(titanlite.errors.say_failure, the torchrun agent), and the memory check beside the ranks' start-up
(estimation.preflight, training.memory_fit)."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

from titanlite import launch
from titanlite.config import ConfigError, load_config
from titanlite.errors import FAILURE_EXIT
from titanlite.parallel.launcher_env import Launch

from conftest import ROOT, child_env

TINY = ["--training.dataset", "synthetic", "--training.seq_len", "32", "--validation.enable=false",
        "--metrics.progress_bar=false", "--data.num_workers", "0", "--parallelism.data_parallel", "ddp",
        "--metrics.log_freq", "1"]


def run_train(folder, *args, ngpu: int, env=None, timeout=300):
    """./run_train.sh from `folder` with NGPU processes, as installed (no pip)."""
    env = {**os.environ, "NGPU": str(ngpu), "TITANLITE_INSTALL": "0", **(env or {})}
    return subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, cwd=folder, env=env,
                          timeout=timeout)


def job_processes(marker: str) -> list[int]:
    """Processes whose command line holds `marker` (a test's own folder)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


# ------------------------------------------------------------------------------ a failure in one line
@pytest.mark.parametrize("ngpu", [1, 2])
def test_out_of_memory_ends_the_job_in_one_line(tmp_path, ngpu):
    """A planted CUDA out-of-memory error in step 2 on every rank: the job's output holds one line
    about it (not one per rank, no traceback, no torchrun report), naming the step, the peak and the
    device's capacity, what to lower (a command ready to paste) and the traceback file; exit code 4;
    each rank's full traceback is in the run folder."""
    r = run_train(tmp_path, *TINY, "--training.local_batch_size", "4", "--training.steps", "4",
                  "--debug.inject_oom_step", "2", "--job.dump_folder", "out", ngpu=ngpu)
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-3000:]
    said = [line for line in out.splitlines() if "out of memory" in line]
    assert len(said) == 1 and said[0] in r.stderr.splitlines(), out[-3000:]
    for noise in ("Traceback", "ChildFailedError", "exitcode", "OutOfMemoryError"):
        assert noise not in out, out[-3000:]
    rank = int(re.search(r" on rank (\d)", said[0]).group(1))
    assert re.fullmatch(
        rf"error: out of memory in step 2 on rank {rank}: peak \d+\.\d GiB of the host's \d+\.\d GiB, asking 1\.00 "
        rf"GiB more; lower it with --training\.local_batch_size 2 --training\.global_batch_size {4 * ngpu} \(the "
        rf"same global batch, accumulation 2\), or --activation_checkpoint\.mode selective, or a shorter "
        rf"training\.seq_len; traceback: out/oom_rank{rank}\.txt", said[0]), said[0]
    for k in range(ngpu):
        kept = (tmp_path / "out" / f"oom_rank{k}.txt").read_text()
        assert kept.startswith("Traceback (most recent call last)") and "in train_step" in kept
        assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB (planted by " \
               "debug.inject_oom_step=2)" in kept
    (log,) = (tmp_path / "out").glob("run_*[0-9].json")
    assert [e["iter"] for e in json.loads(log.read_text())["training_iterations"]] == [1]


def test_out_of_memory_is_found_behind_other_errors_and_the_advice_fits_the_run():
    """An error raised from an out-of-memory error (torch.compile's, for one) counts as one; what to
    lower keeps the global batch where the local batch can be halved, else names what is left."""
    from titanlite.train import out_of_memory, what_to_lower

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("compiled graph failed") from inner
    except RuntimeError as outer:
        assert out_of_memory(outer) is oom
    assert out_of_memory(RuntimeError("not memory")) is None
    cfg = load_config(["--training.local_batch_size", "6", "--training.global_batch_size", "24"])
    assert what_to_lower(cfg, 2) == ("lower it with --training.local_batch_size 3 --training.global_batch_size 24 (the "
                                     "same global batch, accumulation 4), or --activation_checkpoint.mode selective, or "
                                     "a shorter training.seq_len")
    cfg = load_config(["--training.local_batch_size", "1", "--activation_checkpoint.mode", "selective"])
    assert what_to_lower(cfg, 1) == "lower it with --activation_checkpoint.mode full, or a shorter training.seq_len"


def test_a_non_finite_loss_on_two_ranks_is_one_line_and_exit_3(tmp_path):
    """The documented exit code of a known failure holds under torchrun too (torchrun itself exits 1)."""
    r = run_train(tmp_path, *TINY, "--training.local_batch_size", "2", "--training.steps", "3", "--optimizer.lr",
                  "1e30", "--training.max_norm", "0", "--lr_scheduler.warmup_steps", "0", "--job.dump_folder", "out",
                  ngpu=2)
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    assert len([line for line in out.splitlines() if "non-finite" in line]) == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out and "exitcode" not in out


def test_the_job_ends_with_the_first_ranks_line_and_the_code_it_said(tmp_path, monkeypatch):
    """torchrun's failure record of each rank (its error file read by torch): the first to say a line
    gives the job's line and exit code, also where torchrun stopped that rank (SIGTERM: -15) after it
    said it; a rank that said nothing (killed, or a traceback) leaves torchrun's report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titanlite.errors import say_failure

    def failure(rank: int, exitcode: int, line: str | None, at: float) -> ProcessFailure:
        path = tmp_path / f"error_{rank}.json"
        if line:
            monkeypatch.setattr(time, "time", lambda: at)
            say_failure(line, 4, Launch(world_size=3, rank=rank, error_file=str(path)))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))

    e = ChildFailedError("titanlite.train", {0: failure(0, 4, "error: second", 20.5), 1: failure(1, -15, "error: first", 20.25),
                                             2: failure(2, -9, None, 0.0)})
    assert launch.first_line(e) == ("error: first", 4)
    assert launch.first_line(ChildFailedError("titanlite.train", {0: failure(3, 1, None, 0.0)})) is None

    # the same records read from this node's ranks' error files (Ranks.said): a rank that said nothing
    # (no file, or torchrun's own record without an exit code) is passed over
    (tmp_path / "error_5.json").write_text(json.dumps({"message": {"message": "a traceback"}, "timestamp": 1}))
    ranks = launch.Ranks()
    assert ranks.said() is None  # no ranks started
    # what started() records (without its signal handlers, which would stay in this process)
    ranks.context = types.SimpleNamespace(error_files={i: str(tmp_path / f"error_{i}.json") for i in (0, 1, 2, 5)})
    ranks.this_round = True
    assert ranks.said() == ("error: first", 4)
    ranks.this_round = False  # a restart's new rendezvous round: those ranks' lines are not its cause
    assert ranks.said() is None


@pytest.mark.parametrize("ranks_said,ran", [(("error: the job's ranks resolved different configurations: ...", 2), True),
                                            (None, True), (None, False)])
def test_a_node_that_loses_the_rendezvous_after_its_ranks_said_why_ends_with_their_line(ranks_said, ran, monkeypatch,
                                                                                        capsys):
    """Another node ended first and took the rendezvous' store along (its agent hosted it): this node's
    agent then fails to reach it, and the job's line is still the one this node's ranks said, with their
    exit code; where they said nothing, a line saying the store's node ended, exit 1; before any rank
    started, the rendezvous' own error."""
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    class Said(launch.Ranks):
        def __init__(self):
            super().__init__()
            self.context, self.this_round = (object(), True) if ran else (None, False)

        def said(self):
            return ranks_said

    def lost_store(_args):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    monkeypatch.setattr(launch, "Ranks", Said)
    monkeypatch.setattr(torch.distributed.run, "run", lost_store)
    usr1 = signal.getsignal(signal.SIGUSR1)
    try:
        code = launch.agent(["--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", "127.0.0.1:29999"], [])
    finally:  # what the agent leaves in its process, which here is pytest's
        signal.signal(signal.SIGUSR1, usr1)
        for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
            logging.getLogger(name).removeFilter(launch._quiet)
    lines = capsys.readouterr().err.strip().splitlines()
    if ranks_said:
        assert (lines, code) == ([ranks_said[0]], 2)
    elif ran:
        assert (lines, code) == (["error: rendezvous 127.0.0.1:29999: lost its store while this node's ranks ran "
                                  "(RendezvousConnectionError): the node holding it, the first to reach "
                                  "127.0.0.1:29999, ended or cannot be reached (its own output says why); this node's "
                                  "ranks were stopped"], FAILURE_EXIT)
    else:
        assert (lines, code) == (["error: rendezvous 127.0.0.1:29999: RendezvousConnectionError: The connection to the "
                                  "C10d store has failed."], FAILURE_EXIT)


# ------------------------------------------------------------------------------ the launcher's watch
JOB = """
import os, sys, time
args = sys.argv[2:]
open(sys.argv[1], "a").write(" ".join(args) + "\\n")
if "--training.local_batch_size" in args or "--quick" in args:  # restarted, or a quick job
    time.sleep(0.3)
elif "--until" in args:  # a second after the prediction's verdict
    while not os.path.exists(args[args.index("--until") + 1]):
        time.sleep(0.05)
    time.sleep(1.0)
else:
    time.sleep(60)
sys.exit(int(args[args.index("--exit") + 1]) if "--exit" in args and "--training.local_batch_size" not in args else 0)
"""


@pytest.fixture
def stub_job(monkeypatch, tmp_path):
    """The job as a stand-in process that records its arguments and runs 60 s, 0.3 s with --quick or
    once restarted with a local batch, or until the file after --until exists; it exits with --exit's
    code (0 once restarted)."""
    monkeypatch.setattr(launch, "train_command", lambda args: [sys.executable, "-c", JOB, str(tmp_path / "starts"),
                                                               *args])
    return lambda *args: launch.Job([], list(args))


def predicting(verdict: dict, after_s: float, then_touch=None) -> launch.Prediction:
    """A stand-in prediction printing `verdict` after `after_s` seconds (then creating `then_touch`)."""
    touch = f"; open({str(then_touch)!r}, 'w').close()" if then_touch else ""
    return launch.Prediction([sys.executable, "-c", f"import sys, time; time.sleep({after_s}); "
                                                    f"print({json.dumps(verdict)!r}); sys.stdout.flush(){touch}"])


def test_a_prediction_that_the_run_cannot_fit_stops_it(stub_job, tmp_path, capsys):
    job = stub_job("--x")
    started = time.monotonic()
    code = launch.supervise(job, predicting({"action": "stop", "line": "error: does not fit"}, 0.5), "check")
    assert code == 2 and time.monotonic() - started < 20
    assert job.proc.returncode == -9  # killed at once: no step of it fits
    assert capsys.readouterr().err.splitlines() == ["error: does not fit"]
    assert (tmp_path / "starts").read_text().splitlines() == ["--x"]


def test_adjust_starts_the_job_again_with_the_batch_that_fits(stub_job, tmp_path, capsys):
    job = stub_job("--x")
    verdict = {"action": "restart", "line": "memory check: starting again", "args": ["--training.local_batch_size", "2"]}
    assert launch.supervise(job, predicting(verdict, 0.5), "adjust") == 0
    assert (tmp_path / "starts").read_text().splitlines() == ["--x", "--x --training.local_batch_size 2"]
    assert capsys.readouterr().out.splitlines() == ["memory check: starting again"]


def test_a_job_that_ends_first_ends_the_prediction(stub_job):
    prediction = predicting({"action": "stop", "line": "error: too late"}, 60)
    assert launch.supervise(stub_job("--quick", "--exit", "5"), prediction, "check") == 5
    assert prediction.proc.returncode == -9


@pytest.mark.parametrize("mode, code, starts", [("adjust", 0, 2), ("check", 4, 1)])
def test_out_of_memory_before_the_prediction(stub_job, tmp_path, capsys, mode, code, starts):
    """adjust says it waits for the prediction (the ranks' out-of-memory line is not the job's end) and
    starts the job again at the batch that fits; check ends with the job's own out-of-memory line and code."""
    verdict = {"action": "restart", "line": "memory check: starting again", "args": ["--training.local_batch_size", "2"]}
    assert launch.supervise(stub_job("--quick", "--exit", "4"), predicting(verdict, 5.0), mode) == code
    assert len((tmp_path / "starts").read_text().splitlines()) == starts
    said = capsys.readouterr().out.splitlines()
    assert said == (["memory check: the ranks ran out of memory before the check's prediction; waiting for it "
                     "(training.memory_fit=adjust starts them again where it finds a batch that fits)",
                     "memory check: starting again"] if mode == "adjust" else [])


def test_a_run_that_fits_is_left_alone_and_says_its_peak(stub_job, tmp_path, capsys):
    job = stub_job("--until", str(tmp_path / "predicted"))
    prediction = predicting({"action": "none", "line": "memory check: fits"}, 0.0, then_touch=tmp_path / "predicted")
    assert launch.supervise(job, prediction, "check") == 0
    assert capsys.readouterr().out.splitlines() == ["memory check: fits"]
    assert job.proc.returncode == 0


# ------------------------------------------------------------------------------ what is predicted
DEBUG = ["--training.dataset", "synthetic", "--training.seq_len", "256", "--training.local_batch_size", "16"]
# usable memory of 0.14 GiB: the debug LLaMA's peak at local batch 16 (0.17 GiB) does not fit, 8's does
SMALL_GPU = ["--estimate.reserved_gib", "79.05"]


def preflight(argv: list[str], world: int = 1, nodes: int = 1) -> dict:
    from estimation.preflight import preflight as decide

    return decide(load_config(argv, Launch(world_size=world, ranks_per_host=world // nodes)), world, nodes, "h100",
                  "./run_train.sh", argv)


def tight_reserve(m: dict) -> list[str]:
    """estimate.reserved_gib that puts the peak of memory report `m` inside the allocator's headroom, not beyond it."""
    return ["--estimate.reserved_gib", repr(m["gpu_memory_gib"] - m["peak_gib"] * (1 + m["allocator_headroom"] / 2))]


def restarted(argv: list[str]) -> tuple[dict, dict]:
    """adjust's verdict on `argv`, a restart, and the memory report of the run it starts: that run's own
    prediction fits, clear of the allocator's headroom."""
    v = preflight(argv + ["--training.memory_fit", "adjust"])
    assert v["action"] == "restart", v
    again = predicted_peak(argv + v["args"])
    assert again["fits"] and not again["tight"], again
    return v, again


def predicted_peak(argv: list[str]) -> dict:
    from estimation.estimate import estimate

    cfg = load_config(argv + ["--estimate.search=false"])
    return estimate(cfg, progress=lambda _: None)["memory"]


@pytest.fixture
def configured_checkpointing(monkeypatch):
    """The batch search at the configured checkpointing alone: a larger micro-batch with more checkpointing
    is never predicted faster enough to take its place (the debug model's would be)."""
    import estimation.preflight

    monkeypatch.setattr(estimation.preflight, "AC_WORTH", float("inf"))


def test_the_check_of_a_run_that_fits_names_its_predicted_peak():
    v = preflight(DEBUG)
    m = predicted_peak(DEBUG)
    assert v["action"] == "none" and m["fits"]
    assert re.fullmatch(rf"memory check: llama/debug at local batch 16 on 1 x NVIDIA H100 80GB HBM3: predicted peak "
                        rf"{m['peak_gib']:.2f} GiB per GPU of 79\.2 GiB \(\d+ s\)", v["line"]), v["line"]


def test_check_refuses_in_one_line_naming_the_command_that_fits(configured_checkpointing):
    """The line names the predicted peak, the usable memory and the GPU's, and a command whose own
    prediction fits: the same options with the largest local batch that divides the global batch, and
    that command's own predicted peak (its accumulation's included)."""
    argv = DEBUG + SMALL_GPU + ["--training.steps", "7"]
    v = preflight(argv)
    m = predicted_peak(argv)
    assert v["action"] == "stop" and not m["fits"]
    command = v["line"].split(": ./run_train.sh ")[1].split()
    assert command == ["--training.dataset", "synthetic", "--training.seq_len", "256", *SMALL_GPU, "--training.steps", "7",
                       "--training.local_batch_size", "8", "--training.global_batch_size", "16"]  # the batch replaced
    fit = predicted_peak(command)
    assert fit["fits"]
    assert re.fullmatch(rf"error: llama/debug at local batch 16 needs a predicted {m['peak_gib']:.2f} GiB per GPU \(1 x "
                        rf"NVIDIA H100 80GB HBM3\), more than the 0\.14 GiB usable of the GPU's 79\.2 GiB; local batch 8 "
                        rf"x accumulation 2 fits \({fit['peak_gib']:.2f} GiB\) and keeps the global batch 16: "
                        rf"\./run_train\.sh .*", v["line"]), v["line"]


def test_the_batch_for_the_global_batch_fits_with_its_accumulation(configured_checkpointing):
    """A usable memory between local batch 8's peak without accumulation and its peak with it (the
    first micro-step's gradients held through the second): the search's probe at 8 fits, 8 x
    accumulation 2 does not, so the restart steps down to the next divisor of the global batch, 4 x 4,
    and names that run's own predicted peak."""
    alone = predicted_peak(DEBUG + ["--training.local_batch_size", "8"])
    accumulating = predicted_peak(DEBUG + ["--training.local_batch_size", "8", "--training.global_batch_size", "16"])
    assert alone["peak_gib"] < accumulating["peak_gib"]
    clear = (alone["peak_gib"] + accumulating["peak_gib"]) / 2  # the search's budget: usable / (1 + headroom)
    usable = clear * (1 + accumulating["allocator_headroom"])
    reserve = ["--estimate.reserved_gib", repr(accumulating["gpu_memory_gib"] - usable)]
    v, four = restarted(DEBUG + reserve)
    assert v["args"] == ["--training.local_batch_size", "4", "--training.global_batch_size", "16"]
    assert re.search(rf"; starting again at local batch 4 x accumulation 4, the largest that fits "
                     rf"\({four['peak_gib']:.2f} GiB\) and keeps the global batch 16 \(", v["line"]), v["line"]


def test_adjust_restarts_one_node_at_the_batch_that_fits_and_refuses_on_several(configured_checkpointing):
    argv = DEBUG + SMALL_GPU + ["--training.memory_fit", "adjust"]
    v = preflight(argv)
    assert v["action"] == "restart"
    assert v["args"] == ["--training.local_batch_size", "8", "--training.global_batch_size", "16"]
    assert re.search(r"; starting again at local batch 8 x accumulation 2, the largest that fits \(\d\.\d\d GiB\) and "
                     r"keeps the global batch 16 \(training\.memory_fit=adjust, \d+ s\)$", v["line"])
    v = preflight(argv, world=2, nodes=2)  # one launcher per node: a restart they do not agree on
    assert v["action"] == "stop" and "; local batch 8 x accumulation 2 fits (" in v["line"]
    assert ") and keeps the global batch 32: ./run_train.sh " in v["line"]
    assert "--training.memory_fit" not in v["line"]


def test_a_tight_run_is_warned_under_check_and_started_again_clear_of_the_headroom_under_adjust(configured_checkpointing):
    """A local batch whose peak fits only inside the allocator's headroom: check warns and lets it run;
    adjust starts again at the largest batch clear of the headroom that keeps the global batch, where
    that is at least half the configured one, and otherwise warns as check does."""
    tight = DEBUG + tight_reserve(predicted_peak(DEBUG))
    v = preflight(tight)
    assert v["action"] == "warn" and v["line"].startswith("warning: memory check: llama/debug at local batch 16 ")
    assert v["line"].endswith(", inside the allocator's 2% headroom: the steps may slow while it releases its "
                              "cache, or run out of memory")
    v, again = restarted(tight)
    assert v["args"] == ["--training.local_batch_size", "8", "--training.global_batch_size", "16"]
    assert re.search(rf"inside the allocator's 2% headroom; starting again at local batch 8 x accumulation 2, the "
                     rf"largest clear of it that keeps the global batch 16 \({again['peak_gib']:.2f} GiB; "
                     rf"training\.memory_fit=adjust, \d+ s\)$", v["line"]), v["line"]
    # a global batch of 17 (prime) with full checkpointing (no level above it): the only clear batch keeping it
    # is 1 x 17, not worth leaving a tight 17 for
    full17 = DEBUG + ["--training.local_batch_size", "17", "--activation_checkpoint.mode", "full"]
    m = predicted_peak(full17)
    reserve = tight_reserve(m)
    v = preflight(full17 + ["--training.memory_fit", "adjust"] + reserve)
    assert v["action"] == "warn" and "local batch 17 " in v["line"], v
    from estimation.estimate import estimate  # the clear batch it did not take: 1 x accumulation 17

    cfg = load_config(full17 + reserve + ["--training.global_batch_size", "17", "--estimate.max_local_batch", "17"])
    assert estimate(cfg, progress=lambda _: None)["batch_search"]["local_batch_for_global"] == 1


def test_a_tight_run_is_started_again_with_more_checkpointing_where_that_holds_half_its_batch_clear():
    """Without checkpointing, a tight local batch 17 (a prime global batch) is clear only at 1 x 17;
    selective checkpointing holds 17 itself clear, so adjust starts again with it (a larger micro-batch
    than the configured level's, which is not asked to be predicted faster than it)."""
    d17 = DEBUG + ["--training.local_batch_size", "17"]
    v, again = restarted(d17 + tight_reserve(predicted_peak(d17)))
    assert v["args"] == ["--activation_checkpoint.mode", "selective", "--training.local_batch_size", "17",
                         "--training.global_batch_size", "17"]
    assert re.search(rf"headroom; starting again with activation_checkpoint\.mode=selective at local batch 17 x "
                     rf"accumulation 1, the largest clear of it that keeps the global batch 17 \({again['peak_gib']:.2f} "
                     rf"GiB; training\.memory_fit=adjust, \d+ s\)$", v["line"]), v["line"]


def test_more_checkpointing_where_its_larger_micro_batch_is_predicted_faster(monkeypatch):
    """Local batch 16 does not fit: without checkpointing the global batch is kept at 8 x accumulation 2,
    with selective at 16 x 1. The second is taken where the estimate predicts it faster by more than
    AC_WORTH (check names it, adjust starts it, each with both predictions), the first where not."""
    import estimation.preflight
    from estimation.estimate import estimate

    def rate(extra: list[str]) -> int:
        cfg = load_config(DEBUG + SMALL_GPU + ["--estimate.search=false", "--training.global_batch_size", "16", *extra])
        return round(estimate(cfg, progress=lambda _: None)["throughput"]["overlap"]["tokens_per_sec_per_gpu"])

    ours = rate(["--activation_checkpoint.mode", "selective"])
    theirs = rate(["--training.local_batch_size", "8"])
    gain = ours / theirs - 1
    assert gain > 0.01, (ours, theirs)  # the debug model on one GPU: each micro-step's launches dominate
    v = preflight(DEBUG + SMALL_GPU)
    assert v["action"] == "stop"
    assert (f"; with activation_checkpoint.mode=selective, local batch 16 x accumulation 1 fits (" in v["line"]
            and f") and keeps the global batch 16, predicted faster than local batch 8 x accumulation 2 without "
                f"checkpointing: {ours:,} against {theirs:,} tokens/s per GPU: ./run_train.sh " in v["line"]), v["line"]
    assert v["line"].endswith(" --activation_checkpoint.mode selective --training.local_batch_size 16 "
                              "--training.global_batch_size 16"), v["line"]
    v = preflight(DEBUG + SMALL_GPU + ["--training.memory_fit", "adjust"])
    assert v["args"] == ["--activation_checkpoint.mode", "selective", "--training.local_batch_size", "16",
                         "--training.global_batch_size", "16"]
    monkeypatch.setattr(estimation.preflight, "AC_WORTH", gain * 1.01)  # just more than it gains: not worth it
    v = preflight(DEBUG + SMALL_GPU + ["--training.memory_fit", "adjust"])
    assert v["args"] == ["--training.local_batch_size", "8", "--training.global_batch_size", "16"], v
    assert "predicted faster" not in v["line"] and "activation_checkpoint" not in v["line"], v["line"]
    monkeypatch.setattr(estimation.preflight, "AC_WORTH", gain * 0.99)
    assert preflight(DEBUG + SMALL_GPU + ["--training.memory_fit", "adjust"])["args"][:2] == [
        "--activation_checkpoint.mode", "selective"]


@pytest.mark.parametrize("full_batch, expected", [(4, "full"), (2, "selective")])
def test_checkpointing_is_raised_level_by_level_while_a_larger_micro_batch_is_predicted_faster(
        monkeypatch, full_batch, expected):
    """Each level's search stubbed: none keeps the global batch 8 at 1 x 8, selective at 2 x 4, full at
    `full_batch`, each predicted faster than the one before. Full is taken only where its batch is larger
    than selective's (a batch as large, recomputing more, gains nothing), and the line compares the level
    taken with the configured one."""
    import estimation.preflight

    levels = {"none": (1, 1000), "selective": (2, 1100), "full": (full_batch, 1300)}

    def stub(cfg, progress=None):
        b, rate = levels[cfg.activation_checkpoint.mode]
        return {"memory": {"fits": False, "peak_gib": 99.0, "usable_gib": 50.0},
                "batch_search": {"local_batch_for_global": b, "gradient_accumulation_steps": 8 // b,
                                 "peak_gib_for_global": 40.0 + b, "tokens_per_sec_per_gpu_for_global": rate}}

    monkeypatch.setattr(estimation.preflight, "estimate", stub)
    v = preflight(DEBUG + ["--training.local_batch_size", "4", "--training.global_batch_size", "8",
                           "--training.memory_fit", "adjust"])
    b, rate = levels[expected]
    assert v["args"] == ["--activation_checkpoint.mode", expected, "--training.local_batch_size", str(b),
                         "--training.global_batch_size", "8"], v
    assert (f"starting again with activation_checkpoint.mode={expected} at local batch {b} x accumulation {8 // b}, "
            f"the largest that fits ({40 + b:.2f} GiB) and keeps the global batch 8, predicted faster than local batch "
            f"1 x accumulation 8 without checkpointing: {rate:,} against 1,000 tokens/s per GPU (") in v["line"], v["line"]


def test_a_run_that_fits_no_batch_is_refused_with_what_could():
    v = preflight(DEBUG + ["--estimate.reserved_gib", "79.19"])
    assert v["action"] == "stop" and "does not fit even at local batch 1: its model state alone" in v["line"]


# seq 2048, local batch 2 = the global batch: no batch keeps it without checkpointing or with selective,
# local 2 with full checkpointing does (the search's budget between their peaks)
LONG = ["--training.dataset", "synthetic", "--training.seq_len", "2048", "--training.local_batch_size", "2"]


def long_gpu() -> list[str]:
    full = predicted_peak(LONG + ["--activation_checkpoint.mode", "full"])
    selective_one = predicted_peak(LONG + ["--activation_checkpoint.mode", "selective", "--training.local_batch_size",
                                           "1", "--training.global_batch_size", "2"])
    assert full["peak_gib"] < selective_one["peak_gib"]
    clear = (full["peak_gib"] + selective_one["peak_gib"]) / 2
    return ["--estimate.reserved_gib", repr(full["gpu_memory_gib"] - clear * (1 + full["allocator_headroom"]))]


def test_adjust_raises_activation_checkpointing_where_no_batch_keeps_the_global_batch():
    """adjust starts again with the first stronger checkpointing at which a batch keeping the global batch
    fits (the same model trained: recomputation), and says why and what; that run's own prediction fits."""
    v, again = restarted(LONG + long_gpu())
    assert v["args"] == ["--activation_checkpoint.mode", "full", "--training.local_batch_size", "2",
                         "--training.global_batch_size", "2"]
    assert re.fullmatch(rf"memory check: llama/debug \(1 x h100\) does not fit even at local batch 1: peak "
                        rf"[\d.]+ GiB > [\d.]+ GiB usable of 79\.19 GiB; starting again with "
                        rf"activation_checkpoint\.mode=full at local batch 2 x accumulation 1, the largest that fits "
                        rf"\({again['peak_gib']:.2f} GiB\) and keeps the global batch 2 \(training\.memory_fit=adjust, "
                        rf"\d+ s\)", v["line"]), v["line"]


def test_check_names_the_checkpointing_that_fits_in_its_command():
    """check stops, naming the command that fits: the configured checkpointing (written here as
    --key=value) and batch options replaced."""
    argv = LONG + long_gpu() + ["--activation_checkpoint.mode=selective", "--training.steps", "3"]
    v = preflight(argv)
    assert v["action"] == "stop"
    head, command = v["line"].split(": ./run_train.sh ")
    assert head.endswith("; with activation_checkpoint.mode=full, local batch 2 x accumulation 1 fits ("
                         + head.split("fits (")[1].split(")")[0] + ") and keeps the global batch 2")
    assert command.split() == [*LONG[:4], *argv[len(LONG):len(LONG) + 2], "--training.steps", "3",
                               "--activation_checkpoint.mode", "full", "--training.local_batch_size", "2",
                               "--training.global_batch_size", "2"]


def test_a_run_no_checkpointing_fits_is_refused_naming_the_strongest_tried():
    """Not even local batch 1 with full checkpointing: the line says so, with that step's peak, and its
    advice no longer names checkpointing."""
    full = predicted_peak(LONG + ["--activation_checkpoint.mode", "full", "--training.local_batch_size", "1",
                                  "--training.global_batch_size", "2"])
    usable = full["peak_gib"] * 0.9
    v = preflight(LONG + ["--estimate.reserved_gib", repr(full["gpu_memory_gib"] - usable)])
    assert v["action"] == "stop"
    assert re.match(r"error: llama/debug \(1 x h100\) does not fit even at local batch 1 with "
                    r"activation_checkpoint\.mode=full: peak [\d.]+ GiB > [\d.]+ GiB usable of 79\.19 GiB; what "
                    r"could: ", v["line"]), v["line"]
    assert "activation_checkpoint" not in v["line"].split("what could:")[1]


def test_a_run_whose_strongest_checkpointing_fits_only_tight_is_refused_without_naming_it():
    """Local batch 1 fits with full checkpointing only inside the headroom, and not at all without it: the
    refusal says no batch is clear with any checkpointing (not the advice to use full, just tried)."""
    one = ["--training.local_batch_size", "1", "--training.global_batch_size", "2"]
    full = predicted_peak(LONG + ["--activation_checkpoint.mode", "full"] + one)
    v = preflight(LONG + tight_reserve(full) + ["--training.memory_fit", "adjust"])
    assert v["action"] == "stop"
    assert "does not fit even at local batch 1: " in v["line"] and "what could" not in v["line"], v["line"]
    assert v["line"].endswith("; no local batch is clear of the allocator's headroom with the accumulation that keeps "
                              "the global batch 2, with any activation checkpointing: try more GPUs with "
                              "--parallelism.data_parallel fsdp or a shorter --training.seq_len"), v["line"]


def test_the_check_lays_hsdp_out_on_the_jobs_nodes(monkeypatch):
    """hsdp on 4 GPUs: on 2 nodes of 2 (NGPU=2 on each) the ranks shard inside their node and replicate
    across (2 x 2), so each holds half the model state, not the quarter one node of 4 gives it; the
    prediction's fake run lays its mesh out the same way, and its peak is the larger."""
    import estimation.estimate
    from estimation.fake_run import FakeRun

    meshes, peaks = [], []

    class Recorded(FakeRun):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            meshes.append((self.dims.mesh.mesh_dim_names, tuple(self.dims.mesh.shape)))

        def step(self, *args, **kwargs):
            r = super().step(*args, **kwargs)
            peaks.append(r.peak_bytes)
            return r

    monkeypatch.setattr(estimation.estimate, "FakeRun", Recorded)
    peak = {}
    for nodes, shape in ((2, (2, 2)), (1, (1, 4))):
        v = preflight(DEBUG + ["--parallelism.data_parallel", "hsdp"], world=4, nodes=nodes)
        assert v["action"] == "none" and meshes == [(("dp_replicate", "dp_shard"), shape)], (v, meshes)
        assert len(peaks) == 1 and f"predicted peak {peaks[0] / 2**30:.2f} GiB per GPU" in v["line"], (v, peaks)
        peak[nodes] = peaks.pop()
        meshes.clear()
    assert peak[2] > peak[1], peak


def test_an_error_inside_the_prediction_stops_nothing(monkeypatch, capsys):
    """Only the estimate's answer that nothing fits stops the job: a ConfigError raised anywhere else
    inside the prediction is a prediction that failed, said in the line, and the job goes on."""
    import estimation.estimate
    from estimation.preflight import main

    def broken(*_args, **_kwargs):
        raise ConfigError("a planted failure inside the prediction")

    monkeypatch.setattr(estimation.estimate, "FakeRun", broken)
    main(["--world-size", "1", "--hardware", "h100", "--", *DEBUG])
    v = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert v == {"action": "none",
                 "line": "memory check: no prediction (ConfigError: a planted failure inside the prediction)"}


def test_a_failed_prediction_says_so_and_stops_nothing():
    r = subprocess.run([sys.executable, "-m", "estimation.preflight", "--world-size", "1", "--hardware", "nosuchgpu",
                        "--", *DEBUG], capture_output=True, text=True, cwd=ROOT, timeout=300)
    v = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 0 and v["action"] == "none" and v["line"].startswith("memory check: no prediction (")


# ------------------------------------------------------------------------------ run_train.sh, end to end
def fake_gpus(folder, n: int = 2) -> dict:
    """nvidia-smi naming `n` H100s: the launcher predicts for them; the ranks still train on the CPU."""
    (folder / "bin").mkdir()
    smi = folder / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in $(seq 1 %d); do\n  if [ \"$1\" = -L ]; then echo \"GPU $i: NVIDIA H100 80GB HBM3\"; "
                   "else echo 'NVIDIA H100 80GB HBM3, 9.0'; fi\ndone\n" % n)
    smi.chmod(0o755)
    return {"PATH": f"{folder / 'bin'}:{os.environ['PATH']}"}


def test_run_train_sh_refuses_a_run_predicted_not_to_fit(tmp_path):
    """Two ranks start on the CPU; the prediction beside them (two H100s as nvidia-smi names them,
    usable memory shrunk) stops them: one line, exit code 2, no rank left behind. The ranks mostly wait
    for their data (1 s a step), leaving the cores to the prediction they wait on."""
    r = run_train(tmp_path, *TINY, "--training.seq_len", "256", "--training.local_batch_size", "16",
                  "--training.steps", "1000", "--debug.inject_data_delay_ms", "1000", *SMALL_GPU,
                  "--job.dump_folder", str(tmp_path / "out"), ngpu=2, env=fake_gpus(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0] in r.stderr.splitlines(), out[-3000:]
    assert re.fullmatch(r"error: llama/debug at local batch 16 needs a predicted \d\.\d\d GiB per GPU \(2 x NVIDIA H100 "
                        r"80GB HBM3, ddp\), more than the 0\.14 GiB usable .*; with activation_checkpoint\.mode="
                        r"selective, local batch 16 x accumulation 1 fits \(\d\.\d\d GiB\) and keeps the global batch 32, "
                        r"predicted faster than local batch 8 x accumulation 2 without checkpointing: [\d,]+ against "
                        rf"[\d,]+ tokens/s per GPU: NGPU=2 {ROOT}/run_train\.sh .* --activation_checkpoint\.mode selective "
                        r"--training\.local_batch_size 16 --training\.global_batch_size 32", errors[0]), errors[0]
    assert "Traceback" not in out and "exitcode" not in out and "death signal" not in out
    assert job_processes(str(tmp_path)) == []


def test_run_train_sh_adjust_starts_again_at_the_batch_that_fits(tmp_path):
    """training.memory_fit=adjust, the ranks out of memory before the prediction comes (planted at
    step 1): the job starts again with selective checkpointing at local batch 16 (predicted faster than
    8 x accumulation 2 without), the global batch kept, and says so."""
    r = run_train(tmp_path, *TINY, "--training.seq_len", "256", "--training.local_batch_size", "16",
                  "--training.steps", "2", "--debug.inject_oom_step", "1", *SMALL_GPU, "--training.memory_fit",
                  "adjust", "--job.dump_folder", str(tmp_path / "out"), ngpu=2, env=fake_gpus(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 4, out[-3000:]  # the planted failure comes back in the second start
    (said,) = [line for line in r.stdout.splitlines() if "starting again" in line]
    assert "starting again with activation_checkpoint.mode=selective at local batch 16 x accumulation 1, the " \
           "largest that fits" in said, said
    assert " tokens/s per GPU (training.memory_fit=adjust" in said, said
    logs = sorted((tmp_path / "out").glob("run_*[0-9].json"))
    first, second = (json.loads(p.read_text())["startup_info"]["config"] for p in logs)
    assert (first["batch_size"], first["gradient_accumulation_steps"]) == (16, 1)
    assert (second["batch_size"], second["gradient_accumulation_steps"], second["global_batch_size"]) == (16, 1, 32)
    assert (first["activation_checkpoint.mode"], second["activation_checkpoint.mode"]) == ("none", "selective")


# ------------------------------------------------------------------------------ a rank that dies
def process_failure(tmp_path, monkeypatch, rank: int, exitcode: int, line: str | None = None, at: float = 0.0):
    """torchrun's record of a failed rank, with the line it said (its error file) where `line` is given."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from titanlite.errors import say_failure

    path = tmp_path / f"error_{rank}.json"
    if line:
        monkeypatch.setattr(time, "time", lambda: at)
        say_failure(line, 1, Launch(world_size=3, rank=rank, error_file=str(path)))
        monkeypatch.undo()
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_a_rank_killed_by_a_signal_is_the_jobs_cause(tmp_path, monkeypatch):
    """A rank killed by a signal is named in the job's line, with the signal and 128 + N, before the line
    another rank said about what it was doing (a save that lost its peer); without a signal, the first
    said line; else the rank that exited without one, with its code."""
    import signal
    import socket

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    f = lambda *a, **k: process_failure(tmp_path, monkeypatch, *a, **k)
    saving = f(0, 1, "error: checkpoint step-4 could not be saved: Connection reset by peer", 1.0)
    e = ChildFailedError("titanlite.train", {0: saving, 1: f(1, -signal.SIGKILL)})
    line, code = launch.job_line(e)
    assert code == 137 and line.startswith(f"error: rank 1 (local rank 1, pid 101 on {socket.gethostname()}) was "
                                           f"killed by SIGKILL (")
    assert "checkpoints saved before are kept" in line
    assert launch.job_line(ChildFailedError("titanlite.train", {0: saving, 2: f(2, 7)})) == (
        "error: checkpoint step-4 could not be saved: Connection reset by peer", 1)
    line, code = launch.job_line(ChildFailedError("titanlite.train", {2: f(2, 7)}))
    assert code == 7 and line.startswith("error: rank 2 (local rank 2, pid 102 on ") and "exited with code 7" in line
    # a rank torchrun stopped (SIGTERM) once another had said its failure is no cause
    oom = f(0, 4, "error: out of memory in step 2 on rank 0", 1.0)
    assert launch.job_line(ChildFailedError("titanlite.train", {0: oom, 1: f(1, -15)}), stopped={1}) == (
        "error: out of memory in step 2 on rank 0", 1)
    # a stop passed on to the ranks that ended them before training began
    line, code = launch.job_line(ChildFailedError("titanlite.train", {0: f(0, -15), 1: f(1, -15)}), signal.SIGTERM)
    assert (line, code) == ("SIGTERM: the ranks stopped before training began (nothing to save)", 143)


def rank_pids(launcher: int) -> list[int]:
    """The torchrun agent's ranks: the children of the launcher process, which runs the agent."""
    pids = []
    for task in os.listdir(f"/proc/{launcher}/task"):
        with open(f"/proc/{launcher}/task/{task}/children") as fh:
            pids += [int(p) for p in fh.read().split()]
    return sorted(pids)


def started_job(folder, *extra: str, ngpu: int) -> subprocess.Popen:
    """run_train.sh training until stopped, its first step logged when this returns."""
    env = child_env(NGPU=str(ngpu), TITANLITE_INSTALL="0")
    proc = subprocess.Popen([str(ROOT / "run_train.sh"), *TINY, "--training.local_batch_size", "2", "--training.steps",
                             "200", "--debug.inject_data_delay_ms", "200", "--checkpoint.enable", "--job.dump_folder",
                             "out", *extra], cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 240
    while True:
        logs = list((folder / "out").glob("run_*[0-9].json"))
        try:
            if logs and json.loads(logs[0].read_text())["training_iterations"]:
                return proc
        except ValueError:
            pass
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.3)


@pytest.mark.parametrize("ngpu", [1, 2])
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_clean_stop_exits_0_with_one_process_or_several(tmp_path, ngpu, signame):
    """SIGTERM or SIGINT to the launcher (run_train.sh's process): the ranks finish the step, save it and
    the job exits 0 whatever the number of processes."""
    import signal

    proc = started_job(tmp_path, ngpu=ngpu)
    proc.send_signal(getattr(signal, signame))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (out + err)[-3000:]
    step = int(re.search(rf"{signame}: stopped after step (\d+); checkpoint saved", out + err).group(1))
    assert (tmp_path / "out" / "checkpoint" / f"step-{step}" / "complete.json").exists()


def test_a_rank_killed_mid_run_is_named_with_its_signal(tmp_path):
    """kill -9 of rank 1 while the job saves a checkpoint every step: the job's one line names rank 1 and
    SIGKILL, exit 137, whatever rank 0 was doing; the checkpoints saved before stay complete."""
    import signal

    proc = started_job(tmp_path, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0", ngpu=2)
    deadline = time.time() + 120
    while not list((tmp_path / "out" / "checkpoint").glob("step-*/complete.json")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.2)
    rank1 = rank_pids(proc.pid)[1]
    os.kill(rank1, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    said = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 137, (out + err)[-3000:]
    assert len(said) == 1 and said[0].startswith(f"error: rank 1 (local rank 1, pid {rank1} on ") \
        and "killed by SIGKILL" in said[0], err[-3000:]
    assert list((tmp_path / "out" / "checkpoint").glob("step-*/complete.json"))


# ------------------------------------------------------------------------------ what the node has
def os_cores() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize("env,says", [
    (lambda tmp: {"NGPU": str(os_cores() + 1)},
     lambda: f"error: NGPU={os_cores() + 1} processes on a node without a GPU and {os_cores()} CPU core(s) for them: "
             f"each CPU rank needs a core of its own, NGPU={os_cores()} or less"),
    (lambda tmp: {"NGPU": "3", **fake_gpus(tmp, 2)},
     lambda: "error: NGPU=3 processes on a node where nvidia-smi lists 2 GPU(s): one process per GPU, NGPU=2 or less"),
    (lambda tmp: {"NGPU": "2", "CUDA_VISIBLE_DEVICES": "1", **fake_gpus(tmp, 2)},
     lambda: "error: NGPU=2 processes on a node where CUDA_VISIBLE_DEVICES leaves 1 GPU(s): one process per GPU, "
             "NGPU=1 or less"),
    (lambda tmp: {"NGPU": "2", "LOG_RANK": "7"},
     lambda: "error: LOG_RANK=7: this node runs local ranks 0-1 (NGPU=2), so 7 would show nothing"),
    (lambda tmp: {"NGPU": "1", "LOG_RANK": "0,1"},
     lambda: "error: LOG_RANK=0,1: this node runs local rank 0 (NGPU=1), so 1 would show nothing"),
    (lambda tmp: {"NGPU": "1", "LOG_RANK": "first"},
     lambda: "error: LOG_RANK must be local ranks separated by commas (0,1); got 'first'"),
    (lambda tmp: {"NGPU": "1", "TORCHRUN_ARGS": "--nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500"},
     lambda: "error: TORCHRUN_ARGS --nnodes 1:4: an elastic node count is not supported (the global batch, its "
             "accumulation and the checks before start-up are made for one world size); give one count, --nnodes 4"),
], ids=["more ranks than cores", "more ranks than GPUs", "more ranks than visible GPUs", "log rank outside",
        "log rank outside one process", "log rank not a number", "elastic nodes"])
def test_what_the_node_cannot_run_is_refused_in_one_line(tmp_path, env, says):
    """NGPU against the node's GPUs (or CPU cores), LOG_RANK against its local ranks, an elastic node
    count: one line, exit 2, before any process starts."""
    r = run_train(tmp_path, *TINY, "--job.dump_folder", "out", ngpu=1, env=env(tmp_path), timeout=120)
    assert (r.returncode, r.stderr) == (2, says() + "\n"), r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


def test_run_train_sh_prints_the_one_command_it_runs(tmp_path):
    """Its first line: the torchrun command of the job (with TORCHRUN_ARGS' fixed node count N:N read
    as N), or python -m titanlite.train for one process."""
    args = [*TINY, "--training.local_batch_size", "2", "--training.steps", "1", "--job.dump_folder", "out"]
    r = run_train(tmp_path, *args, ngpu=2, env={"LOG_RANK": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    config = f"--job.config_file {ROOT}/train_configs/debug_model.toml"
    assert r.stdout.splitlines()[0] == (f"torchrun --nproc_per_node=2 --standalone --role rank --tee 3 "
                                        f"--local-ranks-filter 1 -m titanlite.train {config} " + " ".join(args))
    assert "[rank0]:" not in r.stdout  # rank 0 logs the run; LOG_RANK=1 hides it
    r = run_train(tmp_path, *args, ngpu=1)
    assert r.returncode == 0 and r.stdout.splitlines()[0] == f"python -m titanlite.train {config} " + " ".join(args)
