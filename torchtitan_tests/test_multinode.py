"""Two torchrun invocations, one per "node", meet through the c10d rendezvous on localhost and train
together (gloo, FSDP); their losses match a single process training on the same global batch. The same
two nodes started by the SLURM batch script (scripts/slurm/train.sbatch) through stand-in `srun` and
`scontrol` commands."""

import json
import os
import subprocess
import sys

import pytest

from titanlite.config import load_config
from titanlite.train import Trainer

from conftest import ROOT, free_port


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


def test_two_torchrun_nodes_match_single_process(tmp_cache):
    expected = single_process_losses(tmp_cache / "single")

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "titanlite-test",
           "-m", "titanlite.train", *args(tmp_cache / "multi", 2)]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = []
    for p in nodes:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in nodes:
                q.kill()
            pytest.fail("torchrun nodes did not finish within 300 s")
    assert all(p.returncode == 0 for p in nodes), "\n".join(o[-3000:] for o in outputs)
    assert_one_job(tmp_cache / "multi", expected)


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "SRUN_LOG": str(tmp_cache / "srun.log"), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[07-08]",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "gpu:1", "RDZV_PORT": str(port),
           "TITANLITE_INSTALL": "0"}
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
