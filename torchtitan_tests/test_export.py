"""Hugging Face export and initial load: a DCP checkpoint -> `python -m titanlite.checkpoint.export` ->
transformers' LlamaForCausalLM / Qwen3ForCausalLM gives titanlite's logits (fp32, CPU); the same folder
given to `checkpoint.initial_load_path` gives titanlite's logits exactly."""

import json
import subprocess
import sys

import pytest
import torch

from titanlite.config import ConfigError, load_config
from titanlite.train import Trainer

from conftest import ROOT



def args(folder, name: str, *extra: str) -> list[str]:
    return ["--model.name", name, "--training.dataset", "python_stdlib", "--training.steps", "2",
            "--training.seq_len", "32", "--training.local_batch_size", "2", "--optimizer.lr", "3e-3",
            "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--validation.enable=false",
            "--metrics.progress_bar=false", "--data.num_workers", "0", "--job.dump_folder", str(folder), *extra]


def export(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titanlite.checkpoint.export", *map(str, argv)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("name,hf_class", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_export_matches_transformers_and_loads_back(tmp_cache, name, hf_class):
    transformers = pytest.importorskip("transformers")
    t = Trainer(load_config(args(tmp_cache / "run", name, "--checkpoint.enable")))
    t.train()  # two steps: weights away from their initialisation; the final save is step-2
    t.close()
    hf_dir = tmp_cache / "hf"
    r = export("--checkpoint", tmp_cache / "run" / "checkpoint", "--output", hf_dir)
    assert r.returncode == 0, r.stderr[-2000:]

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    assert type(hf).__name__ == hf_class
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] == t.model_args.tie_embeddings
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != t.model_args.tie_embeddings  # tied: HF ties it itself

    tokens = torch.randint(0, t.model_args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = t.model(tokens)
        theirs = hf(tokens).logits
    assert ours.std() > 0.1  # a real comparison, not two zero tensors
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)

    # The tokenizer travels along and encodes as the training data's did.
    from tokenizers import Tokenizer

    text = "def f(x):\n    return x + 1\n"
    original = Tokenizer.from_file(json.loads((tmp_cache / "run" / "checkpoint" / "step-2" / "complete.json")
                                              .read_text())["tokenizer"])
    assert transformers.AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"] == original.encode(text).ids

    # safetensors -> titanlite: the same logits, exactly (fp32 export is a copy).
    t2 = Trainer(load_config(args(tmp_cache / "again", name, "--checkpoint.initial_load_path", str(hf_dir))))
    with torch.no_grad():
        assert torch.equal(t2.model(tokens), ours)
    t2.close()

    other = "qwen3" if name == "llama" else "llama"
    with pytest.raises(ConfigError, match=f"checkpoint.initial_load_path '{hf_dir}' does not match model {other}/debug"):
        Trainer(load_config(args(tmp_cache / "wrong", other, "--checkpoint.initial_load_path", str(hf_dir))))


def test_export_errors(tmp_path):
    r = export("--checkpoint", tmp_path, "--output", tmp_path / "hf")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: --checkpoint '{tmp_path}' holds no complete checkpoint "
                                             f"(a step-N folder with complete.json)"]


def test_export_refuses_an_existing_output_and_writes_every_file_alike(tmp_cache):
    """As data.prepare: an existing export is replaced only with --overwrite (whole, nothing left of
    it), any other non-empty folder never; one line, exit code 2, nothing touched. Every file gets the
    umask's mode (safetensors' own writer made model.safetensors 0600)."""
    import os
    import stat

    t = Trainer(load_config(args(tmp_cache / "run", "llama", "--checkpoint.enable")))
    t.train()
    t.close()
    ckpt, hf_dir = tmp_cache / "run" / "checkpoint", tmp_cache / "hf"
    umask = os.umask(0o022)
    try:
        assert export("--checkpoint", ckpt, "--output", hf_dir).returncode == 0
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in hf_dir.iterdir()}
        assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
        before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}

        r = export("--checkpoint", ckpt, "--output", hf_dir, "--dtype", "bfloat16")
        assert r.returncode == 2 and r.stderr.splitlines() == [
            f"error: output folder {hf_dir} already holds a Hugging Face model; pass --overwrite to replace it"]
        assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before

        other = tmp_cache / "notes"
        other.mkdir()
        (other / "mine.txt").write_text("keep")
        r = export("--checkpoint", ckpt, "--output", other, "--overwrite")
        assert r.returncode == 2 and r.stderr.splitlines() == [
            f"error: output folder {other} is not empty and holds no Hugging Face model; choose a new folder"]
        assert [p.name for p in other.iterdir()] == ["mine.txt"]

        (hf_dir / "stale.bin").write_bytes(b"x")  # replaced whole: nothing of the old export stays
        r = export("--checkpoint", ckpt, "--output", hf_dir, "--dtype", "bfloat16", "--overwrite")
        assert r.returncode == 0, r.stderr
        assert json.loads((hf_dir / "config.json").read_text())["torch_dtype"] == "bfloat16"
        assert "stale.bin" not in {p.name for p in hf_dir.iterdir()}
        assert {stat.S_IMODE(p.stat().st_mode) for p in hf_dir.iterdir()} == {0o644}
        assert sorted(p.name for p in tmp_cache.iterdir()) == ["hf", "notes", "run"]  # no staging left
    finally:
        os.umask(umask)
