"""Memory and MFU dry runs on a machine without a GPU.

`python -m estimation --job.config_file X.toml --estimate.ngpu 8 --estimate.hardware h100` builds the
configured model and parallelism on fake tensors with a fake process group, runs forward, backward
and the optimizer step, and reports per-rank memory by category, the largest local batch that fits,
and predicted step time / tokens/s / MFU. See docs/estimation.md.
"""
