"""A folder a command writes whole (a prepared dataset, an exported model).

It is written beside its destination (`.<name>.partial-<pid>`) and moved into place once complete,
so a reader never sees half of one and an interrupted command leaves the destination as it was. An
existing destination is replaced only with --overwrite, and only when it holds what the command
writes (its marker file): another non-empty folder is refused whatever the flags, so a mistyped
path cannot delete someone's files.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from titanlite.errors import ConfigError


def check_output(output: Path, overwrite: bool, marker: str, what: str) -> None:
    """Refuse `output` unless it is new, an empty folder, or (with overwrite) a folder holding
    `marker`, the file that shows it holds a `what` (e.g. "prepared dataset")."""
    if output.exists() and not output.is_dir():
        raise ConfigError(f"output {output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()):
        if not (output / marker).exists():
            raise ConfigError(f"output folder {output} is not empty and holds no {what}; choose a new folder")
        if not overwrite:
            raise ConfigError(f"output folder {output} already holds a {what}; pass --overwrite to replace it")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StagedFolder:
    """`path` is the staging folder to write into; `commit()` moves it to `output`. Used as a context
    manager: leaving the block with an exception removes the staging folder."""

    def __init__(self, output: str | Path, overwrite: bool, marker: str, what: str):
        self.output = Path(output)
        check_output(self.output, overwrite, marker, what)
        self.path = self.output.parent / f".{self.output.name}.partial-{os.getpid()}"
        try:
            self.output.parent.mkdir(parents=True, exist_ok=True)
            self._remove_stale()
            if self.path.exists():
                shutil.rmtree(self.path)
            self.path.mkdir()
        except FileExistsError as e:  # a file where a parent folder should be
            raise ConfigError(f"cannot write the output folder {self.output}: {e.filename} is a file") from None
        except OSError as e:
            raise ConfigError(f"cannot write the output folder {self.output}: {e.strerror or e}") from None

    def _remove_stale(self) -> None:
        """Staging folders of killed commands (their process is gone) are garbage."""
        for p in self.output.parent.glob(f".{self.output.name}.partial-*"):
            pid = p.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        return False

    def commit(self) -> Path:
        """Move the finished folder into place (replacing what check_output allowed to replace)."""
        old = None
        if self.output.exists():  # an empty folder, or one being replaced with --overwrite
            old = self.output.parent / f".{self.output.name}.old-{os.getpid()}"
            os.rename(self.output, old)
        os.rename(self.path, self.output)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.output
