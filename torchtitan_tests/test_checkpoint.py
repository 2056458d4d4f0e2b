"""Checkpointing in one process: completion marker, fallback from a corrupted or incomplete newest
checkpoint, retention, async saves, and the errors for bad requests. The multi-process cases (kill -9,
ddp -> fsdp, SIGTERM) are in test_checkpoint_dist.py."""

import logging
import shutil
import subprocess
import sys

import pytest
import torch

from titanlite.checkpoint import complete_steps
from titanlite.config import ConfigError, load_config
from titanlite.train import Trainer

from conftest import ROOT

STEPS = 6


def args(folder, *extra: str) -> list[str]:
    return ["--training.dataset", "synthetic", "--training.steps", str(STEPS), "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2",
            "--metrics.log_freq", "1", "--validation.enable=false", "--metrics.progress_bar=false",
            "--data.num_workers", "0", "--job.dump_folder", str(folder), "--checkpoint.enable",
            "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", *extra]


def losses(trainer) -> dict[int, float]:
    out = {}
    for e in trainer.run_log.data["training_iterations"]:
        for i, v in enumerate(e["step_losses"]):
            out[e["iter"] - len(e["step_losses"]) + 1 + i] = v
    return out


def train(folder, *extra: str) -> Trainer:
    t = Trainer(load_config(args(folder, *extra)))
    t.train()
    t.close()
    return t


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One uninterrupted run with checkpoints every 2 steps, the newest 2 kept."""
    folder = tmp_path_factory.mktemp("base")
    t = train(folder)
    return folder, losses(t)


def copy_run(base, tmp_path):
    folder, expected = base
    shutil.copytree(folder / "checkpoint", tmp_path / "checkpoint")
    return tmp_path, expected


def test_retention_and_marker(base):
    folder, expected = base
    root = folder / "checkpoint"
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6"]  # step-2 dropped (keep_latest_k=2)
    assert complete_steps(root) == [6, 4]
    assert sorted(expected) == list(range(1, STEPS + 1))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble(path):  # same size, so only reading it can tell
    path.write_bytes(b"\0" * path.stat().st_size)


@pytest.mark.parametrize("damage,target", [(_truncate, "__0_0.distcp"), (_garble, ".metadata")])
def test_corrupted_newest_falls_back(base, tmp_path, caplog, damage, target):
    folder, expected = copy_run(base, tmp_path)
    damage(folder / "checkpoint" / "step-6" / target)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        t = Trainer(load_config(args(folder)))
    assert any("step-6 is unusable" in r.message for r in caplog.records), caplog.text
    assert t.state.step == 4  # the previous checkpoint
    t.train()  # training continues (and writes a good step-6 over the bad one)
    t.close()
    assert losses(t) == {5: expected[5], 6: expected[6]}  # exact: the state of step 4 came back whole
    assert complete_steps(folder / "checkpoint") == [6, 4]
    assert Trainer(load_config(args(folder))).state.step == 6


def test_incomplete_newest_is_skipped(base, tmp_path, caplog):
    folder, expected = copy_run(base, tmp_path)
    (folder / "checkpoint" / "step-6" / "complete.json").unlink()  # as if killed while saving
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        t = Trainer(load_config(args(folder)))
    assert "step-6 is incomplete" in caplog.text and t.state.step == 4
    t.close()


def test_async_save_resumes_exactly(base, tmp_path):
    """async_mode=async writes steps 2 and 4 in the background while training goes on; resuming from
    step 4 gives the uninterrupted run's losses bit for bit."""
    _, expected = base
    train(tmp_path, "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "0")
    assert complete_steps(tmp_path / "checkpoint") == [6, 4, 2]
    t = train(tmp_path, "--checkpoint.load_step", "4", "--checkpoint.async_mode", "async_with_pinned_mem")
    assert losses(t) == {5: expected[5], 6: expected[6]}


def test_bf16_moments_resume_exactly(tmp_path):
    """optimizer.moments_dtype=bfloat16 (without bf16_params: MasterAdamW over fp32 parameters) resumes
    bit for bit, and its moments are stored in bf16."""
    whole = losses(train(tmp_path, "--optimizer.moments_dtype", "bfloat16"))
    t = train(tmp_path, "--optimizer.moments_dtype", "bfloat16", "--checkpoint.load_step", "4")
    assert losses(t) == {5: whole[5], 6: whole[6]}
    assert all(st["exp_avg_sq"].dtype == torch.bfloat16 for st in t.optimizer.state.values())


def test_reused_stager_survives_dcp_closing_it(base, tmp_path, monkeypatch):
    """async_with_pinned_mem stages every save through one DefaultStager (pinned buffers on CUDA).
    torch 2.11 closes the inner StateDictStager after each stage, and some versions close the stager
    given to async_save once the write is done; the next save must still work (on the H200 it failed
    with KeyError: <class 'type'>), and the run resumes bit for bit."""
    import torch.distributed.checkpoint as dcp

    real, closed = dcp.async_save, []

    def async_save_that_closes(state, **kw):
        fut = real(state, **kw)
        stager = kw.get("async_stager")
        assert stager is not None, "async_with_pinned_mem saved without its stager"
        stager._state_dict_stager.close()  # what torch 2.11's DefaultStager._stage does after staging
        fut.add_done_callback(lambda _: (stager.close(), closed.append(1)))
        return fut

    monkeypatch.setattr(dcp, "async_save", async_save_that_closes)
    _, expected = base
    train(tmp_path, "--checkpoint.async_mode", "async_with_pinned_mem", "--checkpoint.keep_latest_k", "0")
    assert len(closed) == 2 and complete_steps(tmp_path / "checkpoint") == [6, 4, 2]
    t = train(tmp_path, "--checkpoint.load_step", "4")
    assert losses(t) == {5: expected[5], 6: expected[6]}


def test_bad_requests(base, tmp_path):
    folder, _ = copy_run(base, tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint.load_step=3: no complete checkpoint step-3 .*complete: \[4, 6\]"):
        Trainer(load_config(args(folder, "--checkpoint.load_step", "3")))
    # A checkpoint that does not fit this run's data is an error, not a reason to fall back silently.
    with pytest.raises(ConfigError, match="cannot resume the data stream"):
        Trainer(load_config(args(folder, "--training.seed", "7")))
    for step in (4, 6):
        _truncate(folder / "checkpoint" / f"step-{step}" / "__0_0.distcp")
    with pytest.raises(ConfigError, match=r"no checkpoint under .* could be loaded \(step-6: .*; step-4: "):
        Trainer(load_config(args(folder)))


def test_unwritable_checkpoint_folder_fails_at_startup(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "titanlite.train", *args(tmp_path, "--checkpoint.folder", str(blocker / "ck"))],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: checkpoint.folder '{blocker / 'ck'}' is not writable: Not a directory"]
