"""Model registry. Importing this package does not import torch; build_model does."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanlite.models.args import ModelArgs
from titanlite.models.llama import LLAMA_FLAVORS
from titanlite.models.qwen3 import QWEN3_FLAVORS


@dataclass(frozen=True)
class ModelSpec:
    flavors: dict[str, ModelArgs]
    hf_architecture: str  # Hugging Face class the safetensors export targets
    hf_model_type: str


MODEL_REGISTRY: dict[str, ModelSpec] = {
    "llama": ModelSpec(LLAMA_FLAVORS, "LlamaForCausalLM", "llama"),
    "qwen3": ModelSpec(QWEN3_FLAVORS, "Qwen3ForCausalLM", "qwen3"),
}


def get_model_args(name: str, flavor: str, vocab_size: int = 0) -> ModelArgs:
    args = MODEL_REGISTRY[name].flavors[flavor]
    return dataclasses.replace(args, vocab_size=vocab_size) if vocab_size else args


def build_model(args: ModelArgs, attention_backend: str = "manual", max_seq_len: int = 2048,
                loss_chunk_tokens: int = 2048, init: str = "scaled"):
    """Build the plain nn.Module. Call under `torch.device("meta")`, then to_empty + init_weights.

    `attention_backend` must be a concrete name (titanlite.ops.attention.resolve_backend).
    """
    from titanlite.models.transformer import Transformer

    return Transformer(args, attention_backend, max_seq_len, loss_chunk_tokens, init)
