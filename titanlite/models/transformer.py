"""One decoder-only Transformer for every family in the registry (LLaMA, Qwen3).

Plain nn.Modules with no parallelism inside: titanlite.parallel wraps them from outside.
Build under torch.device("meta"), then `to_empty(device=...)` and `init_weights()`.
RoPE uses the rotate-half layout, the one Hugging Face checkpoints store, so export is a copy.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.models.args import ModelArgs
from titanlite.ops.attention import build_attention
from titanlite.ops.loss import chunked_linear_cross_entropy


# Every scheme starts the loss near ln(vocab), what a uniform guess scores: the logits come out of
# the final RMSNorm (unit RMS per element), so an output matrix of std s gives logits of std
# s * sqrt(dim), which add about (s * sqrt(dim))**2 / 2 nats to the loss. Untied, s = 0.5 / sqrt(dim):
# logits of std 0.5, +0.125 nats (1 / sqrt(dim), torchtitan's, adds 0.5). Tied, the matrix is also the
# input embedding, and while the blocks' outputs are small the normalised hidden state of a token is
# its own embedding scaled to unit RMS: its logit for the input token is s * dim (std 1 / sqrt(dim)
# made it sqrt(dim), 11 for a dim of 128, and the loss started at ln(vocab) + 3.6). s = 1 / dim bounds
# that logit by 1 and leaves the others' std at 1 / sqrt(dim). The blocks' first RMSNorm rescales the
# small embedding, so their inputs are the same as at any other scale.
OUTPUT_LOGIT_STD = 0.5


def _output_std(args: ModelArgs) -> float:
    return 1.0 / args.dim if args.tie_embeddings else OUTPUT_LOGIT_STD / math.sqrt(args.dim)


def _init_scaled(model: "Transformer") -> None:
    """Small embeddings (std 0.02; tied, the output layer's std) and one depth scale for the blocks'
    output projections."""
    args = model.args
    nn.init.normal_(model.tok_embeddings.weight, std=_output_std(args) if args.tie_embeddings else 0.02)
    # Residual-branch outputs get a depth-scaled std so the residual stream's variance stays flat.
    out_std = 0.02 / math.sqrt(2 * args.n_layers)
    for block in model.layers.values():
        for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1,
                    block.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06)
        for lin in (block.attention.wo, block.feed_forward.w2):
            nn.init.trunc_normal_(lin.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


def _init_per_layer(model: "Transformer") -> None:
    """The Llama reference scheme (torchtitan's default too): unit-variance embeddings, and the
    weights that write into the residual stream (wo, w2 and w3, which scales w2's input) shrink with
    each block's own depth, 0.02 / sqrt(2 (layer + 1))."""
    args = model.args
    # tied, the shared matrix is also the output layer: the output layer's std
    nn.init.normal_(model.tok_embeddings.weight, std=_output_std(args) if args.tie_embeddings else 1.0)
    for i, block in enumerate(model.layers.values()):
        for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
            nn.init.trunc_normal_(lin.weight, std=0.02, a=-0.06, b=0.06)
        out_std = 0.02 / math.sqrt(2 * (i + 1))
        for lin in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
            nn.init.trunc_normal_(lin.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


# model.init: how init_weights draws the embedding and the blocks' matrices (norms and an untied
# output layer are the same in every scheme)
INITS = {"scaled": _init_scaled, "per_layer": _init_per_layer}


def rope_cache(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    """(seq_len, head_dim) cos and (seq_len, head_dim) sin, stacked: shape (2, seq_len, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (B, S, H, D); rope: (2, S, D)."""
    cos, sin = rope[0][None, :, None, :], rope[1][None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, attention_backend: str):
        super().__init__()
        self.n_heads, self.n_kv, self.hdim = args.n_heads, args.kv_heads, args.hdim
        self.wq = nn.Linear(args.dim, self.n_heads * self.hdim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv * self.hdim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv * self.hdim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.hdim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.hdim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.hdim, args.norm_eps) if args.qk_norm else None
        self.attn = build_attention(attention_backend)

    def forward(self, x, rope):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.hdim)
        k = self.wk(x).view(b, s, self.n_kv, self.hdim)
        v = self.wv(x).view(b, s, self.n_kv, self.hdim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        return self.wo(self.attn(q, k, v).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, attention_backend: str):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, attention_backend)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(self, x, rope):
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, attention_backend: str = "manual", max_seq_len: int = 2048,
                 loss_chunk_tokens: int = 2048, init: str = "scaled"):
        super().__init__()
        self.args, self.max_seq_len = args, max_seq_len
        self.init = init  # the scheme in INITS that init_weights applies
        self.loss_chunk_tokens = loss_chunk_tokens  # tokens per logits chunk in forward(tokens, labels)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0".."L-1" keeps FQNs stable when blocks are wrapped or compiled.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, attention_backend) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_cache(args.hdim, max_seq_len, args.rope_theta), persistent=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None):
        """Initialise every parameter in place (after to_empty); call under a seeded RNG."""
        device = buffer_device or self.tok_embeddings.weight.device
        if self.args.tie_embeddings:  # to_empty() gives each module a fresh tensor: tie again
            self.output.weight = self.tok_embeddings.weight
        self.rope = rope_cache(self.args.hdim, self.max_seq_len, self.args.rope_theta, device=device)
        INITS[self.init](self)
        for block in self.layers.values():
            for norm in (block.attention_norm, block.ffn_norm, block.attention.q_norm, block.attention.k_norm):
                if norm is not None:
                    norm.reset_parameters()
        self.norm.reset_parameters()
        if not self.args.tie_embeddings:
            std = _output_std(self.args)
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states (B, S, dim): what a fused linear + loss consumes."""
        s = tokens.shape[1]
        if s > self.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds the model's max_seq_len {self.max_seq_len}")
        h = self.tok_embeddings(tokens)
        rope = self.rope[:, :s]
        for block in self.layers.values():
            h = block(h, rope)
        return self.norm(h)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, compile_loss: bool = False) -> torch.Tensor:
        """Logits (B, S, V); with `labels`, the mean cross-entropy instead, through the chunked
        linear + loss that never materialises fp32 logits (it runs inside forward so that wrappers
        such as FSDP have the output weight gathered); `compile_loss` compiles its per-chunk kernel."""
        h = self.hidden_states(tokens)
        if labels is None:
            return self.output(h)
        return chunked_linear_cross_entropy(h, self.output.weight, labels, self.loss_chunk_tokens, compile_loss)
