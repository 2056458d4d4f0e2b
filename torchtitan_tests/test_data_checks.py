"""Start-up checks of a prepared dataset: a damaged shard or a token id beyond the vocabulary is one
line and exit 2 before step 1 (through `python -m titanlite.train`); a one-document corpus gets a
validation split; and following the advice of every data error leads to a run that trains."""

import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from titanlite.config import ConfigError, load_config
from titanlite.data import build_data, prepare, shards
from titanlite.data.tokenizer import train_bpe
from titanlite.train import Trainer

from conftest import ROOT

SHARED_CACHE = os.environ.get("TITANLITE_CACHE", str(Path.home() / ".cache" / "titanlite"))  # python_stdlib's
TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(400))  # one document


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe([TEXT], 300, path)
    return path


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "one.txt").write_text(TEXT)
    return tmp_path / "one.txt"


@pytest.fixture
def docs(tmp_path):
    """40 documents: a validation split of whole documents, as the first format made it too."""
    lines = TEXT.splitlines(keepends=True)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": "".join(lines[i::40])}) + "\n" for i in range(40)))
    return tmp_path / "docs.jsonl"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The verified-shards record of each test in its own cache (children inherit the variable)."""
    monkeypatch.setenv("TITANLITE_CACHE", str(tmp_path / "cache"))


def prepared(corpus, tokenizer, out, *args):
    prepare.main(["--input", str(corpus), "--output", str(out), "--tokenizer", str(tokenizer), "--workers", "1", *args])
    return out


def argv(folder, *args):
    """Two steps of the debug model on a prepared folder, validating at the end."""
    return ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--training.dataset", "prepared",
            "--training.dataset_path", str(folder), "--training.seq_len", "16", "--training.local_batch_size", "2",
            "--training.steps", "2", "--metrics.log_freq", "1", "--validation.steps", "1",
            "--job.dump_folder", str(folder.parent / "run"), *args]


def train(folder, *args):
    """`python -m titanlite.train`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "titanlite.train", *argv(folder, *args)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def trains(folder, *args, validates=True):
    """The same run in this process (quicker): it trains its two steps, and validates unless disabled."""
    t = Trainer(load_config(argv(folder, *args)))
    try:
        summary = t.train()
    finally:
        t.close()
    assert summary["steps"] == 2 and np.isfinite(summary["final_loss"])
    assert (summary.get("val_loss") is not None) == validates


def refused_before_step_one(r, *fragments) -> str:
    """Exit 2, one line on stderr (no traceback), no step trained; returns the line."""
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not re.search(r"^step\s+\d", r.stdout, re.M), r.stdout
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def refusal(folder, *args) -> str:
    """The one-line error with which a run (in this process) stops while it is being set up."""
    with pytest.raises(ConfigError) as e:
        Trainer(load_config(argv(folder, *args)))
    assert "\n" not in str(e.value)
    return str(e.value)


def edit_meta(folder, change):
    meta = json.loads((folder / "meta.json").read_text())
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def as_version_1(meta):
    """The metadata that the first format wrote: no CRC32 or largest id per shard."""
    meta["version"] = 1
    meta.pop("val_from", None)
    for split in meta["splits"].values():
        for shard in split["shards"]:
            shard.pop("crc32", None), shard.pop("max_id", None)


def put_token(path, index, value):
    ids = np.fromfile(path, dtype=np.uint16)
    ids[index] = value
    ids.tofile(path)


# ---------------------------------------------------------------------------------------- bad shards
def test_damaged_shard_is_refused_before_step_one(tmp_path, docs, tokenizer):
    """One byte of a shard changed (same size): the run stops at start-up, naming the shard."""
    folder = prepared(docs, tokenizer, tmp_path / "data", "--val-every", "8")
    trains(folder)  # verified and recorded: the check must not trust the record after a write
    time.sleep(0.05)  # file times have clock-tick granularity: the write must fall in a later tick
    with open(folder / "train_00000.bin", "r+b") as fh:
        fh.seek(101)
        byte = fh.read(1)
        fh.seek(101)
        fh.write(bytes([byte[0] ^ 0x40]))
    refused_before_step_one(train(folder), f"shard {folder}/train_00000.bin is damaged: its CRC32 is")


@pytest.mark.parametrize("version", [1, 2])
def test_token_id_beyond_the_vocabulary_is_refused_before_step_one(tmp_path, docs, tokenizer, version):
    """A shard holding id 1000 with a vocabulary of 300 (model and tokenizer): without the check the
    embedding lookup fails mid-run (IndexError; a device-side assert on a GPU). Version 1 folders
    (no checksums) are scanned for it; version 2 records each shard's largest id."""
    folder = prepared(docs, tokenizer, tmp_path / "data", "--val-every", "8")
    put_token(folder / "train_00000.bin", slice(5, None, 16), 1000)  # in every window: step 1 would read it
    if version == 1:
        edit_meta(folder, as_version_1)
    else:  # a meta.json consistent with the shard's bytes, as a tool other than prepare might write it
        crc, top = zlib.crc32((folder / "train_00000.bin").read_bytes()), 1000
        edit_meta(folder, lambda m: m["splits"]["train"]["shards"][0].update(crc32=crc, max_id=top))
    refused_before_step_one(train(folder, "--model.vocab_size", "300"),
                            f"shard {folder}/train_00000.bin holds token id 1000, beyond the dataset's "
                            "vocabulary of 300")


def test_version_1_folder_still_trains_with_a_note(tmp_path, docs, tokenizer, caplog):
    folder = prepared(docs, tokenizer, tmp_path / "data", "--val-every", "8")
    edit_meta(folder, as_version_1)
    with caplog.at_level(logging.INFO, logger="titanlite"):
        trains(folder)
    notes = [r.message for r in caplog.records if "prepared without checksums" in r.message]
    assert len(notes) == 1 and "its bytes are unverified" in notes[0]


def test_shards_are_read_once_per_machine(tmp_path, docs, tokenizer, monkeypatch):
    """The second start reads no shard; a rewritten shard file is read again."""
    folder = prepared(docs, tokenizer, tmp_path / "data", "--val-every", "8")
    reads = []
    scan = shards.scan_shard
    monkeypatch.setattr(shards, "scan_shard", lambda path, dtype: reads.append(path.name) or scan(path, dtype))
    cfg = load_config(["--training.dataset", "prepared", "--training.dataset_path", str(folder),
                       "--training.seq_len", "16", "--training.local_batch_size", "2"])
    build_data(cfg, 0, 1)
    assert sorted(reads) == ["train_00000.bin", "val_00000.bin"]
    build_data(cfg, 0, 1)
    assert len(reads) == 2
    time.sleep(0.05)  # a later clock tick for the file times
    ids = np.fromfile(folder / "val_00000.bin", dtype=np.uint16)
    ids.tofile(folder / "val_00000.bin")  # the same bytes, written again
    build_data(cfg, 0, 1)
    assert reads[2:] == ["val_00000.bin"]


def _verify_counting_reads(folder, barrier, out):
    """Child process: verify `folder` at the same moment as a sibling, each read slowed down, and
    write how many shard files this process read."""
    reads = []
    scan = shards.scan_shard

    def slow(path, dtype):
        reads.append(path)
        time.sleep(0.5)
        return scan(path, dtype)

    shards.scan_shard = slow
    meta = shards.read_meta(folder)
    barrier.wait()
    shards.verify_shards(folder, meta)
    Path(out).write_text(str(len(reads)))


def test_ranks_of_one_machine_read_the_shards_once_between_them(tmp_path, docs, tokenizer):
    import multiprocessing as mp

    folder = prepared(docs, tokenizer, tmp_path / "data", "--val-every", "8", "--shard-tokens", "2000")
    n = sum(len(s["shards"]) for s in json.loads((folder / "meta.json").read_text())["splits"].values())
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_verify_counting_reads, args=(folder, barrier, tmp_path / f"reads{i}"))
             for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(int((tmp_path / f"reads{i}").read_text()) for i in range(2)) == [0, n] and n > 1


def test_prepare_records_checksum_and_largest_id(tmp_path, docs, tokenizer):
    folder = prepared(docs, tokenizer, tmp_path / "data", "--val-every", "8", "--shard-tokens", "500")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["version"] == 2 and meta["val_from"] == "documents"
    for split in ("train", "val"):
        assert len(meta["splits"][split]["shards"]) > 1
        for shard in meta["splits"][split]["shards"]:
            ids = np.fromfile(folder / shard["file"], dtype=np.uint16)
            assert shard["max_id"] == ids.max() < meta["vocab_size"] and len(ids) == shard["tokens"]
            assert shard["crc32"] == zlib.crc32((folder / shard["file"]).read_bytes())


# ---------------------------------------------------------------------------------------- one document
def test_one_document_gets_the_tail_as_validation_split(tmp_path, corpus, tokenizer, capsys):
    """A single .txt (fewer documents than --val-every): the last 1/val_every of its tokens, cut from
    the end of the token stream, are the validation split, with a line saying so; training runs."""
    whole = prepared(corpus, tokenizer, tmp_path / "whole", "--val-every", "0")
    folder = prepared(corpus, tokenizer, tmp_path / "data", "--val-every", "8", "--shard-tokens", "300")
    assert "the corpus has 1 document, fewer than --val-every 8, so it is the last" in capsys.readouterr().out
    meta = json.loads((folder / "meta.json").read_text())
    stream = lambda f, split: np.concatenate([np.fromfile(f / s["file"], dtype=np.uint16) for s in
                                              json.loads((f / "meta.json").read_text())["splits"][split]["shards"]])
    total = np.fromfile(whole / "train_00000.bin", dtype=np.uint16)
    val, train_ids = stream(folder, "val"), stream(folder, "train")
    assert meta["val_from"] == "tail" and len(val) == len(total) // 8 == meta["splits"]["val"]["tokens"]
    assert np.array_equal(np.concatenate([train_ids, val]), total)
    trains(folder)


def test_val_every_1_is_refused(tmp_path, corpus, tokenizer):
    with pytest.raises(ConfigError, match="--val-every must be 0 .* or at least 2"):
        prepared(corpus, tokenizer, tmp_path / "data", "--val-every", "1")


# ---------------------------------------------------------------------------------------- advice works
def follow_prepare(line, corpus, *options_used_before):
    """Run the `python -m titanlite.data.prepare ...` command that an error line gives, on `corpus`."""
    command = re.search(r"(python -m titanlite\.data\.prepare .*)$", line).group(1).replace("CORPUS", str(corpus))
    prepare.main(shlex.split(command)[3:] + list(options_used_before) + ["--workers", "1"])


def option(line, pattern):
    return re.search(pattern, line).group(1)


def test_one_document_validates_at_default_settings(tmp_path, corpus, tokenizer, caplog):
    """The default --val-every on a one-document corpus keeps a tenth of it (here less than a global
    batch of 2048-token windows) for validation; a run validates, and one whose global batch exceeds
    the windows there validates on those and says so."""
    folder = prepared(corpus, tokenizer, tmp_path / "data")
    meta = json.loads((folder / "meta.json").read_text())
    total = sum(meta["splits"][s]["tokens"] for s in ("train", "val"))
    assert meta["val_from"] == "tail" and meta["splits"]["val"]["tokens"] == total // 10
    trains(folder, "--training.local_batch_size", "8")
    windows = (total // 10 - 1) // 16
    with caplog.at_level(logging.INFO, logger="titanlite"):
        trains(folder, "--training.local_batch_size", str(windows + 1))
    assert (f"validation: the split has {windows} windows of 17 tokens, fewer than one global batch "
            f"({windows + 1} x 1): each validation reads those {windows}") in caplog.text


def test_advice_without_a_validation_split(tmp_path, corpus, tokenizer):
    folder = prepared(corpus, tokenizer, tmp_path / "data", "--val-every", "0")
    line = refusal(folder)
    assert "the validation split has no window of training.seq_len + 1 = 17 tokens" in line
    n = option(line, r"prepare the dataset again with --val-every (\d+) \(it was 0\)")
    prepared(corpus, tokenizer, folder, "--val-every", n, "--overwrite")
    trains(folder)


def test_advice_on_a_corpus_too_small_for_validation(tmp_path, tokenizer):
    (tmp_path / "small.txt").write_text(TEXT[:200])
    folder = prepared(tmp_path / "small.txt", tokenizer, tmp_path / "data", "--val-every", "0")
    line = refusal(folder, "--training.local_batch_size", "4")
    assert "too small for one validation batch beside training; set validation.enable=false" in line
    trains(folder, "--training.local_batch_size", "4", "--validation.enable=false", validates=False)
    assert "--val-every" not in line


def test_advice_on_shards_shorter_than_a_window(tmp_path, corpus, tokenizer):
    """--shard-tokens below seq_len + 1: both the lower seq_len and the larger shards train."""
    corpus.write_text(TEXT[:3000])  # fewer shard files
    folder = prepared(corpus, tokenizer, tmp_path / "data", "--val-every", "8", "--shard-tokens", "12")
    line = refusal(folder)
    assert "the train split has no window of training.seq_len + 1 = 17 tokens" in line
    trains(folder, "--training.seq_len", option(line, r"lower training\.seq_len to (\d+) or less"))
    shard_tokens = option(line, r"--shard-tokens (\d+) or more")
    prepared(corpus, tokenizer, folder, "--val-every", "8", "--shard-tokens", shard_tokens, "--overwrite")
    trains(folder)


@pytest.mark.parametrize("damage", ["byte", "size", "meta"])
def test_advice_on_a_damaged_folder(tmp_path, corpus, tokenizer, damage):
    """The command a damaged folder's error gives rebuilds it so that the run trains."""
    folder = prepared(corpus, tokenizer, tmp_path / "data", "--val-every", "8")
    before = json.loads((folder / "meta.json").read_text())
    shard = folder / "train_00000.bin"
    if damage == "byte":
        put_token(shard, 7, 3)
    elif damage == "size":
        shard.write_bytes(shard.read_bytes()[:-2])
    else:
        (folder / "meta.json").write_text("{")
    line = refusal(folder)
    assert str(folder) in line
    if damage == "meta":  # nothing tells which options were used: the line says to give them again
        assert "with the options used before" in line
    follow_prepare(line, corpus, *(["--val-every", "8"] if damage == "meta" else []))
    after = json.loads((folder / "meta.json").read_text())
    assert after["tokenizer"] == before["tokenizer"] and after["splits"] == before["splits"]  # a checkpoint resumes
    trains(folder)


def test_advice_for_python_stdlib(monkeypatch):
    """python_stdlib is fixed: the advice is about the run (a shorter window), and it validates."""
    from titanlite.data.stdlib_corpus import prepare_stdlib

    monkeypatch.setenv("TITANLITE_CACHE", SHARED_CACHE)
    meta = json.loads((prepare_stdlib(2048) / "meta.json").read_text())
    longest = max(s["tokens"] for s in meta["splits"]["val"]["shards"])
    args = ["--training.seq_len", str(longest)]  # no validation window of seq_len + 1 tokens
    with pytest.raises(ConfigError, match="set validation.enable=false, or lower training.seq_len to") as e:
        build_data(load_config(args), 0, 1)
    seq_len = option(str(e.value), r"lower training.seq_len to (\d+)")
    assert next(build_data(load_config(["--training.seq_len", seq_len]), 0, 1).make_val())
    build_data(load_config(args + ["--validation.enable=false"]), 0, 1)


def test_json_package_source_as_one_document_trains_with_validation(tmp_path, monkeypatch, caplog):
    """The standard library's json package, concatenated into one .txt (one document), prepared with
    the defaults (the debug config's own tokenizer): the debug config trains 20 steps and validates."""
    import json as json_package

    from titanlite.data.stdlib_corpus import prepare_stdlib

    source = sorted(Path(json_package.__file__).parent.glob("*.py"))
    (tmp_path / "json.txt").write_text("\n".join(p.read_text() for p in source))
    monkeypatch.setenv("TITANLITE_CACHE", SHARED_CACHE)
    tok = prepare_stdlib(2048) / "tokenizer.json"
    folder = prepared(tmp_path / "json.txt", tok, tmp_path / "data")
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["documents"] == 1 and meta["val_from"] == "tail"
    cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), "--training.dataset",
                       "prepared", "--training.dataset_path", str(folder), "--training.steps", "20",
                       "--job.dump_folder", str(tmp_path / "run"), "--metrics.progress_bar=false"])
    with caplog.at_level(logging.INFO, logger="titanlite"):
        t = Trainer(cfg)
        try:
            summary = t.train()
        finally:
            t.close()
    assert summary["steps"] == 20 and np.isfinite(summary["val_loss"])
    windows = (meta["splits"]["val"]["tokens"] - 1) // 256
    assert 1 <= windows < 16 and f"the split has {windows} windows of 257 tokens" in caplog.text
    (entry,) = t.run_log.data["validation"]
    assert entry["iter"] == 20 and entry["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-4)
