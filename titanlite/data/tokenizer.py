"""Tokenizers: train a byte-level BPE with `tokenizers`, load a tokenizer.json, find its EOS token."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from titanlite.config import ConfigError

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
DEFAULT_EOS = EOS_CANDIDATES[0]


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | Path) -> None:
    """Train a byte-level BPE (every byte representable, so no unknown tokens) and save it to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[DEFAULT_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, path)


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    if not Path(path).is_file():
        raise ConfigError(f"tokenizer file not found: {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception with a multi-line message
        raise ConfigError(f"cannot load tokenizer {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def vocab_size(tok) -> int:
    """Ids the tokenizer can emit: one more than its largest id (added tokens can leave gaps)."""
    return max(tok.get_vocab_size(with_added_tokens=True), max(tok.get_vocab(with_added_tokens=True).values()) + 1)


def eos_id(tok, name: str = "") -> int:
    """Id of `name`, or of the first known end-of-document token the tokenizer has."""
    for cand in [name] if name else EOS_CANDIDATES:
        i = tok.token_to_id(cand)
        if i is not None:
            return i
    tried = name or ", ".join(EOS_CANDIDATES)
    raise ConfigError(f"tokenizer has no end-of-document token (tried {tried}); pass --eos-token")


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
