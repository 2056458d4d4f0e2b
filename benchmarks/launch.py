"""The one launcher of the GPU benchmarks: titanlite runs on 1 or N GPUs, torchtitan runs, and their
steady-state figures read by one rule.

Every benchmark script starts its runs here, so that each run
- is a process group of its own with a timeout: a hang or a crash becomes a table row with the line
  that says why, and a timed-out run leaves no worker behind on the GPUs;
- gets BENCH_ENV: NVLink multicast off in NCCL, PyTorch and NVSHMEM (the lent multi-GPU machines
  need it: a program that uses multicast there can take the shared host's GPUs out of service),
  run_train.sh's allocator default and flash-attn 4's kernel cache on disk, each only where the
  environment does not set it already. The product (run_train.sh, titanlite.train) sets none of the
  multicast variables;
- keeps its whole output in WORK/<name>.log and its run folder in WORK/<name>/ (a torchtitan run:
  what its run.sh prints, step and error lines, in WORK/<name>.log, and each rank's whole output in
  WORK/<name>.ranks/). Scripts write only a table and a JSON of results to --out ($OUT on the GPU
  machine, which returns at most 8 files).

The peer is torchtitan, the PyTorch reference trainer, run from its published wheels: 0.2.2 (the
last TOML-driven release) through .bench/torchtitan_anchor/run.sh and 0.3.0 (Python config
registries) through .bench/torchtitan_v030/run.sh. Prepare them on the CPU machine with
`bash ../shared/bench/wheels.sh --peer` and `cp -r ../shared/bench .bench`, and carry .whl, .whl3
and .bench. Their step lines are parsed into the keys of titanlite's run log, so one rule reads both.

One titanlite configuration at the peer's shapes (LLaMA 1.36B, local batch 4, seq 2048):
  python benchmarks/launch.py [--ngpus N] [--steps 30] [--skip 15] -- --compile.enable [options]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(tempfile.gettempdir()) / "titanlite_bench"  # run folders and whole outputs; not returned

BENCH_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTHONUNBUFFERED": "1",
             # flash-attn 4 compiles its kernels at first use: keep them on disk for the next run's process
             "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}

# torchtitan's shapes: LLaMA 1.36B, local batch 4, seq 2048, warm-up 10; synthetic tokens, so no
# tokenizer or data preparation enters the timing.
PEER_SHAPES = ["--model.name", "llama", "--model.flavor", "1.36B", "--training.dataset", "synthetic",
               "--training.local_batch_size", "4", "--training.seq_len", "2048", "--lr_scheduler.warmup_steps", "10",
               "--validation.enable=false", "--checkpoint.enable=false", "--metrics.progress_bar=false"]

PEERS = {"0.2.2": ".bench/torchtitan_anchor/run.sh", "0.3.0": ".bench/torchtitan_v030/run.sh"}


class Parser(argparse.ArgumentParser):
    """argparse for the benchmark scripts, with titanlite's rule for bad input: one line, exit 2."""

    def __init__(self, doc: str, **kw):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, **kw)

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


@dataclass
class Result:
    """One launched run: what ran, how it ended, and its log entries (titanlite's run-log keys)."""
    name: str
    ngpus: int
    cmd: list[str]
    rc: int | None = None  # None: killed at the timeout
    wall_s: float = 0.0
    error: str | None = None  # the line that says why it failed
    entries: list[dict] = field(default_factory=list)  # training_iterations, or the peer's parsed step lines
    startup: dict = field(default_factory=dict)  # titanlite's startup_info
    validation: list[dict] = field(default_factory=list)  # titanlite's validation losses ({"iter", "val_loss"})
    output: str = ""  # the whole output (kept in WORK/<name>.log; only its tail goes into results files)

    def figures(self, skip: int) -> dict:
        return figures(self.entries, skip)


def bench_env(extra: dict | None = None) -> dict:
    """The environment of a launched run: BENCH_ENV under whatever the caller's environment sets."""
    return {**BENCH_ENV, **os.environ, **(extra or {})}


# what a run's code is: the library, its estimate, the benchmarks, the launcher and presets
CODE_GLOBS = ("titanlite/**/*.py", "estimation/**/*.py", "benchmarks/*.py", "run_train.sh", "train_configs/*.toml",
              "pyproject.toml")


def code_digest(root: Path = ROOT) -> str:
    """The first 12 hex digits of a sha256 over the code files (CODE_GLOBS) under `root`, by relative
    path and contents. It names the code a record ran without git: a copy of a working tree may carry
    git metadata older than its files (its `git describe` then names another commit); the same files
    give the same digest in any folder, so `python benchmarks/gpu_matrix.py --digest` on a checkout
    says whether it is the code a record names."""
    import hashlib

    h = hashlib.sha256()
    files = sorted({p for g in CODE_GLOBS for p in root.glob(g) if p.is_file() and "__pycache__" not in p.parts})
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def gpu_names() -> list[str]:
    """The names nvidia-smi gives this host's GPUs, those CUDA_VISIBLE_DEVICES shows only (none without
    nvidia-smi). Asked of the driver, so this process holds no CUDA context on any GPU."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = [n.strip() for n in names if n.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = [names[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(names)]
    return names


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_commands(nodes: int, per_node: int, target: list[str], rdzv_id: str) -> list[tuple[list[str], dict]]:
    """`nodes` torchrun agents on this host standing for nodes (c10d rendezvous on localhost), `per_node`
    processes each, with the environment of each: its own share of the host's GPUs (CUDA_VISIBLE_DEVICES,
    so each agent's local rank 0 is a GPU of its own)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(nodes * per_node)]
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={per_node}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", *target]
    return [(cmd, {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per_node:(i + 1) * per_node])}) for i in range(nodes)]


def command(ngpus: int, target: list[str]) -> list[str]:
    """`python TARGET` on one GPU, torchrun over `ngpus` GPUs of this host otherwise (TARGET: -m module or a script)."""
    if ngpus == 1:
        return [sys.executable, *target]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ngpus}", *target]


# The runs execute and execute_nodes have started and not yet seen end: a signal that ends this process
# ends them first (end_runs_on_signals). Reentrant: the handler runs in the main thread, which may hold it.
_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.RLock()
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_ENDING = threading.Event()  # set once a signal is ending this process: no run starts after it


def end_runs_on_signals() -> None:
    """Make SIGTERM, SIGHUP and SIGINT (a `timeout` around a benchmark script, a closed terminal, Ctrl-C) end the
    runs this process started before it goes: each run is a process group of its own, which a signal to this
    process alone would leave on the GPUs, holding their memory under every later run. Takes effect from the
    main thread (signal.signal's rule: execute calls it, and scripts that run rows in threads call it first);
    leaves a handler that someone else set."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _ENDING_SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _end_runs_and_go)


def _end_runs_and_go(signum, frame) -> None:
    """The handler: no run starts from now on; end every live run together (a row's thread may start one
    while others end: again until none is left), then end as the signal would have. A second signal while
    the runs end kills what is left at once and exits."""
    if _ENDING.is_set():
        with _LIVE_LOCK:
            live = list(_LIVE)
        _signal_runs(live, signal.SIGKILL)
        os._exit(128 + signum)
    _ENDING.set()
    ended: set[subprocess.Popen] = set()
    while True:
        with _LIVE_LOCK:
            live = [p for p in _LIVE if p.returncode is None and p not in ended]
        if not live:
            break
        _kill_groups(live)
        ended.update(live)
    # a run whose start the signal came between (its process made, not yet in _LIVE) is no run of the set;
    # every process a run's start made is still this process's descendant
    _kill_groups([], others=_descendants(os.getpid()))
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)  # then the signal's own end, as if this handler had not been
    os.kill(os.getpid(), signum)


class Ending(RuntimeError):
    """A run asked for after a signal began to end this process."""

    def __init__(self):
        super().__init__("a signal is ending this process: no run starts")


def _started(p: subprocess.Popen) -> subprocess.Popen:
    with _LIVE_LOCK:
        if not _ENDING.is_set():
            _LIVE.add(p)
            return p
    _kill_groups([p])  # started in the moment the handler began
    raise Ending()


def _ended(p: subprocess.Popen) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(p)


def execute(name: str, cmd: list[str], timeout: int, work: Path = WORK, cwd: Path = ROOT,
            env: dict | None = None, timed: bool = False) -> tuple[int | None, str, float]:
    """Run `cmd` as its own process group; kill the group at `timeout` s, or when a signal ends this process
    (end_runs_on_signals). Returns (rc or None, output, seconds). `timed`: each output line prefixed with the
    seconds since the start when it came ("%7.1f "; timed_lines reads them back)."""
    end_runs_on_signals()
    if _ENDING.is_set():
        raise Ending()
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"{name}.log"
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(log, "w") as fh:
        p = _started(subprocess.Popen(cmd, cwd=cwd, env=bench_env(env), stdout=subprocess.PIPE if timed else fh,
                                      stderr=subprocess.STDOUT, text=timed, start_new_session=True))
        if timed:
            def stamp():
                for line in p.stdout:
                    fh.write(f"{time.time() - t0:7.1f} {line}")

            reader = threading.Thread(target=stamp, daemon=True)
            reader.start()
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_group(p)
        except BaseException:  # the handler's KeyboardInterrupt (it ended the run), or anything else
            _kill_group(p)
            raise
        finally:
            _ended(p)
        if timed:
            reader.join(timeout=10)
    text = log.read_text(errors="replace")
    return rc, text, time.time() - t0


def timed_lines(text: str) -> list[tuple[float, str]]:
    """The (seconds, line) pairs of a timed output (execute's `timed`)."""
    return [(float(line[:7]), line[8:]) for line in text.splitlines() if line]


def execute_nodes(name: str, agents: list[tuple[list[str], dict]], timeout: int, work: Path = WORK, cwd: Path = ROOT,
                  env: dict | None = None, grace: float = 30.0) -> tuple[int | None, str, float]:
    """Run the agents of `node_commands` at once, each as its own process group (output in
    WORK/<name>.node<i>.log), under `env` and each its own; kill every group at `timeout` s, and the
    others `grace` s after one fails (its peers would wait for it). Returns (0, or the first failure's
    rc, or None at the timeout; the outputs one after the other; seconds)."""
    end_runs_on_signals()
    work.mkdir(parents=True, exist_ok=True)
    t0, procs, logs = time.time(), [], []
    try:
        for i, (cmd, own) in enumerate(agents):
            logs.append(work / f"{name}.node{i}.log")
            print(f"[{time.strftime('%H:%M:%S')}] {name} node {i}: {' '.join(cmd)}", flush=True)
            with open(logs[-1], "w") as fh:
                procs.append(_started(subprocess.Popen(cmd, cwd=cwd, env=bench_env({**(env or {}), **own}), stdout=fh,
                                                       stderr=subprocess.STDOUT, start_new_session=True)))
        deadline, timed_out = t0 + timeout, False
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.time() + grace)
            if time.time() > deadline:
                timed_out = all(p.returncode in (None, 0) for p in procs)
                _kill_groups([p for p in procs if p.poll() is None])
                break
            time.sleep(0.5)
        rcs = [p.wait() for p in procs]
    except BaseException:  # an agent that did not start, the handler's KeyboardInterrupt: none is left running
        _kill_groups([p for p in procs if p.poll() is None])
        raise
    finally:
        for p in procs:
            _ended(p)
    text = "\n".join(f"== node {i} ==\n" + log.read_text(errors="replace") for i, log in enumerate(logs))
    rc = None if timed_out else next((r for r in rcs if r != 0), 0)
    return rc, text, time.time() - t0


def _kill_group(p: subprocess.Popen) -> None:
    """End a timed-out run (_kill_groups)."""
    _kill_groups([p])


def _kill_groups(procs: list[subprocess.Popen], others: list[int] = ()) -> None:
    """End runs together: each one's process group, then whatever of its descendants is left (torchrun
    starts each worker in a new process group (setsid), so the group alone would leave them on the GPUs),
    and the processes `others`. SIGTERM to all, up to 20 s for all of them to go, then SIGKILL to what is
    left, 5 s more."""
    kids = {p: _descendants(p.pid) for p in procs}
    pids = [*others, *(k for ks in kids.values() for k in ks)]
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        _signal_runs(procs, sig, kids)
        _signal_pids(others, sig)
        deadline = time.time() + wait
        while time.time() < deadline:
            # a signalled descendant takes a moment to exit after its group's leader has: wait for it too
            # (a leader unreaped because the thread waiting on it is the one this handler interrupted: gone too)
            if all(p.poll() is not None or _gone(p.pid) for p in procs) and all(map(_gone, pids)):
                return
            time.sleep(0.05)


def _signal_runs(procs: list[subprocess.Popen], sig: int, kids: dict | None = None) -> None:
    """`sig` to each run's process group and to its descendants (`kids`: found before, else now)."""
    for p in procs:
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        _signal_pids(kids[p] if kids is not None else _descendants(p.pid), sig)


def _signal_pids(pids, sig: int) -> None:
    for pid in pids:
        if not _gone(pid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for its new parent to reap it (it holds nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children first."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parent.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


_EXCEPTION = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b:?.*)$")


def error_line(text: str, rc: int | None, timeout: int | None = None) -> str | None:
    """Why a run failed, in one line: None for exit 0; at a timeout, that; else the last exception the
    program raised (not torchrun's ChildFailedError wrapper), else a line starting with 'error:'
    (titanlite's one-line input errors), else the last line."""
    if rc == 0:
        return None
    if rc is None:
        return f"timeout after {timeout}s" if timeout else "timeout"
    lines = [ln.strip() for ln in _strip_ansi(text).splitlines() if ln.strip()]
    why = last_exception(text) or next((ln for ln in reversed(lines) if ln.lower().startswith("error:")), None)
    return f"exit {rc}: {(why or (lines or [''])[-1])[:200]}"


def last_exception(text: str) -> str | None:
    """The last 'SomeError: message' line of a Python traceback in `text` (rank prefixes removed)."""
    found = [m[1] for ln in _strip_ansi(text).splitlines()
             if (m := _EXCEPTION.match(ln.strip())) and "ChildFailedError" not in ln]
    return found[-1] if found else None


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


# ------------------------------------------------------------------------------------------ titanlite
def titanlite(name: str, args: list[str], ngpus: int = 1, steps: int = 30, log_freq: int = 5, timeout: int = 420,
              work: Path = WORK, base: list[str] | None = None, nodes: int = 1, env: dict | None = None) -> Result:
    """One titanlite training run (`python -m titanlite.train BASE ARGS`); its run log read back. With
    `nodes` > 1, `nodes` torchrun agents on this host stand for as many nodes (node_commands), the
    `ngpus` GPUs split between them; `env` is added to the run's environment."""
    folder = fresh_folder(work / name)
    target = ["-m", "titanlite.train", *(PEER_SHAPES if base is None else base), *args, "--training.steps", str(steps),
              "--metrics.log_freq", str(log_freq), "--job.dump_folder", str(folder)]
    if nodes > 1:
        agents = node_commands(nodes, ngpus // nodes, target, name)
        cmd = agents[0][0]
        rc, text, wall = execute_nodes(name, agents, timeout, work, env=env)
    else:
        cmd = command(ngpus, target)
        rc, text, wall = execute(name, cmd, timeout, work, env=env)
    return _finished(Result(name, ngpus, cmd, rc, wall, error_line(text, rc, timeout), output=text), folder)


def run_train(name: str, args: list[str], ngpus: int = 1, steps: int = 20, log_freq: int = 5, timeout: int = 420,
              work: Path = WORK, env: dict | None = None) -> Result:
    """`NGPU=ngpus ./run_train.sh ARGS` as a user types it (titanlite.launch: the option check, the memory
    check beside the ranks' start-up, torchrun over this host's GPUs), the interpreter taken as it is
    (TITANLITE_INSTALL=0); its run log read back. `env` is added to the job's environment."""
    folder = fresh_folder(work / name)
    cmd, job_env = run_train_command(args, ngpus, steps, log_freq, folder, env)
    rc, text, wall = execute(name, cmd, timeout, work, env=job_env)
    return _finished(Result(name, ngpus, cmd, rc, wall, error_line(text, rc, timeout), output=text), folder)


def run_train_command(args: list[str], ngpus: int, steps: int, log_freq: int, folder: Path,
                      env: dict | None = None) -> tuple[list[str], dict]:
    """The command and environment of `NGPU=ngpus ./run_train.sh ARGS` writing to `folder`, the
    interpreter taken as it is (TITANLITE_INSTALL=0), `env` added."""
    cmd = [str(ROOT / "run_train.sh"), *args, "--training.steps", str(steps), "--metrics.log_freq", str(log_freq),
           "--metrics.progress_bar=false", "--job.dump_folder", str(folder)]
    return cmd, {"NGPU": str(ngpus), "TITANLITE_INSTALL": "0", **(env or {})}


def estimate(name: str, options: list[str], timeout: int, work: Path = WORK) -> tuple[dict | None, str, float]:
    """`python -m estimation OPTIONS` (its report in WORK/NAME/estimate.json): (the report, or None with
    the line that says why; seconds). A run that does not fit (exit 1) has a report, without throughput."""
    report = work / name / "estimate.json"
    report.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "estimation", *options, "--estimate.output", str(report), "--job.dump_folder",
           str(report.parent)]
    rc, text, wall = execute(name, cmd, timeout, work)
    if rc not in (0, 1) or not report.exists():
        return None, error_line(text, rc, timeout) or "no report", wall
    return json.loads(report.read_text()), "", wall


def fresh_folder(folder: Path) -> Path:
    """A run folder without the run logs of an earlier run of the same name."""
    for old in folder.glob("run_*.json") if folder.exists() else ():
        old.unlink()
    return folder


def run_log(folder: Path) -> Path | None:
    """The newest titanlite run log in a run folder, or None."""
    logs = sorted(folder.glob("run_*.json"), key=os.path.getmtime)
    return logs[-1] if logs else None


def _finished(res: Result, folder: Path) -> Result:
    """`res` with its run log's entries, start-up and validation read in; its outcome printed."""
    if (log := run_log(folder)) is not None:
        data = json.loads(log.read_text())
        res.entries, res.startup = data.get("training_iterations", []), data.get("startup_info", {})
        res.validation = data.get("validation", [])
    print(f"[{time.strftime('%H:%M:%S')}] {res.name}: {res.error or 'ok'} in {res.wall_s:.0f}s", flush=True)
    return res


# ------------------------------------------------------------------------------- the steady-state rule
def steady(entries: list[dict], skip: int) -> list[dict]:
    """Log entries of the steady state: those after step `skip` (compilation, warm-up and CUDA-graph
    capture fall before it), by the project's one rule (titanlite.metrics.run_log.steady), which reads
    titanlite's run log and torchtitan's step lines alike."""
    from titanlite.metrics.run_log import steady as rule

    return rule(entries, warmup_steps=skip).entries


def figures(entries: list[dict], skip: int) -> dict:
    """Tokens/s per GPU, MFU and step time by the run log's throughput rule (the steady entries' mean:
    titanlite.metrics.run_log.throughput); peaks of allocated and reserved memory over the whole run
    (both logs report peaks since start), in GiB; rank 0's optimizer phase in ms, the median over the
    steady entries (titanlite's log only). Keys absent from a log are None."""
    from titanlite.metrics.run_log import throughput

    if not entries:
        return {}
    s = steady(entries, skip)
    rates = throughput(s)

    def peak(key):
        vals = [e[key] for e in entries if e.get(key) is not None]
        return max(vals) if vals else None

    opt = sorted(e["breakdown"]["ranks"][0]["optimizer_ms"] for e in s if e.get("breakdown"))
    return {"tps_gpu": rates["tokens_per_sec_per_gpu"], "mfu": rates["mfu_pct"], "ms": rates["step_ms"],
            "mem": peak("memory_peak_gb"), "reserved": peak("memory_reserved_peak_gb"), "steps": len(s),
            "opt_ms": opt[len(opt) // 2] if opt else None,
            "spread": spread([e.get("tokens_per_sec_per_gpu") for e in s])}


def spread(rates: list) -> float | None:
    """How unsteady a run's steady log steps were: the inter-quartile range of their tokens/s per GPU
    (diagnose's jitter measure) as a percentage of their mean; None under two values. A ratio between
    two runs that differs by less than their spreads is inside their noise."""
    from titanlite.diagnose.runs import iqr

    vals = [float(v) for v in rates if isinstance(v, (int, float))]
    return 100 * iqr(vals) / (sum(vals) / len(vals)) if len(vals) >= 2 and sum(vals) > 0 else None


def step_losses(entries: list[dict]) -> dict[int, float]:
    """step -> loss of every optimizer step in titanlite's log entries (titanlite.metrics.run_log's rule)."""
    from titanlite.metrics.run_log import step_losses as by_step

    return by_step(entries)


# ------------------------------------------------------------------------------------------ torchtitan
def parse_peer(text: str) -> list[dict]:
    """torchtitan's step lines as run-log entries (iter, loss, grad_norm, memory_reserved_peak_gb,
    tokens_per_sec_per_gpu, tflops_per_gpu, mfu), one per step, in order: the reader diagnose uses
    (titanlite.diagnose.readers.torchtitan_steps, where the line's format is written down)."""
    from titanlite.diagnose.readers import torchtitan_steps

    return torchtitan_steps(text)


def peer(version: str, ngpus: int = 1, overrides: list[str] | None = None, timeout: int = 600, work: Path = WORK,
         name: str = "", env: dict | None = None) -> Result:
    """One torchtitan run through its run.sh (which installs the carried wheels); its step lines parsed.
    run.sh passes on only its step and error lines; each rank's whole output, as torchtitan printed it
    (colours included), is kept by torchrun in WORK/<name>.ranks/ (peer_ranks_output reads it). `env` is
    added to the run's environment."""
    script = ROOT / PEERS[version]
    name = name or re.sub(r"[^A-Za-z0-9_.-]", "_", f"torchtitan_{version}_{ngpus}gpu_{'_'.join(overrides or [])}")[:120]
    cmd = ["bash", str(script), str(ngpus), *(overrides or [])]
    if not script.exists():
        return Result(name, ngpus, cmd, 2, error=f"torchtitan {version} is not here: carry .bench (cp -r "
                                                 f"../shared/bench .bench) and the wheels (wheels.sh --peer)")
    ranks = work / f"{name}.ranks"
    shutil.rmtree(ranks, ignore_errors=True)
    # torchrun takes each option from PET_<OPTION> when the command line does not give it: its --log-dir
    rc, text, wall = execute(name, cmd, timeout, work, env={**(env or {}), "PET_LOG_DIR": str(ranks)})
    entries = parse_peer(text)
    # run.sh ends in a pipe (grep | tail) and exits 0 whatever torchtitan did: its output decides
    exc = last_exception(text)
    error = (error_line(text, rc, timeout) if rc != 0 else None) or (exc[:200] if exc else None) or \
        (None if entries else "no step lines in torchtitan's output")
    res = Result(name, ngpus, cmd, rc, wall, error, entries, output=text)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {res.error or 'ok'} in {wall:.0f}s", flush=True)
    return res


def peer_ranks_output(name: str, rank: int = 0, work: Path = WORK) -> Path | None:
    """The file torchrun wrote rank `rank`'s stdout to in peer run `name` (its last attempt), or None.
    torchrun's layout: LOG_DIR/<run id>_<random>/attempt_<n>/<local rank>/stdout.log."""
    found = sorted((work / f"{name}.ranks").glob(f"*/attempt_*/{rank}/stdout.log"), key=os.path.getmtime)
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------- results
def save(out: Path, stem: str, table: str, results: list[Result], extra: dict | None = None,
         tail_lines: int = 60) -> None:
    """Write OUT/STEM.md (the table) and OUT/STEM.json (every run: command, outcome, figures' entries,
    the tail of its output), the two files a benchmark returns from the GPU machine."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(table + "\n")
    runs = []
    for r in results:
        d = asdict(r)
        d["output"] = "\n".join(r.output.splitlines()[-tail_lines:])
        runs.append(d)
    (out / f"{stem}.json").write_text(json.dumps({**(extra or {}), "runs": runs}, indent=1, default=str))


def load(path: str | Path) -> list[Result]:
    """The runs a script's JSON holds (what `save` wrote), as Results."""
    runs = json.loads(Path(path).read_text())["runs"]
    return [Result(**{k: v for k, v in d.items() if k in Result.__dataclass_fields__}) for d in runs]


def trace_events(path: str | Path) -> list[dict] | None:
    """The events of a torch.profiler Chrome trace (.json, or .json.gz as torch's TensorBoard handler
    writes it): its `traceEvents`, or the file's list itself. None where the file is JSON but not a trace;
    OSError and ValueError (not JSON) are the caller's to report."""
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as fh:
        data = json.load(fh)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    return events if isinstance(events, list) and all(isinstance(e, dict) for e in events) else None


def exception_line(e: BaseException, width: int = 100) -> str:
    """`e` as a table row's error cell: its type and the first line of its message, cut at `width` characters."""
    message = str(e)
    return f"{type(e).__name__}: {message.splitlines()[0][:width] if message else ''}"


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = Parser(__doc__)
    ap.add_argument("--ngpus", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=15, help="log steps up to this one are warm-up")
    ap.add_argument("--timeout", type=int, default=420, help="seconds before the run is killed")
    ap.add_argument("--name", default="run")
    a = ap.parse_args(own)
    if a.ngpus < 1 or a.steps < 1:
        ap.error("--ngpus and --steps must be positive")
    r = titanlite(a.name, rest, a.ngpus, a.steps, 5, a.timeout)
    f = r.figures(a.skip)
    print(f"{a.name}: {r.error or 'ok'} | tok/s/GPU {fmt(f.get('tps_gpu'), ',.0f')} | MFU {fmt(f.get('mfu'), '.1f')}% "
          f"| peak allocated {fmt(f.get('mem'), '.2f')} GiB, reserved {fmt(f.get('reserved'), '.2f')} GiB "
          f"| optimizer {fmt(f.get('opt_ms'), '.1f')} ms "
          f"| {f.get('steps', 0)} steady log steps | log {WORK / (a.name + '.log')}")
    return 0 if r.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
