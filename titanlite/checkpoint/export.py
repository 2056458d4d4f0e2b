"""Export a DCP checkpoint's model to a Hugging Face folder (safetensors + config.json [+ tokenizer]).

    python -m titanlite.checkpoint.export --checkpoint DIR --output HF_DIR [--dtype float32|bfloat16] [--overwrite]

DIR is one `step-N` folder, or a checkpoint folder (its newest complete step is taken). The result
loads with transformers' LlamaForCausalLM / Qwen3ForCausalLM (AutoModelForCausalLM) and with
titanlite's `--checkpoint.initial_load_path HF_DIR`. Runs in one process on CPU; every file of the
checkpoint is checked against the sizes and checksums in its complete.json first, then only the
model's tensors are read. HF_DIR must be new or empty; --overwrite replaces an earlier export there
(a folder with config.json), whole and only once the new one is written (titanlite.output_folder).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from titanlite.config import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_step_folder(path: str) -> Path:
    from titanlite.checkpoint.layout import MARKER, complete_steps, read_marker

    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--checkpoint '{path}' is not a folder")
    if read_marker(folder) is not None:
        return folder
    steps = complete_steps(folder)
    if not steps:
        raise ConfigError(f"--checkpoint '{path}' holds no complete checkpoint (a step-N folder with {MARKER})")
    return folder / f"step-{steps[0]}"


def load_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The full (unsharded) model tensors of a DCP checkpoint, whatever layout saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from titanlite.checkpoint.manager import DCP_SINGLE_PROCESS_WARNING
    from titanlite.checkpoint.restricted import RestrictedPlanner, RestrictedReader, read_metadata

    metadata = read_metadata(folder / ".metadata")
    model = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS_WARNING)
        dcp.load({"model": model}, storage_reader=RestrictedReader(folder, metadata),
                 planner=RestrictedPlanner(folder), no_dist=True)
    return model


def export(checkpoint: str, output: str, dtype: str = "float32", overwrite: bool = False) -> Path:
    from titanlite.checkpoint.hf import HF_MARKER, HF_WHAT, export_hf
    from titanlite.checkpoint.integrity import verify
    from titanlite.checkpoint.layout import read_marker
    from titanlite.models.args import ModelArgs
    from titanlite.output_folder import check_output

    folder = resolve_step_folder(checkpoint)
    check_output(Path(output), overwrite, HF_MARKER, HF_WHAT)  # before the checkpoint is read
    marker = read_marker(folder)
    if problem := verify(folder, marker):  # sizes and checksums of every file, before any is read
        raise ConfigError(f"checkpoint {folder} is damaged: {problem}")
    info = marker.get("model")
    if not info:
        raise ConfigError(f"{folder} records no model spec: re-save it with this version of titanlite")
    args = ModelArgs(**info["args"])
    return export_hf(load_model_state(folder), info["name"], args, info["max_seq_len"], output,
                     DTYPES[dtype], marker.get("tokenizer", ""), overwrite)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m titanlite.checkpoint.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="step-N folder, or a checkpoint folder (newest step)")
    p.add_argument("--output", required=True, help="Hugging Face model folder to write")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="tensor dtype of the safetensors")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --output")
    a = p.parse_args(argv)
    try:
        out = export(a.checkpoint, a.output, a.dtype, a.overwrite)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # e.g. an output folder that cannot be written
        print(f"error: {e.strerror or e}: {e.filename or a.output}", file=sys.stderr)
        sys.exit(2)
    step = resolve_step_folder(a.checkpoint)
    print(f"wrote {out} from {step} (config.json, safetensors{', tokenizer' if (out / 'tokenizer.json').exists() else ''})")


if __name__ == "__main__":
    main(sys.argv[1:])
