"""Training-time data: windows over token shards, the global sample stream, and the stateful loader.

The one idea to keep in mind is the *global stream*. For a given dataset, seq_len and seed, epoch e
is a fixed permutation of all windows (seeded by (seed, e)); the stream is epoch 0's permutation,
then epoch 1's, and so on. Position p of the stream is window perm_{p // N}[p % N].
Data-parallel rank r of dp, with local batch b, reads its k-th micro-batch from stream positions

    start + (k * dp + r) * b  ...  start + (k * dp + r + 1) * b - 1

so each global micro-batch is one contiguous stretch of b * dp positions split among the ranks in
rank order. Consequences, each tested in torchtitan_tests/test_data.py:
- no two ranks ever read the same stream position, and together they read every position: within
  an epoch no window is seen twice and none is skipped;
- an optimizer step of global batch B = b * dp * accum reads positions [s*B, (s+1)*B) however B is
  factored, so 1 rank x local 2b and 2 ranks x local b see the same samples (in the same order
  when concatenated by rank);
- the loader state is one number, `position` (the next unread stream position, the same on every
  rank at a step boundary), so resuming with another dp size or local batch re-shards exactly:
  nothing repeated, nothing skipped.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from titanlite.config import ConfigError
from titanlite.data.shards import windows_in

logger = logging.getLogger("titanlite")

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # the GPU machine may lack torchdata; see TrainLoader._make_loader
    StatefulDataLoader = None


def _pair(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, seq_len + 1) tokens -> contiguous int64 (inputs, labels), ready for pinning."""
    w = torch.from_numpy(rows.astype(np.int64, copy=False))
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


class ShardWindows:
    """Map-style dataset: window i is seq_len + 1 consecutive tokens of one shard of a prepared split.

    Window j of a shard starts at token j * seq_len, so consecutive windows share one token (the last
    label of one is the first input of the next) and every token is trained on. Indexing takes a
    list of window ids and returns a whole (inputs, labels) batch, so a DataLoader worker fetches a
    batch in one call. Shards are memory-mapped lazily in whichever process reads them.
    """

    def __init__(self, folder: str | Path, split: str, seq_len: int, meta: dict):
        self.folder, self.seq_len, self.dtype = Path(folder), seq_len, np.dtype(meta["dtype"])
        shards = meta["splits"][split]["shards"]
        self.files = [s["file"] for s in shards]
        per_shard = [windows_in([s["tokens"]], seq_len) for s in shards]
        self.offsets = np.concatenate([[0], np.cumsum(per_shard, dtype=np.int64)])
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self):  # memmaps are reopened in worker processes, never pickled
        return {**self.__dict__, "_maps": {}}

    def _shard(self, s: int) -> np.ndarray:
        if s not in self._maps:
            self._maps[s] = np.memmap(self.folder / self.files[s], dtype=self.dtype, mode="r")
        return self._maps[s]

    def __getitem__(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.asarray(ids, dtype=np.int64)
        shard = np.searchsorted(self.offsets, ids, side="right") - 1
        starts = (ids - self.offsets[shard]) * self.seq_len
        rows = np.stack([self._shard(int(s))[a : a + self.seq_len + 1] for s, a in zip(shard, starts)])
        return _pair(rows)


class SyntheticWindows:
    """Map-style dataset of uniform random windows: window i is a pure function of (seed, i)."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, num_windows: int = 2**62):
        self.vocab_size, self.seq_len, self.seed, self.num_windows = vocab_size, seq_len, seed, num_windows

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([np.random.default_rng([self.seed, int(i)]).integers(0, self.vocab_size, self.seq_len + 1)
                         for i in ids])
        return _pair(rows)


class StreamSampler:
    """Yields this rank's window ids, one list per micro-batch, from the global stream (module doc).

    It is its own iterator and stateful, so StatefulDataLoader checkpoints it directly.
    """

    def __init__(self, num_windows: int, batch: int, rank: int, world: int, seed: int, shuffle: bool,
                 start: int = 0):
        if num_windows < 1:
            raise ConfigError("the dataset has no window of training.seq_len + 1 tokens; lower training.seq_len")
        self.n, self.batch, self.rank, self.world = num_windows, batch, rank, world
        self.seed, self.shuffle = seed, shuffle
        self.start, self.k = start, 0  # next micro-batch: k-th after stream position `start`
        self._perms: dict[int, np.ndarray] = {}

    def _window(self, positions: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return positions % self.n
        out = np.empty_like(positions)
        for epoch in np.unique(positions // self.n):
            if epoch not in self._perms:
                if len(self._perms) >= 2:  # a batch spans at most two epochs
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = np.random.default_rng([self.seed, int(epoch)]).permutation(self.n)
            sel = positions // self.n == epoch
            out[sel] = self._perms[epoch][positions[sel] % self.n]
        return out

    def __iter__(self):
        return self

    def __next__(self) -> list[int]:
        first = self.start + (self.k * self.world + self.rank) * self.batch
        self.k += 1
        return self._window(np.arange(first, first + self.batch, dtype=np.int64)).tolist()

    def state_dict(self) -> dict:
        return {"start": self.start, "k": self.k}

    def load_state_dict(self, state: dict) -> None:
        self.start, self.k = int(state["start"]), int(state["k"])


@functools.cache
def _warn_no_torchdata() -> None:
    logger.warning("torchdata is not installed (pip install torchdata): using torch.utils.data.DataLoader; "
                   "resume stays exact through the saved stream position")


class TrainLoader:
    """Iterator of (inputs, labels) for one rank, with exact, re-shardable state.

    Batches come from torchdata's StatefulDataLoader (workers, prefetching, pinned memory). Its
    state is saved with ours; on resume with the same layout (dp size, local batch, workers) it is
    restored as is. With a different layout, or without torchdata, the loader is rebuilt at the
    saved stream `position`, which is exact by construction.
    """

    def __init__(self, dataset, *, batch: int, rank: int, world: int, seed: int, shuffle: bool, data_cfg,
                 identity: dict):
        self.dataset, self.batch, self.rank, self.world = dataset, batch, rank, world
        self.seed, self.shuffle, self.cfg = seed, shuffle, data_cfg
        self.identity = identity  # what must not change across a resume (dataset, seq_len, seed)
        self._build(start=0)

    def _build(self, start: int) -> None:
        self.start, self.yielded = start, 0
        self.sampler = StreamSampler(len(self.dataset), self.batch, self.rank, self.world, self.seed,
                                     self.shuffle, start)
        self.loader = self._make_loader()
        self._it = None  # created on first use, after init_distributed has picked the CUDA device

    def _make_loader(self):
        c = self.cfg
        workers = c.num_workers
        kwargs = dict(batch_size=None, sampler=self.sampler, num_workers=workers,
                      pin_memory=c.pin_memory and torch.cuda.is_available())
        if workers > 0:
            kwargs.update(prefetch_factor=c.prefetch_factor, persistent_workers=c.persistent_workers)
        if StatefulDataLoader is not None:
            with warnings.catch_warnings():
                # torchdata 0.11's constructor calls a torch API that newer torch deprecates: harmless, and
                # noisy once per loader (a filter for this call only: importing titanlite installs none)
                warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
                return StatefulDataLoader(self.dataset, **kwargs)
        _warn_no_torchdata()
        return torch.utils.data.DataLoader(self.dataset, **kwargs)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._it is None:
            self._it = iter(self.loader)
        batch = next(self._it)
        self.yielded += 1
        return batch

    @property
    def position(self) -> int:
        """Next unread stream position, assuming every rank has read as many micro-batches as this one."""
        return self.start + self.yielded * self.world * self.batch

    def layout(self) -> dict:
        return {"dp_size": self.world, "local_batch": self.batch, "num_workers": self.cfg.num_workers}

    def state_dict(self) -> dict:
        sd = {"position": self.position, **self.identity, **self.layout()}
        if StatefulDataLoader is not None:
            sd["loader"] = self.loader.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for key, now in self.identity.items():
            if sd.get(key) != now:
                raise ConfigError(f"cannot resume the data stream: {key} was {sd.get(key)!r} in the checkpoint and "
                                  f"is {now!r} now")
        self._build(start=int(sd["position"]))
        same = all(sd.get(k) == v for k, v in self.layout().items())
        if same and "loader" in sd and StatefulDataLoader is not None:
            self.loader.load_state_dict(sd["loader"])
        elif not same:
            old = {k: sd.get(k) for k in self.layout()}
            logger.info(f"data: re-sharding the stream at position {sd['position']:,} from {old} to {self.layout()}")


def val_batches(dataset, batch: int, rank: int, world: int):
    """One pass over the validation windows in order, the same chunking as training.

    Every rank gets the same number of batches (the last partial global batch is dropped), so
    collective ops in forward (FSDP) stay in step. Fewer windows than one global batch make one
    smaller batch per rank, of windows // world each (with fewer windows than ranks, rank r reads
    window r mod windows).
    """
    n = len(dataset)
    if 0 < n < batch * world:
        per = max(1, n // world)
        yield dataset[[(rank * per + i) % n for i in range(per)]]
        return
    for k in range(n // (batch * world)):
        first = (k * world + rank) * batch
        yield dataset[list(range(first, first + batch))]
