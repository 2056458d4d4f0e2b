"""Hugging Face layout: titanlite <-> LlamaForCausalLM / Qwen3ForCausalLM names, config.json, safetensors.

titanlite stores RoPE in the rotate-half layout that Hugging Face checkpoints use, so conversion is
a rename: no q/k permutation. One table (HF_NAMES) drives both directions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from tokenizers import Tokenizer
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titanlite.checkpoint.state_file import write_synced
from titanlite.config import ConfigError
from titanlite.models import MODEL_REGISTRY
from titanlite.models.args import ModelArgs
from titanlite.output_folder import StagedFolder

# titanlite name (with {i} for the block index) -> Hugging Face name.
HF_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SHARD_BYTES = 4 * 2**30  # safetensors shard size (Hugging Face's convention is a few GB per file)
HF_MARKER, HF_WHAT = "config.json", "Hugging Face model"  # what an export folder holds, for --overwrite


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_TO_HF = [(_pattern(k), v) for k, v in HF_NAMES.items()]
_FROM_HF = [(_pattern(v), k) for k, v in HF_NAMES.items()]


def _rename(name: str, table) -> str | None:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    return None


def clean_fqn(name: str) -> str:
    """Drop wrapper segments (DDP `module.`, torch.compile `_orig_mod.`, activation checkpointing)."""
    skip = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
    return ".".join(p for p in name.split(".") if p not in skip)


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlite model state (full tensors) -> Hugging Face names; the tied output is dropped."""
    out = {}
    for name, tensor in state.items():
        name = clean_fqn(name)
        if name == "output.weight" and args.tie_embeddings:
            continue  # HF ties lm_head to embed_tokens itself (tie_word_embeddings)
        hf = _rename(name, _TO_HF)
        if hf is None:
            raise ValueError(f"no Hugging Face name for titanlite tensor '{name}'")
        out[hf] = tensor
    return out


def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face names -> titanlite names; a tied model gets output.weight = the embedding."""
    out = {}
    for hf, tensor in state.items():
        if hf.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some older exports carry; titanlite recomputes RoPE
        name = _rename(hf, _FROM_HF)
        if name is None:
            raise ConfigError(f"checkpoint.initial_load_path: tensor '{hf}' has no titanlite counterpart")
        out[name] = tensor
    if "output.weight" not in out and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def hf_config(model_name: str, args: ModelArgs, max_seq_len: int, dtype: torch.dtype,
              tokenizer: dict | None = None) -> dict:
    """config.json for transformers' LlamaForCausalLM / Qwen3ForCausalLM."""
    spec = MODEL_REGISTRY[model_name]
    cfg = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.hf_model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hdim,
        "hidden_act": "silu",
        "max_position_embeddings": max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # transformers >= 5 reads rope_parameters, older releases rope_theta: write both.
        "rope_theta": args.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if spec.hf_model_type == "qwen3":
        cfg.update(use_sliding_window=False, sliding_window=None)
    if tokenizer:
        cfg.update({k: v for k, v in tokenizer.items() if k in ("bos_token_id", "eos_token_id")})
    return cfg


def args_from_hf_config(cfg: dict) -> dict:
    """The ModelArgs fields a config.json fixes (to check it against the configured flavor)."""
    rope = cfg.get("rope_parameters") or {}
    return {"dim": cfg["hidden_size"], "n_layers": cfg["num_hidden_layers"], "n_heads": cfg["num_attention_heads"],
            "vocab_size": cfg["vocab_size"], "ffn_dim": cfg["intermediate_size"],
            "kv_heads": cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            "hdim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            "tie_embeddings": cfg.get("tie_word_embeddings", False),
            "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0))}


def save_safetensors(state: dict[str, torch.Tensor], folder: Path, shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write `model.safetensors`, or numbered shards plus `model.safetensors.index.json` when large.

    Each file is serialized in memory and written as the checkpoint's own files are (state_file), so
    it gets the umask's mode like every other file: safetensors' save_file (0.8) writes through a
    temporary file made for its owner alone (mode 0600) and renames it into place."""
    shards, current, size = [], {}, 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.contiguous()
        size += nbytes
    shards.append(current)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        write_synced(folder / fname, save(shard, metadata={"format": "pt"}))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        weight_map = {k: fname for fname, shard in zip(names, shards) for k in shard}
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return names


def load_safetensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model folder (single file or index + shards)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ConfigError(f"checkpoint.initial_load_path '{folder}' holds no model.safetensors "
                          f"(or model.safetensors.index.json)")
    state = {}
    for f in files:
        state.update(load_file(str(folder / f)))
    return state


def write_tokenizer(tokenizer_path: str, folder: Path) -> dict:
    """Copy a `tokenizers` tokenizer.json next to the weights; return the special-token ids found."""
    shutil.copyfile(tokenizer_path, folder / "tokenizer.json")
    tok = Tokenizer.from_file(tokenizer_path)
    eos = "<|endoftext|>" if tok.token_to_id("<|endoftext|>") is not None else None
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}
    ids = {}
    if eos:
        conf.update(eos_token=eos, bos_token=eos)
        ids = {"eos_token_id": tok.token_to_id(eos), "bos_token_id": tok.token_to_id(eos)}
    (folder / "tokenizer_config.json").write_text(json.dumps(conf, indent=1))
    return ids


def export_hf(state: dict[str, torch.Tensor], model_name: str, args: ModelArgs, max_seq_len: int,
              output: str | os.PathLike, dtype: torch.dtype = torch.float32, tokenizer_path: str = "",
              overwrite: bool = False) -> Path:
    """Write a Hugging Face model folder (safetensors + config.json [+ tokenizer]) from full tensors:
    a new or empty folder, or with `overwrite` one holding an export (its config.json), replaced whole."""
    with StagedFolder(output, overwrite, HF_MARKER, HF_WHAT) as staged:
        folder = staged.path
        hf_state = {k: v.detach().to("cpu", dtype) for k, v in to_hf(state, args).items()}
        save_safetensors(hf_state, folder)
        tok = write_tokenizer(tokenizer_path, folder) if tokenizer_path and os.path.isfile(tokenizer_path) else None
        config = hf_config(model_name, args, max_seq_len, dtype, tok)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        return staged.commit()


def load_hf_into(model: torch.nn.Module, folder: str | os.PathLike, model_info: dict) -> None:
    """checkpoint.initial_load_path: copy Hugging Face safetensors into the (possibly sharded) model.

    Every rank reads the files and keeps its own shard (set_model_state_dict with full tensors), so
    plain, DDP and FSDP models load the same way. The folder's config.json must match the flavor.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint.initial_load_path '{folder}' is not a folder")
    args = ModelArgs(**model_info["args"]) if model_info.get("args") else None
    config_path = folder / "config.json"
    if args is not None and config_path.exists():
        have = args_from_hf_config(json.loads(config_path.read_text()))
        want = {"dim": args.dim, "n_layers": args.n_layers, "n_heads": args.n_heads, "vocab_size": args.vocab_size,
                "ffn_dim": args.ffn_dim, "kv_heads": args.kv_heads, "hdim": args.hdim,
                "tie_embeddings": args.tie_embeddings, "rope_theta": args.rope_theta}
        diff = [f"{k} {have[k]} vs {want[k]}" for k in want if have[k] != want[k]]
        if diff:
            raise ConfigError(f"checkpoint.initial_load_path '{folder}' does not match model "
                              f"{model_info.get('name')}/{model_info.get('flavor')}: {', '.join(diff)}")
    state = from_hf(load_safetensors(folder))
    state = {k: v.float() for k, v in state.items()}  # titanlite keeps fp32 master weights
    try:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    except (RuntimeError, KeyError, ValueError) as e:
        raise ConfigError(f"checkpoint.initial_load_path '{folder}': {str(e).strip().splitlines()[0]}") from None
