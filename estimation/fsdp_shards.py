"""FSDP's sharding of a parameter, for one fake rank out of thousands.

FSDP shards a parameter by chunking it into one piece per rank of its shard group (torch.chunk,
padded with empty tensors to the group's size: `_chunk_with_empty`), then keeps chunk 0's size
(the padded shard) and its own rank's chunk. On fake tensors every piece is a fake tensor made by a
dispatched op, so a fake run of N ranks made N of them per parameter: 16384 ranks took minutes for
the debug model. Here the pieces are made when read, the two FSDP reads: the same tensors, the
same shapes and views, whatever the rank count.
"""

from __future__ import annotations

import contextlib

import torch


class LazyChunks:
    """The list `_chunk_with_empty(tensor, num_chunks, dim)` returns, each entry built when indexed."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int):
        self.tensor, self.n, self.dim = tensor, num_chunks, dim
        self.size = -(-tensor.size(dim) // num_chunks)  # torch.chunk's chunk length: ceil(length / n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start, length = i * self.size, self.tensor.size(self.dim)
        if start >= length:  # past the last piece torch.chunk makes: one of the padding empties
            return self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, min(self.size, length - start))


@contextlib.contextmanager
def fsdp_chunks_on_demand():
    """While active, FSDP (fully_shard and its lazy init) chunks parameters with LazyChunks. A torch
    whose FSDP has no `_chunk_with_empty` is left as it is."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

    orig = getattr(fsdp_param, "_chunk_with_empty", None)
    if orig is None:
        yield
        return

    def chunks(tensor, num_chunks, dim):  # an empty dimension: torch.chunk's own answer, n empty pieces
        return LazyChunks(tensor, num_chunks, dim) if tensor.size(dim) else orig(tensor, num_chunks, dim)

    fsdp_param._chunk_with_empty = chunks
    try:
        yield
    finally:
        fsdp_param._chunk_with_empty = orig
