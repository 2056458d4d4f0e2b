"""Model hyper-parameters and the analytic counts (parameters, FLOPs) derived from them.

Pure Python, no torch: estimation/ and the config checker use it without building a model.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOPS_CONVENTION = "6*(N - input embedding) + 12*L*H*Q*T"


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    ffn_dim: int
    n_kv_heads: int = 0          # 0 = n_heads (no grouped-query attention)
    head_dim: int = 0            # 0 = dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    qk_norm: bool = False        # Qwen3: RMSNorm on each head's q and k before RoPE
    tie_embeddings: bool = False # output projection shares the input embedding matrix

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hdim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Exact parameter count of titanlite.models.transformer.Transformer for these args."""
        d, q, kv = self.dim, self.n_heads * self.hdim, self.kv_heads * self.hdim
        attn = d * q + 2 * d * kv + q * d + (2 * self.hdim if self.qk_norm else 0)
        block = attn + 3 * d * self.ffn_dim + 2 * d
        embedding = self.vocab_size * d
        output = 0 if self.tie_embeddings else self.vocab_size * d
        total = embedding + self.n_layers * block + d + output
        # With tied weights the shared matrix still does the output matmul, so only the
        # input lookup (free in FLOPs) is excluded; untied, the input table is excluded.
        return total - embedding if exclude_embedding and not self.tie_embeddings else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 * (N - input embedding) + 12 * L * H * Q * T.

        6N counts the forward (2N) and backward (4N) matmuls of every weight that multiplies an
        activation; the input embedding is a lookup, so it is excluded. 12*L*H*Q*T counts the
        attention score and value matmuls (QK^T and PV, 2 * 2 * H*Q*T forward, twice that in
        backward) without halving for the causal mask, the convention of torchtitan and PaLM.
        """
        return 6 * self.num_params(exclude_embedding=True) + 12 * self.n_layers * self.n_heads * self.hdim * seq_len


def mfu_pct(tokens_per_sec: float, flops_per_token: float, n_gpus: int, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation in percent: achieved FLOP/s over all GPUs' dense bf16 peak.

    `tokens_per_sec` is the whole run's rate (all GPUs) and `flops_per_token` follows
    FLOPS_CONVENTION; `peak_tflops` is one GPU's dense bf16 peak (titanlite.hardware). None when
    the peak is unknown.
    """
    if not peak_tflops:
        return None
    return 100 * tokens_per_sec * flops_per_token / (n_gpus * peak_tflops * 1e12)
