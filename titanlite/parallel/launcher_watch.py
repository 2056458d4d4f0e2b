"""Ranks stop when their launcher dies.

torchrun starts every rank detached from it (setsid), so a launcher killed outright (kill -9, the
kernel's OOM killer) takes no rank with it: the ranks would train on unsupervised, keep writing
checkpoints, and race a restarted job over the same folder.

Under torchrun (its agent sets TORCHELASTIC_RUN_ID, which Launch.torchrun records) a daemon thread compares the parent pid with the
launcher's once a second. When the launcher is gone (the rank has been re-parented), the rank sends
itself SIGTERM: the signal torchrun sends its ranks when it shuts down. titanlite's preemption handler
then finishes the step, saves a checkpoint if checkpointing is on, and exits; before the training loop
(or after it) SIGTERM's default action ends the process at once. A rank still alive GRACE_S later,
stuck for instance in a collective whose peer is gone, exits with code 143 (128 + SIGTERM): torchrun
escalates to SIGKILL after the same grace.

Why a thread rather than prctl(PR_SET_PDEATHSIG): the kernel sends that signal when the *thread* that
started the child ends, not its process, and only on Linux; getppid once a second costs nothing.
A process not started by torchrun is not watched: a run under `nohup` must outlive its shell.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from titanlite.parallel.launcher_env import Launch

POLL_S = 1.0
GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL when it stops its ranks
EXIT_CODE = 128 + signal.SIGTERM


def watch_launcher(launch: Launch, poll_s: float = POLL_S, grace_s: float = GRACE_S) -> threading.Thread | None:
    """Start the watch when this process is a torchrun rank (`launch.torchrun`); returns the thread
    (None otherwise)."""
    if not launch.torchrun:
        return None
    thread = threading.Thread(target=_watch, args=(os.getppid(), launch.rank, poll_s, grace_s), name="launcher-watch",
                              daemon=True)
    thread.start()
    return thread


def _say(rank: int, message: str) -> None:
    try:
        print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # the launcher held the other end of our output
        pass


def _watch(launcher: int, rank: int, poll_s: float, grace_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(poll_s)
    _say(rank, f"the launcher (pid {launcher}) is gone: stopping as on SIGTERM")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    _say(rank, f"still running {grace_s:.0f} s after the launcher died: exiting now")
    os._exit(EXIT_CODE)
