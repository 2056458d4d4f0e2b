"""Start a training job: `python -m titanlite.launch --world-size W [--command C] [--nodes N]
[--log-ranks L] [TORCHRUN OPTIONS] -- ARGS`.

What run_train.sh runs once it has chosen the processes (one process when no torchrun options come):
1. The config check (`titanlite.config.check`) and the node's check (`check_processes`: processes
   per node against its GPUs or CPU cores, the log ranks against its local ranks): a bad option is
   one line and exit code 2 before any rank starts. Then the one command the job is, printed.
2. The memory check (`training.memory_fit`): where this node's GPU is in titanlite/hardware.py, `python
   -m estimation.preflight` predicts the job's peak memory per GPU *while the ranks start*, so a run
   that fits waits for nothing. A prediction that the configured local batch cannot fit stops the
   ranks at once (they are compiling, or in a step that needs that peak): `check` ends the job in
   one line (exit code 2) naming the predicted peak, the GPU's memory and the command that fits;
   `adjust` starts the job again at the largest local batch that fits and divides the global batch,
   with the accumulation that keeps it (where none does, or where more checkpointing lets a larger
   micro-batch run that is predicted faster, with activation checkpointing raised), and says so; a
   tight batch (inside the allocator's headroom) too, where the clear one is at least half of it. A job that ends first ends the check, but for an out-of-memory failure under `adjust`,
   which waits for the prediction to start again.
3. The job: `python -m titanlite.train ARGS`, or torchrun run inside this module's `agent`, where a
   failed job ends in one line with its exit code instead of torchrun's report (`job_line`: a rank
   killed by a signal, else the first line a rank said with `titanlite.errors.say_failure`, else a
   rank that exited without one), a node waiting at the rendezvous says for what (`Rendezvous`), and
   SIGTERM or SIGINT is passed on to the ranks, which save and exit 0 (`Ranks`).

Without a memory check to run (no GPU, a GPU the table lacks, training.memory_fit=off) the job takes
this process over; with one, this process waits for the job and relays its exit code. A Ctrl-C at the
terminal reaches this process and torchrun's agent, which passes it on to the ranks (they run in
sessions of their own); SIGTERM sent here is passed on to the job.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from titanlite.config import ConfigError, run_cli
from titanlite.config.check import check, world_size
from titanlite.errors import BAD_INPUT_EXIT, FAILURE_EXIT, OUT_OF_MEMORY_EXIT
from titanlite.hardware import lookup


def main(argv: list[str]) -> None:
    world, argv = world_size(argv)
    command = "./run_train.sh"  # how the job was started, for the command the memory check advises
    if argv[:1] == ["--command"] and len(argv) > 1:
        command, argv = argv[1], argv[2:]
    n_nodes = 1  # run_train.sh's count of torchrun's --nnodes (the one reading of it)
    if argv[:1] == ["--nodes"] and len(argv) > 1 and argv[1].isdigit() and int(argv[1]) >= 1:
        n_nodes, argv = int(argv[1]), argv[2:]
    log_ranks = "0"  # LOG_RANK: the local ranks whose output is shown
    if argv[:1] == ["--log-ranks"] and len(argv) > 1:
        log_ranks, argv = argv[1], argv[2:]
    if "--" not in argv:
        raise ConfigError("titanlite.launch expects [TORCHRUN OPTIONS] -- TRAINING ARGUMENTS")
    torchrun_opts, train_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    cfg, found = check(train_args, world)
    check_processes(cfg, found, world // n_nodes, log_ranks)
    if torchrun_opts:
        torchrun_opts = [*torchrun_opts, "--local-ranks-filter", log_ranks]
    # the one command the job is (torchrun runs in this process, `agent`, so that its failure is one line)
    print(shlex.join(["torchrun", *torchrun_opts, "-m", "titanlite.train", *train_args] if torchrun_opts
                     else ["python", "-m", "titanlite.train", *train_args]), flush=True)
    prediction = prediction_command(cfg, world, n_nodes, found or [], command, train_args)
    if prediction is None:
        if torchrun_opts:
            sys.exit(agent(torchrun_opts, train_args))
        os.execv(sys.executable, train_command(train_args))
    sys.exit(supervise(Job(torchrun_opts, train_args), Prediction(prediction), cfg.training.memory_fit))


def check_processes(cfg, found: list | None, per_node: int, log_ranks: str) -> None:
    """Refuse, in one line, more processes on this node than it has GPUs (those CUDA_VISIBLE_DEVICES
    leaves visible; debug.inject_shared_device puts them on one on purpose) or, on a node without a GPU,
    than CPU cores this process may run on (every rank needs one of its own, or the ranks only take
    turns), and log ranks (LOG_RANK, torchrun's local ranks) that this node does not run. `found`:
    `check.gpus()` (None: nvidia-smi cannot tell)."""
    if found:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = len([d for d in visible.split(",") if d.strip()]) if visible is not None else len(found)
        where = "CUDA_VISIBLE_DEVICES leaves" if visible is not None else "nvidia-smi lists"
        if per_node > gpus and not cfg.debug.inject_shared_device:
            raise ConfigError(f"NGPU={per_node} processes on a node where {where} {gpus} GPU(s): one process per "
                              f"GPU, NGPU={gpus} or less")
    elif found == []:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if per_node > cores:
            raise ConfigError(f"NGPU={per_node} processes on a node without a GPU and {cores} CPU core(s) for them: "
                              f"each CPU rank needs a core of its own, NGPU={cores} or less")
    try:
        shown = [int(r) for r in log_ranks.split(",")]
    except ValueError:
        raise ConfigError(f"LOG_RANK must be local ranks separated by commas (0,1); got '{log_ranks}'") from None
    outside = [r for r in shown if not 0 <= r < per_node]
    if outside:
        runs = "local rank 0" if per_node == 1 else f"local ranks 0-{per_node - 1}"
        raise ConfigError(f"LOG_RANK={log_ranks}: this node runs {runs} (NGPU={per_node}), so "
                          f"{', '.join(map(str, outside))} would show nothing")


def train_command(train_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "titanlite.train", *train_args]


def prediction_command(cfg, world: int, n_nodes: int, found: list, command: str,
                       train_args: list[str]) -> list[str] | None:
    """The estimation.preflight command for this job, or None where there is nothing to predict: the
    check is off, the node has no GPU, or its GPU has no row in titanlite/hardware.py (said in a line)."""
    if cfg.training.memory_fit == "off" or not found:
        return None
    rows = [lookup(name) for name, _ in found]
    if None in rows:
        unknown = found[rows.index(None)][0]
        print(f"memory check skipped: no memory figure for '{unknown}' in titanlite/hardware.py "
              f"(training.memory_fit={cfg.training.memory_fit})", flush=True)
        return None
    smallest = min(rows, key=lambda hw: hw.memory_gib)
    if "NGPU" in os.environ:
        command = f"NGPU={os.environ['NGPU']} {command}"
    return [sys.executable, "-m", "estimation.preflight", "--world-size", str(world), "--nodes", str(n_nodes),
            "--hardware", smallest.key, "--command", command, "--", *train_args]


# --------------------------------------------------------------------------------------- supervise
_prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None


def _die_with_launcher() -> None:
    """In a child, before it runs: SIGTERM when this process dies, so a launcher killed outright
    (kill -9) leaves no job training unsupervised (Linux; this process's main thread starts it)."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Job:
    """The job's processes: one titanlite.train, or this module's torchrun agent."""

    def __init__(self, torchrun_opts: list[str], train_args: list[str]):
        self.torchrun_opts, self.train_args = torchrun_opts, train_args
        self.proc: subprocess.Popen | None = None

    def start(self, extra_args: tuple[str, ...] = ()) -> None:
        args = [*self.train_args, *extra_args]
        argv = ([sys.executable, "-m", "titanlite.launch", "--agent", *self.torchrun_opts, "--", *args]
                if self.torchrun_opts else train_command(args))
        self.proc = subprocess.Popen(argv, preexec_fn=_die_with_launcher)

    def stop(self) -> None:
        """At once and saving nothing (no step of a run that does not fit has finished): one process
        is killed; the agent kills its ranks (SIGUSR1, see `agent`) and exits once they are gone, so
        their GPU memory is free when this returns."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1 if self.torchrun_opts else signal.SIGKILL)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Prediction:
    """estimation.preflight running beside the job: GPUs hidden from it (it needs none, and a CUDA
    context would take memory on the job's first GPU), on one thread and without compile workers, so
    that it takes one core from the ranks' start-up, which a run that fits waits for. Not at a lower
    priority: while the ranks compile on every core it would lag them, and a run that cannot fit
    would reach its out-of-memory error before the check's line."""

    def __init__(self, argv: list[str]):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                                     preexec_fn=_die_with_launcher)
        self.pending = True

    def done(self) -> bool:
        return self.pending and self.proc.poll() is not None

    def verdict(self) -> dict:
        """What estimation.preflight decided: {"action": none | warn | stop | restart, "line", "args"}."""
        self.pending = False
        out = self.proc.stdout.read().strip().splitlines()
        try:
            return json.loads(out[-1])
        except (IndexError, ValueError):
            return {"action": "none", "line": f"memory check: no prediction (estimation.preflight exited with "
                                              f"{self.proc.returncode})"}

    def cancel(self) -> None:
        if self.pending:
            self.pending = False
            self.proc.kill()
            self.proc.wait()


def supervise(job: Job, prediction: Prediction, mode: str, poll_s: float = 0.1) -> int:
    """Run the job beside the prediction and act once on what it predicts (training.memory_fit `mode`);
    returns the job's exit code, or 2 where the prediction stopped it."""
    def pass_on(signum, _frame):
        prediction.cancel()
        if signum != signal.SIGINT:  # Ctrl-C reaches the job from the terminal itself
            job.proc.send_signal(signum)

    before = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        job.start()
        while True:
            code = job.proc.poll()
            if code is not None:
                if not (code == OUT_OF_MEMORY_EXIT and mode == "adjust" and prediction.pending):
                    prediction.cancel()
                    return code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
                # out of memory before the prediction came: adjust starts it again. Said, as the ranks' own
                # out-of-memory line above would otherwise read as the job's end
                print("memory check: the ranks ran out of memory before the check's prediction; waiting for it "
                      "(training.memory_fit=adjust starts them again where it finds a batch that fits)", flush=True)
                prediction.proc.wait()
            if prediction.done():
                verdict = prediction.verdict()
                action = verdict["action"]
                if action in ("stop", "restart"):
                    job.stop()
                print(verdict["line"], file=sys.stderr if action in ("warn", "stop") else sys.stdout, flush=True)
                if action == "stop":
                    return BAD_INPUT_EXIT
                if action == "restart":
                    job.start(tuple(verdict["args"]))
            time.sleep(poll_s)
    finally:
        prediction.cancel()
        for sig, handler in before.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------------------ agent
# torchrun's own lines about a failure or a stop that the job's one line replaces (message templates)
_AGENT_NOISE = ("failed (exitcode", "Sending process", "Received %s death signal")


def _quiet(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_AGENT_NOISE)


class Ranks:
    """This node's ranks once torchrun has started them, and the clean stop: SIGTERM or SIGINT here is
    passed on to them, and the agent goes on watching, so the ranks finish their step, save and exit 0,
    and so does the job, on one node or several (torchrun's own handler would stop them with the signal
    and exit 128 + N whatever they did). A repeat past the ranks' grace (preemption.REPEAT_GRACE_S: an echo of the
    same signal comes sooner) is torchrun's stop: the ranks get the signal again and SIGKILL after its
    grace; a signal before the ranks start is torchrun's stop too."""

    def __init__(self):
        from titanlite.checkpoint.preemption import REPEAT_GRACE_S, SIGNALS  # the ranks' own handling of them

        self.signals, self.grace_s = SIGNALS, REPEAT_GRACE_S
        self.context = None
        self.this_round = False  # `context` holds the ranks of the rendezvous round now on (not an earlier one's)
        self.stopped: set[int] = set()  # local ranks torchrun itself stopped (still running when it closed)
        self.signal: signal.Signals | None = None  # the signal passed on, if any
        self._at: float | None = None

    def started(self, context) -> None:
        """torchrun started `context`'s processes (its PContext) and put its own handlers in place."""
        self.context, self.this_round = context, True
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                signal.signal(sig, self.stop)

    def closing(self, context) -> None:
        """torchrun is about to stop `context`'s processes that still run (one has failed, or the job ends)."""
        handlers = getattr(context, "subprocess_handlers", {})  # torchrun's processes for a module or a script
        self.stopped |= {local for local, h in handlers.items() if h.proc.poll() is None}

    def said(self) -> tuple[str, int] | None:
        """The first line this node's ranks of this rendezvous round said in their error files
        (titanlite.errors.say_failure) and its exit code, or None where none did (or none started)."""
        said = {}
        files = getattr(self.context, "error_files", None) if self.this_round else None
        for local, path in (files or {}).items():
            with contextlib.suppress(OSError, ValueError), open(path) as fh:
                data = json.load(fh)
                if isinstance(data, dict) and "exit_code" in data:
                    said[local] = data
        return earliest(said)

    def stop(self, signum: int, _frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        sig, now = signal.Signals(signum), time.monotonic()
        if self._at is not None and now - self._at > self.grace_s:
            raise SignalException(f"second {sig.name}", sigval=sig)
        if self._at is None:
            self.signal, self._at = sig, now
            print(f"{sig.name}: passed on to this node's ranks, which finish their step, save (checkpoint.enable) and "
                  f"exit; another {sig.name} stops them at once", file=sys.stderr, flush=True)
        for pid in self.context.pids().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


class Rendezvous:
    """What a node waiting for the others says: at once (a second in, once it has joined) the rendezvous
    endpoint, how many nodes have joined of how many and the time left before torchrun's join timeout
    (--rdzv-conf join_timeout=S, 600 s by default), again every `every_s`; and the one line of a
    rendezvous that gave up (`line`)."""

    def __init__(self, endpoint: str, every_s: float = 15.0):
        self.endpoint, self.every_s = endpoint, every_s
        self.handler = None
        self.joined, self.timeout_s = 0, 0.0

    def _where(self) -> str:
        return f"rendezvous {self.endpoint} (id {self.handler._settings.run_id})"

    def join(self, handler, next_rendezvous):
        """torchrun's `handler.next_rendezvous()`, said while it waits."""
        self.handler, settings = handler, handler._settings
        self.timeout_s = settings.timeout.join.total_seconds()
        if settings.max_nodes == 1:
            return next_rendezvous(handler)
        done = threading.Event()
        deadline = time.monotonic() + self.timeout_s

        def say():
            wait_s = 1.0  # the first line once this node has joined, then every every_s
            while not done.wait(wait_s):
                self.joined = len(handler._state_holder.state.participants)  # torchrun's last sync of the store
                print(f"{self._where()}: {self.joined} of {settings.min_nodes} nodes joined, waiting "
                      f"{max(deadline - time.monotonic(), 0):.0f} s more for the others (--rdzv-conf join_timeout=S "
                      f"in TORCHRUN_ARGS sets the wait)", file=sys.stderr, flush=True)
                wait_s = self.every_s

        thread = threading.Thread(target=say, name="rendezvous-wait", daemon=True)
        thread.start()
        try:
            return next_rendezvous(handler)
        finally:
            done.set()
            thread.join()

    def line(self, e: Exception, ranks_ran: bool = False) -> str:
        """The one line of rendezvous error `e`; `ranks_ran`: this node's ranks of the round had started (a
        lost store then means the node holding it ended, which says why itself)."""
        if ranks_ran and "Connection" in type(e).__name__:
            return (f"error: rendezvous {self.endpoint}: lost its store while this node's ranks ran "
                    f"({type(e).__name__}): the node holding it, the first to reach {self.endpoint}, ended or "
                    f"cannot be reached (its own output says why); this node's ranks were stopped")
        if self.handler is None:
            return f"error: rendezvous {self.endpoint}: {type(e).__name__}: {e}"
        if "timeout" in type(e).__name__.lower():
            return (f"error: {self._where()} gave up after {self.timeout_s:.0f} s with {self.joined} of "
                    f"{self.handler._settings.min_nodes} nodes joined: start every node with the same --rdzv-endpoint "
                    f"and --rdzv-id, or wait longer with --rdzv-conf join_timeout=S in TORCHRUN_ARGS")
        return f"error: {self._where()}: {type(e).__name__}: {e}"


def agent(torchrun_opts: list[str], train_args: list[str]) -> int:
    """torchrun in this process (`torch.distributed.run`, options as its command line takes them) on
    titanlite.train; returns the exit code. A failed job ends in one line (`job_line`) and its exit
    code instead of torchrun's report. SIGTERM and SIGINT stop the ranks cleanly (`Ranks`); SIGUSR1
    kills them (the memory check's stop) and returns 137."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.run import parse_args, run

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_quiet)

    def kill(_signum, _frame):
        # what torchrun's own handlers raise: its agent then stops the ranks with that signal
        raise api.SignalException("stopped by titanlite.launch", sigval=signal.SIGKILL)

    args = parse_args([*torchrun_opts, "-m", "titanlite.train", *train_args])
    ranks, rendezvous = Ranks(), Rendezvous(args.rdzv_endpoint or "this node")
    start, close = api.PContext.start, api.PContext.close
    next_rendezvous = DynamicRendezvousHandler.next_rendezvous

    def start_and_note(context) -> None:
        start(context)
        ranks.started(context)

    def note_and_close(context, *args, **kwargs) -> None:
        ranks.closing(context)
        close(context, *args, **kwargs)

    def join(handler):
        ranks.this_round = False  # a new round (a restart's): what earlier ranks said is not its cause
        return rendezvous.join(handler, next_rendezvous)

    # this process runs one agent: the patches live as long as it
    api.PContext.start, api.PContext.close = start_and_note, note_and_close
    DynamicRendezvousHandler.next_rendezvous = join
    signal.signal(signal.SIGUSR1, kill)
    try:
        run(args)
    except RendezvousError as e:
        # a node whose ranks ran can lose the rendezvous' store after another node ended first (its host
        # node's agent takes the store along): where this node's ranks said why they stopped, that is
        # the job's line, the lost store its consequence
        line, code = ranks.said() or (rendezvous.line(e, ranks_ran=ranks.this_round), FAILURE_EXIT)
        print(line, file=sys.stderr, flush=True)
        return code
    except ChildFailedError as e:
        line, code = job_line(e, ranks.signal, ranks.stopped)
        print(line, file=sys.stderr, flush=True)
        return code
    except api.SignalException as e:
        return 128 + int(e.sigval)
    finally:
        api.PContext.start, api.PContext.close = start, close
        DynamicRendezvousHandler.next_rendezvous = next_rendezvous
    return 0


def job_line(e, stopped_by: signal.Signals | None = None, stopped: set[int] = frozenset()) -> tuple[str, int]:
    """The failed job's one line and exit code, from torchrun's ChildFailedError `e` (this node's ranks).
    The cause, in this order: a rank killed by a signal (the kernel's out-of-memory killer, say),
    whatever the others were doing then (a save, a collective: theirs is a consequence); else the first
    line a rank said (`first_line`); else a rank that exited without one (its traceback is above).
    `stopped`: the local ranks torchrun itself stopped once one had failed, which say nothing of the
    cause. `stopped_by`: the signal passed on to the ranks (`Ranks`); ranks it ended before training
    began (nothing to save yet) stop the job with 128 + N."""
    silent = {rank: f for rank, f in e.failures.items()
              if "exit_code" not in f.error_file_data and f.local_rank not in stopped}
    if stopped_by is not None and silent and all(f.exitcode in (-stopped_by, 128 + stopped_by)
                                                 for f in silent.values()):
        return (f"{stopped_by.name}: the ranks stopped before training began (nothing to save)",
                128 + int(stopped_by))
    where = lambda rank, f: f"rank {rank} (local rank {f.local_rank}, pid {f.pid} on {socket.gethostname()})"
    killed = {rank: f for rank, f in silent.items() if f.exitcode < 0}
    if killed:
        rank, f = min(killed.items())  # one poll of torchrun's finds them all dead: the lowest rank
        sig = signal.Signals(-f.exitcode)
        why = (" (sent unasked, it is most often the kernel's out-of-memory killer: dmesg on that host says)"
               if sig == signal.SIGKILL else "")
        return (f"error: {where(rank, f)} was killed by {sig.name}{why}; the job stopped, checkpoints saved "
                f"before are kept", 128 + int(sig))
    said = first_line(e)
    if said or not silent:
        return said or (f"error: the ranks were stopped ({', '.join(map(str, e.failures))})", FAILURE_EXIT)
    rank, f = min(silent.items())
    return (f"error: {where(rank, f)} exited with code {f.exitcode} without a line (its output above says why); "
            f"the job stopped, checkpoints saved before are kept", f.exitcode)


def first_line(e) -> tuple[str, int] | None:
    """The line and exit code of the first rank that said its failure in one line (its error file,
    `titanlite.errors.say_failure`) in torchrun's ChildFailedError `e`, or None where none did. The
    exit code is the one the rank said: torchrun may have stopped it (SIGTERM) after its line."""
    return earliest({rank: f.error_file_data for rank, f in e.failures.items() if "exit_code" in f.error_file_data})


def earliest(said: dict[int, dict]) -> tuple[str, int] | None:
    """The earliest of the ranks' said failures (rank -> say_failure's record; ties: the lowest rank): its
    line and exit code, or None where there is none."""
    if not said:
        return None
    _, first = min(said.items(), key=lambda rd: (float(rd[1]["timestamp"]), rd[0]))
    return first["message"], int(first["exit_code"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--agent"]:
        rest = sys.argv[2:]
        sys.exit(agent(rest[:rest.index("--")], rest[rest.index("--") + 1:]))
    run_cli(main)
