"""Training-time data: sharding across ranks, parity across world sizes, exact resume, re-sharding.

The test corpus is an arange of tokens, so the first token of a window names the window.
"""

import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from titanlite.config import ConfigError, load_config
from titanlite.data import build_data, loader
from titanlite.data.shards import ShardWriter, read_meta

from conftest import ROOT, free_port, spawn

SEQ = 8
TOKENS = 20_000  # arange fits uint16; shards of 4001 tokens end mid-window, so windows never cross them


@pytest.fixture(scope="module")
def arange_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data") / "arange"
    with ShardWriter(folder, vocab_size=2**16, shard_tokens=4001) as w:
        w.add("train", np.arange(TOKENS))
        w.add("val", np.arange(2000))
        w.commit({"vocab_size": 2**16, "eos_id": 0, "tokenizer": {"file": "tokenizer.json", "sha256": "arange"}})
    return folder


def cfg_for(folder, batch=2, workers=0, seq=SEQ, extra=()):
    return load_config(["--training.dataset", "prepared", "--training.dataset_path", str(folder),
                        "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
                        f"--data.num_workers={workers}", "--validation.steps", "2", *extra])


def take(it, n):
    return [next(it) for _ in range(n)]


def starts(batches):
    """First token of each row = the window's start position in the arange corpus."""
    return [int(v) for inputs, _ in batches for v in inputs[:, 0]]


def global_rows(folder, dp, batch, steps, **kw):
    """Rows of `steps` micro-batches of every rank, in global-stream order (step, then rank)."""
    its = [build_data(cfg_for(folder, batch, **kw), r, dp).train for r in range(dp)]
    per_rank = [take(it, steps) for it in its]
    return [s for k in range(steps) for r in range(dp) for s in starts([per_rank[r][k]])]


def test_windows_are_consecutive_tokens_inside_one_shard(arange_data):
    data = build_data(cfg_for(arange_data, batch=16), 0, 1)
    inputs, labels = next(data.train)
    assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == labels.shape == (16, SEQ)
    assert torch.equal(labels, inputs + 1) and torch.equal(inputs[:, 1:], inputs[:, :-1] + 1)
    meta = read_meta(arange_data)
    expected = sum((s["tokens"] - 1) // SEQ for s in meta["splits"]["train"]["shards"])
    assert len(data.train.dataset) == expected
    shard_of = lambda t: t // 4001
    assert all(shard_of(s) == shard_of(s + SEQ) for s in starts([(inputs, labels)]))


def test_ranks_split_every_epoch_without_overlap_or_gap(arange_data):
    """3 ranks x batch 2: each epoch's windows are read exactly once, by exactly one rank, and
    the second epoch is a different order of the same windows."""
    n = len(build_data(cfg_for(arange_data), 0, 1).train.dataset)
    rows = global_rows(arange_data, dp=3, batch=2, steps=-(-2 * n // 6))
    epoch0, epoch1 = rows[:n], rows[n : 2 * n]
    windows = {start + SEQ * j for start in range(0, TOKENS, 4001) for j in range((min(4001, TOKENS - start) - 1) // SEQ)}
    assert len(epoch0) == len(set(epoch0)) == n and set(epoch0) == windows
    assert len(set(epoch1)) == n and set(epoch1) == windows and epoch0 != epoch1
    per_rank = [set(starts(take(build_data(cfg_for(arange_data), r, 3).train, n // 6))) for r in range(3)]
    assert not (per_rank[0] & per_rank[1] or per_rank[0] & per_rank[2] or per_rank[1] & per_rank[2])


@pytest.mark.parametrize("dataset", ["prepared", "synthetic"])
def test_same_samples_for_any_split_of_the_global_batch(arange_data, dataset):
    """1 rank x 4 == 2 ranks x 2 == 4 ranks x 1, row for row, step after step."""
    extra = ("--training.dataset", "synthetic", "--training.dataset_path", "") if dataset == "synthetic" else ()
    def rows(dp, b):
        its = [build_data(cfg_for(arange_data, b, extra=extra), r, dp).train for r in range(dp)]
        return [torch.cat([next(it)[0] for it in its]) for _ in range(6)]
    one = rows(1, 4)
    for dp, b in ((2, 2), (4, 1)):
        assert all(torch.equal(a, c) for a, c in zip(one, rows(dp, b)))


RESUME_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from titanlite.config import load_config
from titanlite.data import build_data
results = []
for args, state in torch.load({jobs!r}, weights_only=False):
    it = build_data(load_config(args), 0, 1).train
    it.load_state_dict(state)
    results.append([next(it) for _ in range(50)])
torch.save(results, {out!r})
"""


def assert_same(a, b):
    assert len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_exact_resume_in_a_fresh_process(arange_data, tmp_path):
    """Workers 0 and 2: state saved after 7 batches, restored in another process: the next 50 batches
    (crossing an epoch boundary) equal the uninterrupted run's bit for bit."""
    jobs, expected = [], []
    for workers in (0, 2):
        args = ["--training.dataset", "prepared", "--training.dataset_path", str(arange_data), "--training.seq_len",
                str(SEQ), "--training.local_batch_size", "64", f"--data.num_workers={workers}"]
        it = build_data(load_config(args), 0, 1).train
        take(it, 7)
        state = it.state_dict()
        assert ("loader" in state) == (loader.StatefulDataLoader is not None)
        jobs.append((args, state))
        expected.append(take(it, 50))
        assert it.position > len(it.dataset)  # the 50 batches cross into the second epoch
    torch.save(jobs, tmp_path / "jobs.pt")
    script = RESUME_SCRIPT.format(root=str(ROOT), jobs=str(tmp_path / "jobs.pt"), out=str(tmp_path / "out.pt"))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for got, exp in zip(torch.load(tmp_path / "out.pt"), expected):
        assert_same(got, exp)


def _resume_rank(rank, port, folder, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    it = build_data(cfg_for(folder, batch=2, workers=2), dist.get_rank(), 2).train
    it.load_state_dict(torch.load(f"{out}/state{rank}.pt", weights_only=False))
    got = take(it, 50)
    torch.save(got, f"{out}/got{rank}.pt")
    seen = [None, None]
    dist.all_gather_object(seen, set(starts(got)))
    assert not seen[0] & seen[1], "two ranks read the same window"
    dist.destroy_process_group()


def test_exact_resume_two_ranks_gloo(arange_data, tmp_path):
    """2 ranks x 2 workers: states saved at step 5 are restored by two fresh gloo processes, whose
    next 50 batches equal the uninterrupted ranks' bit for bit."""
    expected = []
    for r in range(2):
        it = build_data(cfg_for(arange_data, batch=2, workers=2), r, 2).train
        take(it, 5)
        torch.save(it.state_dict(), tmp_path / f"state{r}.pt")
        expected.append(take(it, 50))
    spawn(_resume_rank, args=(free_port(), str(arange_data), str(tmp_path)), nprocs=2)
    for r in range(2):
        assert_same(torch.load(tmp_path / f"got{r}.pt"), expected[r])


@pytest.mark.parametrize("new_dp,new_batch", [(1, 4), (4, 1), (3, 1)])
def test_resume_with_another_dp_size_reshards_exactly(arange_data, new_dp, new_batch):
    """Saved by 2 ranks x batch 2 after 5 steps (stream position 20): the resumed ranks read on from
    position 20 with nothing repeated or skipped, as an uninterrupted run of the new shape would."""
    old = [build_data(cfg_for(arange_data, 2), r, 2).train for r in range(2)]
    before = [s for _ in range(5) for it in old for s in starts([next(it)])]
    state = old[0].state_dict()
    assert state["position"] == 20 and old[1].state_dict()["position"] == 20
    new = [build_data(cfg_for(arange_data, new_batch), r, new_dp).train for r in range(new_dp)]
    for it in new:
        it.load_state_dict(state)
    after = [s for _ in range(6) for it in new for s in starts([next(it)])]
    uninterrupted = global_rows(arange_data, dp=1, batch=1, steps=20 + len(after))
    assert before + after == uninterrupted
    assert len(set(before + after)) == len(before + after)


def test_resume_refuses_a_different_stream(arange_data):
    it = build_data(cfg_for(arange_data), 0, 1).train
    take(it, 3)
    state = it.state_dict()
    with pytest.raises(ConfigError, match="seq_len was 8 in the checkpoint and is 16 now"):
        build_data(cfg_for(arange_data, seq=16), 0, 1).train.load_state_dict(state)
    with pytest.raises(ConfigError, match="seed was 42"):
        build_data(cfg_for(arange_data, extra=("--training.seed", "1")), 0, 1).train.load_state_dict(state)


def test_resume_without_torchdata_is_still_exact(arange_data, monkeypatch):
    monkeypatch.setattr(loader, "StatefulDataLoader", None)
    it = build_data(cfg_for(arange_data), 0, 1).train
    take(it, 4)
    state = it.state_dict()
    assert "loader" not in state
    expected = take(it, 10)
    fresh = build_data(cfg_for(arange_data), 0, 1).train
    fresh.load_state_dict(state)
    assert_same(take(fresh, 10), expected)


def test_validation_batches_are_split_across_ranks(arange_data):
    one = list(build_data(cfg_for(arange_data, 4), 0, 1).make_val())
    two = [list(build_data(cfg_for(arange_data, 2), r, 2).make_val()) for r in range(2)]
    assert len(one) == len(two[0]) == len(two[1]) == (2000 - 1) // SEQ // 4
    assert all(torch.equal(a[0], torch.cat([b[0], c[0]])) for a, b, c in zip(one, *two))


@pytest.mark.parametrize("args,message", [
    (["--training.dataset", "prepared"], "training.dataset=prepared needs training.dataset_path"),
    (["--training.dataset", "prepared", "--training.dataset_path", "/nonexistent/x"], "/nonexistent/x does not exist"),
    (["--training.dataset", "synthetic", "--training.dataset_path", "/x"], "dataset_path is read only with"),
])
def test_bad_data_config(args, message):
    with pytest.raises(ConfigError, match=message):
        build_data(load_config(args), 0, 1)


def test_validation_split_smaller_than_a_global_batch_validates_on_what_it_has(arange_data, caplog):
    """249 windows for a global batch of 200 x 2: each rank reads one batch of 124 of them (disjoint,
    248 in all), and rank 0 says so once."""
    with caplog.at_level(logging.INFO, logger="titanlite"):
        ranks = [build_data(cfg_for(arange_data, batch=200), r, 2) for r in (0, 1)]
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("validation:")]
    assert notes == ["validation: the split has 249 windows of 9 tokens, fewer than one global batch (200 x 2): "
                     "each validation reads those 249"]
    batches = [list(d.make_val()) for d in ranks]
    assert [len(b) for b in batches] == [1, 1] and [b[0][0].shape[0] for b in batches] == [124, 124]
    seen = sorted(starts(batches[0]) + starts(batches[1]))
    assert len(set(seen)) == 248 and all(v < 2000 for v in seen)


def test_python_stdlib_is_a_prepared_folder(tmp_cache):
    """The bundled corpus goes through prepare: same meta.json, shards that decode to the source files."""
    from titanlite.data.stdlib_corpus import stdlib_files
    from titanlite.data.tokenizer import load_tokenizer

    data = build_data(load_config(["--training.seq_len", "32", "--training.local_batch_size", "2"]), 0, 1)
    folder = data.train.dataset.folder
    meta = read_meta(folder)
    assert meta["val_every"] == 20 and meta["tokenizer"]["file"] == "tokenizer.json" and meta["dtype"] == "uint16"
    first = np.fromfile(folder / meta["splits"]["train"]["shards"][0]["file"], dtype=np.uint16, count=200_000)
    doc0 = first[: int(np.flatnonzero(first == meta["eos_id"])[0])]
    text = next(t for p in stdlib_files() if (t := p.read_text(encoding="utf-8")))
    assert load_tokenizer(folder / "tokenizer.json").decode(doc0.tolist()) == text
    assert data.tokenizer_path == str(folder / "tokenizer.json")
