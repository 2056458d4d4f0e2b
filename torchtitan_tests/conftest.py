import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """Keep the python_stdlib cache shared across tests (it is deterministic) but outputs per test."""
    monkeypatch.setenv("TITANLITE_CACHE", os.environ.get("TITANLITE_CACHE", str(Path.home() / ".cache" / "titanlite")))
    return tmp_path
