"""titanlite's own state in a checkpoint (data loader, RNG streams, lr scheduler, step counters) as
JSON plus safetensors, one pair per rank: `rank_<r>.json` and `rank_<r>.safetensors`.

Nothing here is pickled, and reading uses only `json` and `safetensors`, so loading these files
cannot run code. The JSON holds the structure; tensors and numpy arrays go to the safetensors file
under a key and are referenced from the JSON. The encoding keeps what the objects' own
`load_state_dict` / `setstate` need: tuples stay tuples (Python's and numpy's RNG states), dict
keys that are not strings stay what they were, floats round-trip exactly (JSON writes their repr),
tensors come back with their dtype and device type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from titanlite.checkpoint.integrity import file_checksum

TUPLE, TENSOR, ARRAY, ITEMS = "__tuple__", "__tensor__", "__ndarray__", "__items__"
TAGS = {TUPLE, TENSOR, ARRAY, ITEMS}


def encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able form of `obj`; its tensors are added to `tensors` (CPU copies)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()  # own storage: safetensors refuses shared
        return {TENSOR: key, "device": obj.device.type}
    if isinstance(obj, np.ndarray):  # stored as its raw bytes; dtype and shape in the JSON
        key = str(len(tensors))
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).reshape(-1).view(np.uint8).copy())
        return {ARRAY: key, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, tuple):
        return {TUPLE: [encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not TAGS & obj.keys():
            return {k: encode(v, tensors) for k, v in obj.items()}
        return {ITEMS: [[encode(k, tensors), encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"a {type(obj).__name__} cannot be stored in titanlite's checkpoint state "
                    f"(JSON values, tensors and numpy arrays only)")


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if TENSOR in obj:
        t = tensors[obj[TENSOR]]
        return t.to("cuda") if obj["device"] == "cuda" and torch.cuda.is_available() else t
    if ARRAY in obj:
        raw = tensors[obj[ARRAY]].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if TUPLE in obj:
        return tuple(decode(v, tensors) for v in obj[TUPLE])
    if ITEMS in obj:
        return {decode(k, tensors): decode(v, tensors) for k, v in obj[ITEMS]}
    return {k: decode(v, tensors) for k, v in obj.items()}


def json_name(rank: int) -> str:
    return f"rank_{rank}.json"


def tensors_name(rank: int) -> str:
    return f"rank_{rank}.safetensors"


class EncodedState:
    """One rank's state, encoded when the checkpoint is taken (so an async save writes that moment's
    state, not a later one) and written by `write` from the checkpoint writer."""

    def __init__(self, rank: int, state: dict):
        tensors: dict[str, torch.Tensor] = {}
        self.rank = rank
        self.tree = encode(state, tensors)
        self.tensor_bytes = save_tensors(tensors)

    def write(self, folder: Path, checksums: dict[str, str]) -> None:
        """Write the safetensors file, then the JSON, which also records `checksums` (this rank's
        checksums of the files it wrote, its safetensors file added) for the marker."""
        tpath = folder / tensors_name(self.rank)
        write_synced(tpath, self.tensor_bytes)
        checksums = {**checksums, tpath.name: file_checksum(tpath)}
        doc = {"state": self.tree, "files": checksums}
        write_synced(folder / json_name(self.rank), json.dumps(doc).encode())


def read_state(folder: Path, rank: int) -> dict:
    """The state `rank` saved in `folder` (JSON + safetensors only); errors name the file."""
    name = json_name(rank)
    try:
        doc = json.loads((folder / name).read_text())
        name = tensors_name(rank)
        tensors = load_tensors((folder / name).read_bytes())
        return decode(doc["state"], tensors)
    except Exception as e:
        raise ValueError(f"{name}: {type(e).__name__}: {e}") from None


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
