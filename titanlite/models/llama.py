"""LLaMA flavors: RoPE, RMSNorm, SwiGLU, pre-norm, optional GQA, untied output."""

from titanlite.models.args import ModelArgs

LLAMA_FLAVORS = {
    # CPU-sized: trains to a visibly lower loss in a couple of minutes on two cores.
    "debug": ModelArgs(dim=128, n_layers=4, n_heads=4, vocab_size=2048, ffn_dim=384),
    # GPT-2-small-sized, the bottom of the range titanlite is for: exactly 134,105,856 parameters. Its
    # steps are short, so the host's launch cost shows (benchmarks/step_host_time.py).
    "134M": ModelArgs(dim=768, n_layers=12, n_heads=12, vocab_size=32000, ffn_dim=2048),
    # The LLaMA-2-style 1.36B of the MFU guides users bring from their earlier nanoGPT-style trainer
    # (the name follows them); exactly 1,294,159,104 parameters.
    "1.36B": ModelArgs(dim=2304, n_layers=18, n_heads=18, vocab_size=32000, ffn_dim=6144),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                    rope_theta=500000.0, tie_embeddings=True),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                    rope_theta=500000.0),
}
