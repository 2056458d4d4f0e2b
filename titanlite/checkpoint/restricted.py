"""Reading DCP's pickled parts without running code from the checkpoint.

DCP pickles two things: the `.metadata` file (its own dataclasses describing every entry) and the
non-tensor entries of the optimizer state (per-parameter hyperparameters, `torch.save`d into the
`.distcp` files). DCP itself reads them with `pickle.load` and `torch.load(weights_only=False)`,
which run whatever callable the pickle names. Here:
- `.metadata` goes through `RestrictedUnpickler`, which resolves only what a checkpoint's metadata
  holds: DCP's dataclasses and enums, torch sizes, dtypes and layouts, paths, plain containers;
- the optimizer's entries go through torch's weights-only loader (tensors, numbers, strings and
  plain containers).
Anything else stops the load with `UnsafeCheckpointError` naming the file, before any of it runs.
Tensors are read by DCP with `weights_only=True` already.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import re
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from titanlite.config import ConfigError

DCP_PACKAGE = "torch.distributed.checkpoint."
# Callables a checkpoint's metadata names besides DCP's own classes: what each builds is inert.
ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
           ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
           ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}
TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file holds a pickle that would call something a titanlite checkpoint never holds."""


def refusal(path: Path | str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"checkpoint file {path} holds a pickle that calls {what}, which a titanlite "
                                 f"checkpoint never contains: refused, nothing in it was run")


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the classes and constants of DCP's metadata (`path`: the file
    read, for the message)."""

    def __init__(self, file, path: Path | str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), TORCH_CONSTANTS):
            return getattr(torch, name)
        owner = sys.modules.get(module)  # DCP's modules are imported already: nothing is imported here
        if module.startswith(DCP_PACKAGE) and owner is not None:
            obj = getattr(owner, name, None)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise refusal(self.path, f"{module}.{name}")


def read_metadata(path: Path | str) -> Metadata:
    """DCP's `.metadata` file, unpickled with the RestrictedUnpickler."""
    with open(path, "rb") as f:
        try:
            metadata = RestrictedUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # truncated or garbled: DCP's own reading would fail the same way
            raise ValueError(f"{Path(path).name} is unreadable: {type(e).__name__}: {e}") from None
    if not isinstance(metadata, Metadata):
        raise refusal(path, f"something that builds a {type(metadata).__name__} instead of DCP's Metadata")
    return metadata


class RestrictedReader(FileSystemReader):
    """DCP's file reader with the metadata read by `read_metadata`, or given (read already, before
    DCP's load: torch 2.13's load logs a failed metadata read and falls back to other files)."""

    def __init__(self, path: Path | str, metadata: Metadata | None = None):
        super().__init__(str(path))
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if self.metadata is not None and rank is None:
            metadata = self.metadata
        else:
            metadata = read_metadata(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class RestrictedPlanner(DefaultLoadPlanner):
    """DCP's load planner with the non-tensor entries read by torch's weights-only loader (`folder`:
    the checkpoint's, for the message)."""

    def __init__(self, folder: Path | str, **kwargs):
        super().__init__(**kwargs)
        self.folder = Path(folder)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = self.folder / str(getattr(info, "relative_path", "?"))
            found = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch names the global it refused
            what = found.group(1) if found else "a callable torch's weights-only loader refuses"
            raise refusal(f"{where} (entry {read_item.dest_index.fqn})", what) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def unsafe_cause(error: BaseException) -> UnsafeCheckpointError | None:
    """The UnsafeCheckpointError behind `error`, also when DCP wrapped it per rank (CheckpointException)."""
    if isinstance(error, UnsafeCheckpointError):
        return error
    for failure in getattr(error, "failures", {}).values():
        e = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(e, UnsafeCheckpointError):
            return e
    return None
