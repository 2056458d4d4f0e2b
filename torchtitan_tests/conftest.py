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

