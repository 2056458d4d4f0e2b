"""titanlite: composable-parallelism pre-training of LLaMA/Qwen3-style models in pure PyTorch."""

import os

# Same-seed CPU runs are bit-identical whatever their thread count (torchrun gives each rank one
# thread, a plain run one per core) and from one process to the next: MKL splits a GEMM that reduces
# over many rows (the weight gradients sum over every token) between its threads, so by default its
# rounding follows the thread count; its strict reproducibility mode sums in one fixed order. The
# AVX2 code path, not AUTO's pick: on AVX-512 CPUs AUTO's path still rounded differently in some
# processes (where the buffers landed), the AVX2 one in none. MKL reads this at its first call, hence
# here, at import; a value of your own wins.
os.environ.setdefault("MKL_CBWR", "AVX2,STRICT")
