"""Qwen3 flavors: LLaMA layout plus RMSNorm on q and k per head (QK-norm), GQA, optional tied embeddings."""

from titanlite.models.args import ModelArgs

QWEN3_FLAVORS = {
    "debug": ModelArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, vocab_size=2048, ffn_dim=384,
                       norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_embeddings=True),
    # The Qwen3 1.8B of the MFU guides users bring from their earlier nanoGPT-style trainer: 24 layers,
    # dim 2048, 16 query / 8 KV heads of 128, FFN 6144, vocab 151936, untied: 1,830,395,904 parameters
    # (1,519,230,976 excluding the input embedding).
    "1.8B": ModelArgs(dim=2048, n_layers=24, n_heads=16, n_kv_heads=8, head_dim=128, vocab_size=151936,
                      ffn_dim=6144, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True),
    # Qwen3-8B's shape: 36 layers, dim 4096, 32 query / 8 KV heads of 128, FFN 12288, vocab 151936,
    # untied: 8,190,735,360 parameters.
    "8B": ModelArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=151936,
                    ffn_dim=12288, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True),
}
