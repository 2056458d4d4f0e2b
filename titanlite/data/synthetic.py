"""Uniform random tokens for throughput runs: no I/O, no tokenizer, deterministic per rank."""

from __future__ import annotations

import torch


class SyntheticBatches:
    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int, rank: int):
        self.vocab_size, self.batch_size, self.seq_len = vocab_size, batch_size, seq_len
        self.seed, self.rank, self.step = seed, rank, 0

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(hash((self.seed, self.rank, self.step)) & 0x7FFF_FFFF)
        self.step += 1
        window = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_len + 1), generator=g)
        return window[:, :-1], window[:, 1:]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]
