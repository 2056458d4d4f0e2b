import contextlib
import json
import multiprocessing
import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titanlite.train import start_process  # noqa: E402

# The test process starts as a training process does (MKL's reproducible mode before its first call:
# in-process runs are then bit-identical across thread counts, as `python -m titanlite.train` runs are)
start_process()

# Under pytest-xdist (run_tests.sh starts two workers) the workers share the cores: one intra-op thread
# each, and for the commands they start, as torchrun gives each of several ranks. Two pools of one thread
# per core would each spin-wait for cores the other holds (a 70 s run took over 600 s).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """How pytest-xdist shares the tests out (run_tests.sh: --dist loadgroup); a run in one process keeps
    the files' order. The tests that use a module-scoped fixture go to one worker, as one group (each
    worker that ran one of them would build the fixture again: some take 20-50 s). xdist sends the
    groups first, largest first, then the other tests in this order: those marked slow first, so that
    the workers end together instead of one running a long test alone at the end."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    unit = {}
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures and any(d.scope == "module" for defs in fixtures.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
            unit[item] = item.module.__name__
        else:
            unit[item] = item.nodeid
    slow = {unit[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: unit[item] not in slow)  # stable: a module's tests keep their order


_held_alone = []  # the lock files this worker holds while it runs tests marked alone, one after another


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test marked alone runs, its fixtures' setup included, while no other worker runs a test: the
    timings it asserts on would take in the other test's load. Every test passes a turnstile, which an
    alone test holds while it waits (the other worker cannot keep it waiting with test after test), then
    shares the cores lock, which an alone test takes whole and keeps while the next test is alone too."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import fcntl

    alone = item.get_closest_marker("alone") is not None
    if not _held_alone:
        folder = Path(item.config.option.basetemp).parent  # the run's own folder, shared by its workers
        turnstile, cores = open(folder / "turnstile.lock", "w"), open(folder / "cores.lock", "w")
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if alone:
            _held_alone.extend([turnstile, cores])
        else:
            turnstile.close()
    yield
    if not alone:
        cores.close()
    elif nextitem is None or nextitem.get_closest_marker("alone") is None:
        while _held_alone:
            _held_alone.pop().close()  # closing a file releases its lock


# Processes started by `spawn` below fork from one server process that imported these once (a spawned
# process imports torch and titanlite anew: 2-3 s of a core each). Set before the server starts, at its
# first use; a module it cannot import is left for each process to import.
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "titanlite.train"])


def spawn(fn, args: tuple = (), nprocs: int = 2) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs): fn(rank, *args) in `nprocs` new processes, joined, a
    failure in any raised here. Each process forks from the fork server (torch and titanlite imported,
    nothing run) and starts in this process's environment and folder, as a spawned one does."""
    import torch.multiprocessing as mp

    mp.start_processes(_as_spawned, args=(fn, dict(os.environ), os.getcwd(), args), nprocs=nprocs, join=True,
                       start_method="forkserver")


def _as_spawned(rank: int, fn, environ: dict, folder: str, args: tuple) -> None:
    # the fork server's environment and folder are the ones it started with; a spawned process gets the
    # caller's now
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(folder)
    fn(rank, *args)


def concurrently(*calls):
    """Each zero-argument call's result, in order, the calls run two at a time: for independent commands
    whose processes are mostly their single-threaded start-up, which leaves the second core idle when
    they run one after another. An exception in a call is raised here."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: call(), calls))


def child_env(**extra: str) -> dict:
    """The environment of a command a test starts: this process's, titanlite importable from the checkout,
    one intra-op thread per process (its ranks share this machine's cores, with pytest's other worker
    under -n), and `extra` on top."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """Keep the python_stdlib cache shared across tests (it is deterministic) but outputs per test."""
    monkeypatch.setenv("TITANLITE_CACHE", os.environ.get("TITANLITE_CACHE", str(Path.home() / ".cache" / "titanlite")))
    return tmp_path


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, out_dir: str):
    """One rank of a CPU process group as torchrun would set it up, one thread each (the ranks share this
    machine's cores). Yields a dict of results, which rank 0 writes to out_dir/results.json at the end."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    yield results
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()

