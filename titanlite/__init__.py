"""titanlite: composable-parallelism pre-training of LLaMA/Qwen3-style models in pure PyTorch.

Importing titanlite, or any module of it, changes no environment variable and installs no warnings
filter: what a training process sets for itself is set where it starts (titanlite.train.start_process).
"""
