"""Checkpointing in one process: completion marker, fallback from a corrupted or incomplete newest
checkpoint, retention, async saves, and the errors for bad requests. The multi-process cases (kill -9,
ddp -> fsdp, SIGTERM) are in test_checkpoint_dist.py."""

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from titanlite.checkpoint import complete_steps
from titanlite.config import ConfigError, load_config
from titanlite.metrics.run_log import step_losses
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
    return step_losses(trainer.run_log.data["training_iterations"])


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


# ---------------------------------------------------------------------------------------- lineage
def test_rollback_then_crash_then_plain_resume_continues_the_new_line(base, tmp_path, monkeypatch):
    """load_step=4 abandons step-6: it is moved, whole, under abandoned-*/ (one log line). The run then
    crashes after saving step-5 of the new line; the plain command resumes step-5 (not the abandoned
    step-6, the newest by number) and gives the uninterrupted run's step-6 loss bit for bit."""
    folder, expected = copy_run(base, tmp_path)
    root = folder / "checkpoint"

    calls = []
    real_step = Trainer.train_step

    def crash_at_second_step(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("crash")  # as if killed: nothing more is written
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_second_step)
    t = Trainer(load_config(args(folder, "--checkpoint.load_step", "4", "--checkpoint.interval", "1")))
    with pytest.raises(RuntimeError, match="crash"):
        t.train()
    t.close()
    monkeypatch.undo()

    aside = list(root.glob("abandoned-*"))
    assert len(aside) == 1 and (aside[0] / "step-6" / "complete.json").exists()
    assert complete_steps(root) == [5, 4]
    old_marker = (aside[0] / "step-6" / "complete.json").read_text()
    # Asking for the abandoned step says where it is.
    with pytest.raises(ConfigError, match=rf"complete: \[4, 5\]\); {aside[0] / 'step-6'} was set aside by an "
                                          rf"earlier resume from an earlier step: move it back to {root} to resume it"):
        Trainer(load_config(args(folder, "--checkpoint.load_step", "6")))

    t = train(folder)  # the plain command
    assert t.start_step == 5
    assert losses(t) == {6: expected[6]}
    assert complete_steps(root) == [6, 5]  # retention (keep 2) kept the new line's newest two
    assert (aside[0] / "step-6" / "complete.json").read_text() == old_marker  # untouched by retention
    assert not (root / "rollback.json").exists()


def test_rollback_interrupted_while_moving_is_finished_by_the_next_start(base, tmp_path, caplog):
    """A run killed after recording the rollback but before moving anything: the next start (plain)
    finishes the move first, so it resumes the step rolled back to, not the abandoned newest."""
    folder, _ = copy_run(base, tmp_path)
    root = folder / "checkpoint"
    (root / "rollback.json").write_text('{"head": 4, "into": "abandoned-x"}')  # what the journal holds then
    with caplog.at_level(logging.INFO, logger="titanlite"):
        t = Trainer(load_config(args(folder)))
    t.close()
    assert t.state.step == 4
    assert (root / "abandoned-x" / "step-6" / "complete.json").exists() and complete_steps(root) == [4]
    assert sum("later checkpoints step-6 are moved to" in r.message for r in caplog.records) == 1


# ------------------------------------------------------------------------------- what is compared
def test_checkpoint_of_another_model_is_one_line_exit_2(base, tmp_path):
    """complete.json's model spec is compared before any load: one line naming both models, exit 2,
    no "unusable ... trying the previous one" chain, nothing moved or deleted."""
    folder, _ = copy_run(base, tmp_path)
    before = sorted(p.name for p in (folder / "checkpoint").iterdir())
    r = subprocess.run([sys.executable, "-m", "titanlite.train", *args(folder, "--model.name", "qwen3")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    error = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert error[0].startswith(f"error: checkpoint {folder / 'checkpoint' / 'step-6'} holds model llama/debug")
    assert error[0].endswith("llama/debug, this run builds qwen3/debug: run the checkpoint's model, or use another "
                             "checkpoint.folder or job.dump_folder"), error[0]
    assert "unusable" not in r.stdout + r.stderr
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == before
    # The same model with another argument: the arguments that differ are named.
    with pytest.raises(ConfigError, match=r"holds model llama/debug \(vocab_size=\d+\), this run builds "
                                          r"llama/debug \(vocab_size=4099\)"):
        Trainer(load_config(args(folder, "--model.vocab_size", "4099")))


def test_resume_with_another_global_batch_warns(base, tmp_path, caplog):
    folder, _ = copy_run(base, tmp_path)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        Trainer(load_config(args(folder, "--checkpoint.load_step", "6"))).close()
    assert "another schedule" not in caplog.text  # the same settings: silent
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        t = Trainer(load_config(args(folder, "--training.local_batch_size", "4", "--training.steps", "8")))
    t.close()
    assert t.state.step == 6
    warned = [r.message for r in caplog.records if "another schedule" in r.message]
    assert warned == ["warning: resuming step-6 with another schedule (global_batch 2 -> 4, training.steps 6 -> 8): "
                      "the lr curve from here on differs from the one the checkpoint was trained on"]


# ------------------------------------------------------------------------------------- integrity
def _overwrite_embedding_rows(step_folder):
    """64 float32 values in the middle of the embedding's bytes, same file size."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_folder)).read_metadata()
    info = next(v for k, v in meta.storage_data.items() if k.fqn == "model.tok_embeddings.weight")
    path = step_folder / info.relative_path
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(info.offset + info.length // 2 // 4 * 4)
        f.write(torch.full((64,), 1234.5).numpy().tobytes())
    assert path.stat().st_size == size
    return info.relative_path


def test_damaged_file_of_the_same_size_is_skipped_and_named(base, tmp_path, caplog):
    folder, expected = copy_run(base, tmp_path)
    step6 = folder / "checkpoint" / "step-6"
    name = _overwrite_embedding_rows(step6)
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        t = Trainer(load_config(args(folder)))
    assert f"step-6 is unusable ({name} is damaged (crc32 " in caplog.text
    assert t.state.step == 4  # the previous checkpoint
    t.train()
    t.close()
    assert losses(t) == {5: expected[5], 6: expected[6]}

    # export checks the same checksums: one line, exit 2
    damaged = next((folder / "checkpoint").glob("abandoned-*/step-6"))
    r = subprocess.run([sys.executable, "-m", "titanlite.checkpoint.export", "--checkpoint", str(damaged),
                        "--output", str(tmp_path / "hf")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: checkpoint {damaged} is damaged: {name} is damaged (crc32 ")
    assert not (tmp_path / "hf").exists()


# -------------------------------------------------------------------------------------- no pickle
def test_per_rank_state_is_json_and_safetensors_and_never_unpickled(base, tmp_path, caplog):
    """titanlite's state (loader, RNG, scheduler, step) is rank_<r>.json + rank_<r>.safetensors; DCP
    holds only model and optimizer. A pickle put in place of the safetensors file (with the marker's
    size and checksum updated, as a forger would) is refused, never run."""
    import json

    from safetensors import safe_open
    from torch.distributed.checkpoint import FileSystemReader

    folder, _ = copy_run(base, tmp_path)
    step6 = folder / "checkpoint" / "step-6"
    doc = json.loads((step6 / "rank_0.json").read_text())
    assert doc["state"]["per_rank"]["dataloader"]["position"] == 6 * 2
    with safe_open(str(step6 / "rank_0.safetensors"), "pt") as f:
        assert len(list(f.keys())) >= 2  # the torch and numpy RNG states
    keys = FileSystemReader(str(step6)).read_metadata().state_dict_metadata
    assert keys and all(k.startswith(("model.", "optimizer.")) for k in keys)

    from titanlite.checkpoint.integrity import file_checksum

    sentinel = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (sentinel.touch, ())

    torch.save({"x": Payload()}, step6 / "rank_0.safetensors")
    marker = json.loads((step6 / "complete.json").read_text())
    marker["files"]["rank_0.safetensors"] = (step6 / "rank_0.safetensors").stat().st_size
    marker["crc32"]["rank_0.safetensors"] = file_checksum(step6 / "rank_0.safetensors")
    (step6 / "complete.json").write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING, logger="titanlite"):
        t = Trainer(load_config(args(folder)))
    t.close()
    assert "step-6 is unusable (ValueError: rank_0.safetensors: " in caplog.text
    assert t.state.step == 4 and not sentinel.exists()


def test_finished_job_run_again_says_so_and_leaves_the_folder_readable(base, tmp_path, caplog, capsys):
    """The same command after the last step (how a job resumes): it says the job is finished, trains
    and logs nothing, and compare, breakdown and plot read the folder (the first run's log)."""
    from titanlite.tools import breakdown, compare, plot

    folder = tmp_path / "job"
    shutil.copytree(base[0], folder)
    logs = sorted(folder.glob("run_*"))
    with caplog.at_level(logging.INFO, logger="titanlite"):
        t = Trainer(load_config(args(folder)))
        summary = t.train()
        t.close()
    assert summary == {"steps": STEPS} and t.run_log is None
    said = caplog.text + capsys.readouterr().out
    assert (f"finished: checkpoint step-{STEPS} under {folder / 'checkpoint'} has reached training.steps ({STEPS}); "
            f"nothing to train") in said
    assert sorted(folder.glob("run_*")) == logs and complete_steps(folder / "checkpoint") == [6, 4]
    assert compare.main([str(folder)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert len(rows) == 1 and rows[0].split()[-1] == next(folder.glob("run_*.json")).name
    assert breakdown.main([str(folder)]) == 0
    assert plot.main([str(folder), "--out", str(tmp_path / "plots")]) == 0


# ------------------------------------------------------------------------ pickles that would run code
class _Shell:
    """Unpickling this runs a shell command that creates `sentinel`."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def _forge(step_folder, changed: list[str]) -> None:
    """Rewrite complete.json's sizes and checksums of the `changed` files, as a forger would."""
    import json

    from titanlite.checkpoint.integrity import file_checksum

    marker = json.loads((step_folder / "complete.json").read_text())
    for name in changed:
        marker["files"][name] = (step_folder / name).stat().st_size
        marker["crc32"][name] = file_checksum(step_folder / name)
    (step_folder / "complete.json").write_text(json.dumps(marker))


def _refused_in_one_line(r, *fragments) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _run(module, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, argv)], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_metadata_whose_unpickling_runs_code_is_refused_by_resume_and_export(base, tmp_path):
    """DCP's .metadata with a pickled os.system call inside an otherwise valid metadata object, the
    marker rewritten to match: resume and export stop with one line naming the file, exit 2, and the
    command never runs; nothing is fallen back to or moved."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    folder, _ = copy_run(base, tmp_path)
    step6 = folder / "checkpoint" / "step-6"
    metadata = FileSystemReader(str(step6)).read_metadata()  # the test's own reading of its own file
    sentinel = tmp_path / "ran"
    metadata.planner_data = {"x": _Shell(sentinel)}
    (step6 / ".metadata").write_bytes(pickle.dumps(metadata))
    _forge(step6, [".metadata"])
    before = sorted(p.name for p in (folder / "checkpoint").iterdir())

    r = _run("titanlite.train", *args(folder))
    _refused_in_one_line(r, f"checkpoint file {step6 / '.metadata'} holds a pickle that calls posix.system",
                         "nothing in it was run")
    assert not re.search(r"^step\s+\d", r.stdout, re.M) and "unusable" not in r.stdout + r.stderr
    r = _run("titanlite.checkpoint.export", "--checkpoint", folder / "checkpoint", "--output", tmp_path / "hf")
    _refused_in_one_line(r, f"{step6 / '.metadata'} holds a pickle that calls posix.system")
    assert not sentinel.exists() and not (tmp_path / "hf" / "model.safetensors").exists()
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == before


def test_optimizer_entry_whose_unpickling_runs_code_is_refused(base, tmp_path):
    """An optimizer hyperparameter (a non-tensor entry DCP torch.saves into the .distcp file) replaced
    by a pickled os.system call: the payload appended to the data file, .metadata pointed at it and
    complete.json rewritten. Resume stops with one line naming the file and the entry; nothing runs.
    Export reads only the model's tensors and still converts the checkpoint."""
    import dataclasses
    import io
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder, _ = copy_run(base, tmp_path)
    step6 = folder / "checkpoint" / "step-6"
    metadata = FileSystemReader(str(step6)).read_metadata()
    key = next(k for k, m in metadata.state_dict_metadata.items()
               if k.startswith("optimizer.param_groups.") and isinstance(m, BytesStorageMetadata))
    index, info = next((i, d) for i, d in metadata.storage_data.items() if i.fqn == key)
    sentinel = tmp_path / "ran"
    payload = io.BytesIO()
    torch.save(_Shell(sentinel), payload)
    data = step6 / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(payload.getvalue()))
    (step6 / ".metadata").write_bytes(pickle.dumps(metadata))
    _forge(step6, [".metadata", info.relative_path])

    r = _run("titanlite.train", *args(folder))
    _refused_in_one_line(r, f"checkpoint file {step6 / info.relative_path} (entry {key}) holds a pickle that calls "
                            f"posix.system")
    assert not sentinel.exists()
    r = _run("titanlite.checkpoint.export", "--checkpoint", step6, "--output", tmp_path / "hf")
    assert r.returncode == 0 and "from " + str(step6) in r.stdout, r.stderr[-2000:]
    assert not sentinel.exists()


OLD = ROOT / "torchtitan_tests" / "data" / "checkpoint_364d93a"


def test_checkpoint_written_before_the_restricted_reader_resumes_exactly(tmp_path, monkeypatch):
    """A checkpoint written by commit 364d93a (DCP read with plain pickle then; made by the script in
    its folder, losses of its run beside it) loads through the restricted reader and its resumed steps
    equal that run's own steps bit for bit, as they equal an uninterrupted run of this code resumed from
    it. (This code's own initial weights differ from that run's: the output layer's init changed.)"""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("make_old_checkpoint", OLD / "make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    ARGS, TINY = make.ARGS, make.TINY
    from titanlite.models import MODEL_REGISTRY

    monkeypatch.setitem(MODEL_REGISTRY["llama"].flavors, "tiny", TINY)
    old_losses = {int(k): v for k, v in json.loads((OLD / "losses.json").read_text()).items()}
    shutil.copytree(OLD / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    t = Trainer(load_config(ARGS + ["--job.dump_folder", str(tmp_path / "resumed")]))
    assert t.state.step == 2
    t.train()
    t.close()
    assert losses(t) == {3: old_losses[3], 4: old_losses[4]}


# ------------------------------------------------------------------------------------- save failure
def _small_tmpfs(path, size: int) -> bool:
    """Mount a tmpfs of `size` bytes at path (root only, where mounting is allowed)."""
    import os

    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_full_disk_is_one_line_and_keeps_the_previous_checkpoint(base, tmp_path, monkeypatch, capsys):
    """The second save hits a full disk (a tmpfs with room for one checkpoint where mounting is
    possible, else an injected ENOSPC): one line naming the cause, exit 1, step-2 intact and loadable,
    no step-4 folder left."""
    import errno

    from titanlite import train as train_module

    one = sum(p.stat().st_size for p in (base[0] / "checkpoint" / "step-6").iterdir())
    disk = tmp_path / "disk"
    mounted = _small_tmpfs(disk, int(one * 1.6))
    if not mounted:
        from titanlite.checkpoint import writer

        disk.mkdir(exist_ok=True)
        real_write = writer._RememberingStream.write

        def write(self, data):
            if "step-4" in str(self._stream.name):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(self, data)

        monkeypatch.setattr(writer._RememberingStream, "write", write)
    try:
        with pytest.raises(SystemExit) as exit_:
            train_module.main(args(disk, "--training.steps", "4", "--checkpoint.keep_latest_k", "3"))
        assert exit_.value.code == 1
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            f"error: checkpoint step-4 could not be saved: No space left on device: {disk / 'checkpoint' / 'step-4'}; "
            f"training stopped, earlier checkpoints are kept (newest: step-2)"], err[-2000:]
        assert "Traceback" not in err and "inline_container" not in err
        root = disk / "checkpoint"
        assert sorted(p.name for p in root.iterdir()) == ["step-2"] and complete_steps(root) == [2]
        t = Trainer(load_config(args(tmp_path / "other", "--checkpoint.folder", str(root))))
        assert t.state.step == 2  # intact: sizes, checksums and DCP all pass
        t.close()
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


def test_state_encoding_round_trips_exactly(tmp_path):
    """What titanlite's per-rank objects hold comes back equal and of the same types: tuples (the RNG
    states), dicts with non-string keys, numpy arrays, tensors of any dtype, NaN, big ints, nested None."""
    import math
    import random

    import numpy as np

    from titanlite.checkpoint.state_file import EncodedState, read_state

    random.seed(3)
    state = {"python": random.getstate(), "numpy": np.random.RandomState(5).get_state(),
             "torch": torch.get_rng_state(), "bf16": torch.randn(3, 2).bfloat16(), "ids": {0: "a", (1, 2): None},
             "loader": {"_snapshot": {"worker_0": {"k": 2**63 + 5, "x": [0.1, float("nan"), -0.0]}}},
             "__tuple__": "a key that looks like a tag"}
    EncodedState(0, state).write(tmp_path, {})
    back = read_state(tmp_path, 0)
    assert back["python"] == state["python"] and isinstance(back["python"][1], tuple)
    random.setstate(back["python"])  # accepted as is
    assert back["numpy"][0] == "MT19937" and np.array_equal(back["numpy"][1], state["numpy"][1])
    assert back["numpy"][1].dtype == state["numpy"][1].dtype and back["numpy"][2:] == state["numpy"][2:]
    assert torch.equal(back["torch"], state["torch"]) and back["bf16"].dtype == torch.bfloat16
    assert torch.equal(back["bf16"], state["bf16"])
    assert back["ids"] == {0: "a", (1, 2): None}
    x = back["loader"]["_snapshot"]["worker_0"]["x"]
    assert back["loader"]["_snapshot"]["worker_0"]["k"] == 2**63 + 5 and x[0] == 0.1 and math.isnan(x[1])
    assert math.copysign(1, x[2]) == -1 and back["__tuple__"] == state["__tuple__"]
    with pytest.raises(TypeError, match="a object cannot be stored"):
        EncodedState(0, {"x": object()})


def test_signal_after_a_peers_stop_still_saves_and_a_real_second_signal_aborts(monkeypatch):
    """A rank told of the stop by a peer's flag, then signalled itself (torchrun signals every rank):
    that is its first signal, so it finishes the step and saves. A second signal of its own, past the
    echo window, aborts."""
    from titanlite.checkpoint import preemption as pre

    clock = [1000.0]
    monkeypatch.setattr(pre.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pre.dist, "all_reduce", lambda t, **kw: t.fill_(1))  # a peer was signalled
    p = pre.Preemption(group=object())
    p.install()
    try:
        assert p.requested() and p.received == "a signal on another rank"
        clock[0] += 10 * pre.REPEAT_GRACE_S
        os.kill(os.getpid(), signal.SIGTERM)  # this rank's own, first signal
        time.sleep(0.05)
        assert p.received == "SIGTERM"
        clock[0] += 10 * pre.REPEAT_GRACE_S
        with pytest.raises(KeyboardInterrupt, match="second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
    finally:
        p.restore()


def test_a_signal_while_the_last_checkpoint_is_written_does_not_cut_it_short(tmp_path, monkeypatch):
    """The handler stays in place until the last save is on disk: a SIGTERM that arrives while the
    run waits for it (a peer had stopped the run, this rank's own signal comes late) is only noted.
    With the default action back in place the process would die there, the save unfinished."""
    from titanlite.checkpoint.manager import Checkpointer

    wait = Checkpointer.wait

    def signalled_wait(self):
        if sys._getframe(1).f_code.co_name == "train":  # the training loop's wait for its last save
            os.kill(os.getpid(), signal.SIGTERM)
        wait(self)

    monkeypatch.setattr(Checkpointer, "wait", signalled_wait)
    t = train(tmp_path)
    assert t.preemption.received == "SIGTERM"
    assert complete_steps(tmp_path / "checkpoint")[0] == STEPS
