"""DCP's file writer with what titanlite adds to each rank's part of a save.

In `write_data`, which runs on every rank in the thread that writes (the caller's for a blocking
save, DCP's background thread for an async one), after DCP's own files:
- this rank's titanlite state (titanlite.checkpoint.state_file);
- the CRC-32 of every file this rank wrote, computed here, by the writing rank, from the page cache
  it just filled, so a save's checksum cost is spread over the ranks and, for async saves, off the
  training thread. They travel in the rank's JSON to rank 0, which puts them into the marker.
An error in here reaches every rank the way DCP reports any write failure.

Failed writes keep their cause: torch.save into a Python stream turns an OSError raised by the
stream (a full disk, a quota) into `RuntimeError: [enforce fail at inline_container.cc] unexpected
pos`, which no longer says why. The streams here remember the OSError, and it is raised instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from titanlite.checkpoint.integrity import file_checksum
from titanlite.checkpoint.state_file import EncodedState


class _RememberingStream:
    """A file object that records the first OSError of a write before passing it on."""

    def __init__(self, stream, fs: "_RememberingFileSystem"):
        self._stream, self._fs = stream, fs

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as e:
            self._fs.error = self._fs.error or e
            raise

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as e:
            self._fs.error = self._fs.error or e
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _RememberingFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.error: OSError | None = None

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _RememberingStream(stream, self)


class StateWriter(FileSystemWriter):
    def __init__(self, path: Path, own_state: EncodedState):
        super().__init__(str(path))
        self.fs = _RememberingFileSystem()
        self.folder, self.own_state = Path(path), own_state

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            results = future.wait()  # DCP's file writer has finished when it returns
        except BaseException:
            if self.fs.error is not None:
                raise self.fs.error from None  # the cause, not torch's "unexpected pos"
            raise
        names = sorted({r.storage_data.relative_path for r in results})
        self.own_state.write(self.folder, {name: file_checksum(self.folder / name) for name in names})
        return future
