"""torchtitan 0.3.0 config functions for float8_fsdp.py: its own LLaMA-3.1-8B (or the anchor's 1.36B) in bf16
and in 0.3.0's float8, at float8_fsdp's settings.

0.3.0 takes a model and its converters only from a Python config function (`--module M --config F`;
`model_spec` is hidden from its command line), and .bench/torchtitan_v030/launch3.py registers the
1.36B alone. float8_fsdp.py copies this file onto the path run.sh gives 0.3.0 (TT3_SITE, its
PYTHONPATH's first folder) and appends `--module tt3_configs --config FUNCTION` to run.sh's own pair:
0.3.0's ConfigManager keeps the last of each. Never imported by titanlite or its tests' processes.

Settings as launch3.llama2_1_36b's (run.sh's 0.3.0 row): AdamW lr 3e-4, warm-up 10, clip 1.0, c4_test
with the anchor's test tokenizer, compile of model and loss, plain cross-entropy (the chunked loss fails
on torch 2.11), no checkpoint, no validation, a log line every 5 steps; fsdp over every GPU. From the
environment (float8_fsdp.py sets them): TT3_BENCH_FLAVOR ("8B": 0.3.0's llama3 registry's own 8B, with
its fused QKV; "1.36B": launch3's), TT3_BENCH_AC (none, selective, full), TT3_ATTN (0.3.0's attention
backend; default flex, its own default, with per-document masks).

0.3.0's float8 (Float8LinearConverter) has the rowwise recipes only ("rowwise", "rowwise_with_gw_hp"):
no tensorwise scaling, no float8 all-gather under FSDP and no scale precompute (0.2.2's
enable_fsdp_float8_all_gather and precompute_float8_dynamic_scale_for_fsdp are gone), so `float8_rowwise`
is 0.3.0's float8 as it ships, not the recipe titanlite and 0.2.2 run.
"""

import dataclasses
import os

try:
    import tt3_shim  # noqa: F401  (torch 2.11 stand-ins, beside launch3.py; launch3 has installed them already)
except ImportError:
    pass

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.trainer import Trainer

SEQ = {"8B": 8192, "1.36B": 2048}
AC = {"none": lambda: None, "selective": SelectiveAC.Config, "full": FullAC.Config}


def _spec(converters: list):
    flavor, attn = os.environ.get("TT3_BENCH_FLAVOR", "8B"), os.environ.get("TT3_ATTN", "flex")
    if flavor == "8B":
        from torchtitan.models.llama3 import model_registry

        return model_registry("8B", attn_backend=attn, converters=converters or None)
    import launch3  # the anchor's 1.36B, as run.sh trains it

    spec = launch3._spec(attn, flavor)
    model = spec.model
    for c in converters:
        model = c.build().convert(model)
    return dataclasses.replace(spec, model=model)


def _config(converters: list) -> Trainer.Config:
    spec = _spec(converters)
    flavor = os.environ.get("TT3_BENCH_FLAVOR", "8B")
    return Trainer.Config(
        hf_assets_path="./tests/assets/tokenizer",
        dump_folder="/tmp/tt3_out",
        model_spec=spec,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10),
        training=TrainingConfig(local_batch_size=2, seq_len=SEQ.get(flavor, 2048), max_norm=1.0, steps=12),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=5),
        parallelism=ParallelismConfig(data_parallel_replicate_degree=1, data_parallel_shard_degree=-1),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=AC[os.environ.get("TT3_BENCH_AC", "none")](),
        compile=CompileConfig(enable=True, components=["model", "loss"]),
        validator=Validator.Config(enable=False),
    )


def bf16() -> Trainer.Config:
    """bf16 through FSDP's mixed-precision policy (0.3.0's default)."""
    return _config([])


def float8_rowwise() -> Trainer.Config:
    """0.3.0's float8: rowwise scales, the output layer (lm_head) left in bf16 as titanlite's and 0.2.2's."""
    from torchtitan.components.quantization import Float8LinearConverter

    return _config([Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["lm_head"],
                                                 model_compile_enabled=True)])
