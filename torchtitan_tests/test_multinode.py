"""Two torchrun invocations, one per "node", meet through the c10d rendezvous on localhost and train
together (gloo, FSDP); their losses match a single process training on the same global batch. The same
two nodes started by the SLURM batch script (scripts/slurm/train.sbatch) through stand-in `srun` and
`scontrol` commands. A checkpoint of the two nodes resumed by one process, and one of one process
resumed by the two nodes, with every sample id counted across the change."""

import json
import os
import re
import subprocess
import sys

import pytest

from titanlite.config import load_config
from titanlite.train import Trainer

from conftest import ROOT, child_env, free_port


def args(folder, local_batch):
    return ["--training.dataset", "python_stdlib", "--training.steps", "4", "--training.seq_len", "32",
            "--training.local_batch_size", str(local_batch), "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--validation.enable=false",
            "--metrics.progress_bar=false", "--data.num_workers", "0", "--parallelism.data_parallel", "fsdp",
            "--job.dump_folder", str(folder)]


def single_process_losses(folder, *before: str) -> list[float]:
    single = Trainer(load_config([*before, *args(folder, 4)]))
    single.train()
    single.close()
    return [v for e in single.run_log.data["training_iterations"] for v in e["step_losses"]]


def assert_one_job(folder, expected) -> None:
    """One run log (global rank 0 writes it), of a world of 2 in fsdp, with the single process's losses."""
    (log_path,) = folder.glob("run_*.json")
    log = json.loads(log_path.read_text())
    assert log["startup_info"]["config"]["world_size"] == 2
    assert log["startup_info"]["config"]["data_parallel"] == "fsdp"
    got = [v for e in log["training_iterations"] for v in e["step_losses"]]
    assert got == pytest.approx(expected, rel=1e-5)


ENV = child_env()


def two_nodes(*target: str, env: dict | None = None) -> str:
    """Two torchrun agents of one process each, meeting through c10d on localhost, running `target`
    (-m module or a script and its arguments); their output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "titanlite-test",
           *target]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outputs = []
    for p in nodes:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            pytest.fail("torchrun nodes did not finish within 300 s")
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outputs)
    return "\n".join(outputs)


def test_two_torchrun_nodes_match_single_process(tmp_cache):
    expected = single_process_losses(tmp_cache / "single")
    two_nodes("-m", "titanlite.train", *args(tmp_cache / "multi", 2))
    assert_one_job(tmp_cache / "multi", expected)


# --------------------------------------------------------------------- resume with another world size
SEQ, STEPS = 8, 8
# titanlite.train with each rank's micro-batches recorded: the first token of every row, which in the
# arange corpus below is the start of its window, so it names the sample. One JSON line per micro-batch.
RECORDING = """\
import json, os, sys
sys.path.insert(0, {root!r})
from titanlite import train
from titanlite.config import run_cli

fetch = train.Trainer.next_batch


def next_batch(self, micro=0):
    inputs, labels = fetch(self, micro)
    with open(os.environ["SAMPLES"] + "." + os.environ.get("RANK", "0"), "a") as fh:
        fh.write(json.dumps({{"step": self.state.step + 1, "rank": self.dims.rank, "micro": micro,
                              "starts": inputs[:, 0].tolist()}}) + "\\n")
    return inputs, labels


train.Trainer.next_batch = next_batch
run_cli(train.main)
"""


@pytest.fixture(scope="module")
def arange_corpus(tmp_path_factory):
    """2047 tokens 0, 1, ... in one shard (the debug model's vocabulary): window j starts at token 8j."""
    import numpy as np

    from titanlite.data.shards import ShardWriter

    folder = tmp_path_factory.mktemp("data") / "arange"
    with ShardWriter(folder, vocab_size=2048, shard_tokens=4096) as w:
        w.add("train", np.arange(2047))
        w.add("val", np.arange(1000))
        w.commit({"vocab_size": 2048, "eos_id": 0, "tokenizer": {"file": "tokenizer.json", "sha256": "arange"}})
    return folder


def resume_args(corpus, folder, *extra: str) -> list[str]:
    """Global batch 4 (2 ranks x 2, or 1 rank x 2 x 2 accumulation), a checkpoint every 4 steps."""
    return ["--training.dataset", "prepared", "--training.dataset_path", str(corpus), "--training.seq_len", str(SEQ),
            "--training.local_batch_size", "2", "--training.global_batch_size", "4", "--training.steps", str(STEPS),
            "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
            "--validation.enable=false", "--metrics.progress_bar=false", "--data.num_workers", "0",
            "--parallelism.data_parallel", "fsdp", "--job.dump_folder", str(folder), "--checkpoint.enable",
            "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "0", *extra]


def recorded_run(script, corpus, folder, nodes: int, *extra: str) -> tuple[dict, dict, str]:
    """One run on `nodes` torchrun agents of one process (1: a plain process): {step: sample ids in
    global-stream order}, {step: loss} and its output."""
    env = {**ENV, "SAMPLES": str(folder / "samples")}
    argv = resume_args(corpus, folder, *extra)
    if nodes == 1:
        r = subprocess.run([sys.executable, str(script), *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        out = r.stdout + r.stderr
    else:
        out = two_nodes(str(script), *argv, env=env)
    rows = [json.loads(ln) for f in sorted(folder.glob("samples.*")) for ln in f.read_text().splitlines()]
    # the stream's order inside a step: micro-step, then rank (loader.py's module doc)
    rows.sort(key=lambda r: (r["step"], r["micro"], r["rank"]))
    samples: dict[int, list[int]] = {}
    for r in rows:
        samples.setdefault(r["step"], []).extend(s // SEQ for s in r["starts"])
    (log,) = sorted(folder.glob("run_*[0-9].json"))[-1:]
    losses = {}
    for e in json.loads(log.read_text())["training_iterations"]:
        losses.update(zip(range(e["iter"] - len(e["step_losses"]) + 1, e["iter"] + 1), e["step_losses"]))
    return samples, losses, out


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["2 nodes x 1 -> 1 process", "1 process -> 2 nodes x 1"])
def test_resume_with_another_world_size_reads_every_sample_once(tmp_cache, arange_corpus, first, then):
    """A checkpoint written at step 4 by `first` nodes of one process resumes on `then` (fsdp's shards and
    AdamW state resharded by DCP, global batch 4 both ways): steps 5-8 read exactly the samples the
    uninterrupted run read there, in the same order, so across the change every sample of the 8 steps
    is read once; the losses are the uninterrupted run's (another reduction order: float tolerance)."""
    script = tmp_cache / "recording.py"
    script.write_text(RECORDING.format(root=str(ROOT)))
    folder = tmp_cache / "run"
    before, expected, _ = recorded_run(script, arange_corpus, folder, first)
    assert sorted(before) == list(range(1, STEPS + 1)) and all(len(v) == 4 for v in before.values())
    for f in folder.glob("samples.*"):
        f.unlink()
    after, losses, out = recorded_run(script, arange_corpus, folder, then, "--checkpoint.load_step", "4")
    assert f"checkpoint saved by {first} ranks, this run has {then}" in out
    assert "re-sharding the stream at position 16 " in out
    assert sorted(after) == [5, 6, 7, 8]
    assert after == {s: before[s] for s in after}  # the same samples at each step, in the same order
    ids = [i for s in range(1, 5) for i in before[s]] + [i for s in after for i in after[s]]
    assert len(ids) == len(set(ids)) == STEPS * 4  # none read twice, none skipped
    assert sorted(losses) == [5, 6, 7, 8]
    assert [losses[s] for s in losses] == pytest.approx([expected[s] for s in losses], rel=1e-5)


# Stand-ins for SLURM's commands: `scontrol show hostnames` lists the job's hosts (the first one is
# where the rendezvous is held), `srun --nodes=N CMD` starts CMD once per "node" on this machine with
# the task variables srun sets, records what each task was given, and exits as the first failed task.
SCONTROL = """\
#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && [ "$3" = "node[07-08]" ] || { echo "scontrol: unexpected $*" >&2; exit 1; }
printf 'localhost\\nnode08\\n'
"""
SRUN = """\
#!/usr/bin/env bash
n=1
while [[ "$1" == -* ]]; do
  case "$1" in --nodes=*) n=${1#*=} ;; esac
  echo "option $1" >> "$SRUN_LOG"
  shift
done
pids=()
for ((i = 0; i < n; i++)); do
  echo "task $i: NGPU=$NGPU TORCHRUN_ARGS=$TORCHRUN_ARGS TITANLITE_INSTALL=$TITANLITE_INSTALL cmd=$*" >> "$SRUN_LOG"
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" > "$SRUN_LOG.$i" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || { s=$?; [ "$rc" != 0 ] || rc=$s; }; done
exit $rc
"""


def test_slurm_batch_script_starts_one_job_of_two_nodes(tmp_cache):
    """scripts/slurm/train.sbatch under stand-in srun/scontrol: run_train.sh once per node, the
    rendezvous on the node list's first host with the job id as its id, SLURM's GPUs per node as
    NGPU, the config file and overrides passed through; the two nodes train as one job."""
    config = ["--job.config_file", "train_configs/debug_model.toml"]
    expected = single_process_losses(tmp_cache / "single", *config)
    bin_dir = tmp_cache / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    port = free_port()
    env = child_env(PATH=f"{bin_dir}:{os.environ['PATH']}", SRUN_LOG=str(tmp_cache / "srun.log"), SLURM_JOB_ID="4242",
                    SLURM_JOB_NODELIST="node[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_GPUS_PER_NODE="gpu:1",
                    RDZV_PORT=str(port), TITANLITE_INSTALL="0")
    env.pop("NGPU", None)
    cmd = ["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch"), *config, *args(tmp_cache / "slurm", 2)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    logs = {p.name: p.read_text() for p in tmp_cache.glob("srun.log*")}
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:] + "\n".join(v[-2000:] for v in logs.values())
    tasks = [ln for ln in logs["srun.log"].splitlines() if ln.startswith("task")]
    rdzv = f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint localhost:{port} --rdzv-id 4242"
    assert tasks == [f"task {i}: NGPU=1 TORCHRUN_ARGS={rdzv} TITANLITE_INSTALL=0 cmd={ROOT}/run_train.sh "
                     + " ".join(cmd[2:]) for i in range(2)]
    assert "option --nodes=2" in logs["srun.log"] and "option --ntasks-per-node=1" in logs["srun.log"]
    assert_one_job(tmp_cache / "slurm", expected)


def test_slurm_batch_script_outside_a_job_is_one_line():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "slurm" / "train.sbatch")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == ("error: SLURM_JOB_ID and SLURM_JOB_NODELIST are not set: submit this "
                                              "script with sbatch\n")


# ------------------------------------------------------------------- careless starts of one job
def launch_nodes(*per_node: list[str], port: int | None = None, nnodes: int = 0,
                 torchrun: tuple = ()) -> list[subprocess.Popen]:
    """One `python -m titanlite.launch` per node (what run_train.sh runs), one process each, meeting
    through c10d on localhost; node i trains with per_node[i]. `nnodes`: the job's nodes (default: as
    many as are started); `torchrun`: more torchrun options."""
    port = port or free_port()
    n = nnodes or len(per_node)
    return [subprocess.Popen([sys.executable, "-m", "titanlite.launch", "--world-size", str(n), "--nodes", str(n),
                              "--nproc_per_node=1", "--nnodes", str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                              f"127.0.0.1:{port}", "--rdzv-id", "titanlite-test", *torchrun, "--", *argv],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for argv in per_node]


def finish(nodes: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    """Each node's exit code, stdout and stderr."""
    out = []
    for p in nodes:
        try:
            out.append((p.wait(timeout=timeout), *p.communicate()))
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            pytest.fail(f"the nodes did not finish within {timeout} s")
    return out


def test_nodes_started_with_different_options_stop_before_step_1(tmp_cache):
    """Node 1 started with another local batch and learning rate: every node ends in the same one line
    naming both keys, each value and the rank and host holding it, exit 2, before any step (no run log
    holds one)."""
    import socket

    host = socket.gethostname()
    folder = tmp_cache / "out"
    results = finish(launch_nodes(args(folder, 2), [*args(folder, 4), "--optimizer.lr", "1e-3"]))
    want = (f"error: the job's ranks resolved different configurations: optimizer.lr is 0.003 on rank 0 ({host}), "
            f"0.001 on rank 1 ({host}); training.local_batch_size is 2 on rank 0 ({host}), 4 on rank 1 ({host}); "
            f"start every node with the same options and config file")
    for code, out, err in results:
        assert code == 2, (out + err)[-3000:]
        assert [line for line in err.splitlines() if line.startswith("error:")] == [want], err[-3000:]
        assert "Traceback" not in out + err
    assert not any(json.loads(p.read_text())["training_iterations"] for p in folder.glob("run_*.json"))


def test_sigterm_to_every_node_saves_and_exits_0(tmp_cache):
    """SIGTERM to both nodes' launchers (as a scheduler's cancel or a preemption sends it): the ranks
    finish the same step, save it, and every node exits 0, as one process does."""
    import signal
    import time

    folder = tmp_cache / "out"
    argv = [*args(folder, 2), "--training.steps", "200", "--checkpoint.enable", "--checkpoint.interval", "1000",
            "--debug.inject_data_delay_ms", "200"]
    nodes = launch_nodes(argv, argv)
    deadline = time.time() + 240
    while not any(folder.glob("run_*.json")) or not json.loads(
            next(folder.glob("run_*.json")).read_text() or "{}").get("training_iterations"):
        assert time.time() < deadline and all(p.poll() is None for p in nodes), "no step logged"
        time.sleep(0.5)
    for p in nodes:
        p.send_signal(signal.SIGTERM)
    results = finish(nodes)
    assert [code for code, *_ in results] == [0, 0], "\n".join((o + e)[-2000:] for _, o, e in results)
    said = "\n".join(o + e for _, o, e in results)
    step = int(re.search(r"stopped after step (\d+); checkpoint saved", said).group(1))
    assert (folder / "checkpoint" / f"step-{step}" / "complete.json").exists()


def test_a_node_alone_says_what_it_waits_for_and_gives_up_in_one_line(tmp_cache):
    """One node of two started: within seconds it names the rendezvous endpoint, the nodes joined of how
    many and the time left; at the join timeout set (--rdzv-conf join_timeout) it ends in one line, exit 1."""
    import time

    port = free_port()
    started = time.time()
    (code, out, err), = finish(launch_nodes(args(tmp_cache / "out", 2), port=port, nnodes=2,
                                            torchrun=("--rdzv-conf", "join_timeout=8")), timeout=120)
    assert code == 1, (out + err)[-3000:]
    where = f"rendezvous 127.0.0.1:{port} (id titanlite-test)"
    waiting = [line for line in err.splitlines() if line.startswith(f"{where}: 1 of 2 nodes joined, waiting ")]
    assert waiting and re.search(r"waiting [5-8] s more for the others \(--rdzv-conf join_timeout=S", waiting[0]), err
    assert err.splitlines()[-1] == (f"error: {where} gave up after 8 s with 1 of 2 nodes joined: start every node "
                                    f"with the same --rdzv-endpoint and --rdzv-id, or wait longer with --rdzv-conf "
                                    f"join_timeout=S in TORCHRUN_ARGS")
    assert "Traceback" not in err and time.time() - started < 60
