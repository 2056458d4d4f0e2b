"""`python -m titanlite.data.prepare`: round trip, determinism, and every bad input's one-line error."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from titanlite.config import ConfigError
from titanlite.data import prepare
from titanlite.data.shards import read_meta
from titanlite.data.tokenizer import load_tokenizer, train_bpe

from conftest import ROOT

DOCS = ["def f(x):\n    return x + 1\n", "Grüße, 世界! emoji 🙂 and tabs\t.", "a" * 300, "import os\nprint(os.sep)\n",
        "second line\n\nafter a blank line", "class A:\n    pass\n", "x = [i * i for i in range(10)]"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(DOCS * 3, 300, path)
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def decode_docs(folder, split):
    """Documents of a split, decoded back to text (split at EOS)."""
    meta = read_meta(folder)
    tok = load_tokenizer(folder / "tokenizer.json")
    ids = np.concatenate([np.fromfile(folder / s["file"], dtype=meta["dtype"])
                          for s in meta["splits"][split]["shards"]] or [np.array([], meta["dtype"])])
    ends = np.flatnonzero(ids == meta["eos_id"])
    assert len(ids) == 0 or ends[-1] == len(ids) - 1, "every document ends with EOS"
    return [tok.decode(part.tolist()) for part in np.split(ids, ends + 1)[:-1]], meta


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def test_round_trip_and_independent_of_worker_count(tmp_path, tokenizer):
    """Decoding the shards gives back every document, in order, split every --val-every-th; the
    bytes written do not depend on how many tokenizer processes ran."""
    write_jsonl(tmp_path / "a.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCS[:5])])
    (tmp_path / "b.txt").write_text(DOCS[5])
    (tmp_path / "c.txt").write_text(DOCS[6])
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        prepare.main(["--input", str(tmp_path / "*.jsonl"), "--input", str(tmp_path / "*.txt"), "--output", str(out),
                      "--tokenizer", str(tokenizer), "--val-every", "3", "--shard-tokens", "37",
                      "--workers", str(workers)])
        outs.append(out)
    train, meta = decode_docs(outs[0], "train")
    val, _ = decode_docs(outs[0], "val")
    assert val == [DOCS[2], DOCS[5]]  # documents 3 and 6 (1-based)
    assert train == [d for i, d in enumerate(DOCS) if i % 3 != 2]
    assert meta["documents"] == 7 and meta["splits"]["val"]["documents"] == 2 and meta["dtype"] == "uint16"
    assert len(meta["splits"]["train"]["shards"]) > 1 and all(s["tokens"] == 37 for s in meta["splits"]["train"]["shards"][:-1])
    files = sorted(p.name for p in outs[0].iterdir())
    assert files == sorted(p.name for p in outs[1].iterdir())
    assert all((outs[0] / f).read_bytes() == (outs[1] / f).read_bytes() for f in files)
    assert leftovers(tmp_path) == []


def test_train_tokenizer_and_long_txt_pieces(tmp_path, monkeypatch):
    """--train-tokenizer writes a tokenizer of the asked size; a .txt longer than one piece is still one document."""
    monkeypatch.setattr(prepare, "PIECE_CHARS", 100)
    long_doc = "".join(f"line {i}: {DOCS[i % len(DOCS)]}\n" for i in range(60))
    (tmp_path / "long.txt").write_text(long_doc)
    save = tmp_path / "saved_tokenizer.json"
    prepare.main(["--input", str(tmp_path / "long.txt"), "--output", str(tmp_path / "out"), "--train-tokenizer",
                  "--vocab-size", "400", "--tokenizer", str(save), "--val-every", "0", "--workers", "1"])
    docs, meta = decode_docs(tmp_path / "out", "train")
    assert docs == [long_doc] and meta["documents"] == 1
    assert meta["vocab_size"] == load_tokenizer(save).get_vocab_size() <= 400


def test_parquet(tmp_path, tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [DOCS[0], None, DOCS[1]]}), tmp_path / "d.parquet")
    prepare.main(["--input", str(tmp_path / "d.parquet"), "--output", str(tmp_path / "out"), "--tokenizer",
                  str(tokenizer), "--text-field", "content", "--val-every", "0", "--workers", "1"])
    docs, meta = decode_docs(tmp_path / "out", "train")
    assert docs == DOCS[:2] and meta["skipped"] == {"rows whose 'content' is null or not a string": 1}


def test_bad_records_are_counted_and_reported(tmp_path, tokenizer):
    lines = [json.dumps({"text": DOCS[0]}).encode(), b"{not json", json.dumps({"body": "x"}).encode(),
             b'{"text": "caf\xe9"}', json.dumps({"text": 7}).encode(), json.dumps({"text": DOCS[1]}).encode(), b""]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines))
    r = run_cli(["--input", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "out"), "--tokenizer", str(tokenizer),
                 "--val-every", "0", "--workers", "1"])
    assert r.returncode == 0, r.stderr
    assert "skipped 1 lines not valid JSON (first at" in r.stdout and "a.jsonl:2" in r.stdout
    docs, meta = decode_docs(tmp_path / "out", "train")
    assert docs == DOCS[:2]
    assert meta["skipped"] == {"lines not valid JSON": 1, "records without field 'text'": 1, "lines not valid UTF-8": 1,
                               "records whose 'text' is not a string": 1}


def run_cli(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "titanlite.data.prepare", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120, **kw)


BAD_INPUTS = {
    # name: (files to create {name: bytes}, extra args, expected fragment of the one-line error)
    "missing input": ({}, ["--input", "{d}/nope.jsonl"], "--input {d}/nope.jsonl: no such file"),
    "glob matches nothing": ({}, ["--input", "{d}/*.jsonl"], "matches no .txt, .jsonl, .parquet file"),
    "unsupported type": ({"a.csv": b"x"}, ["--input", "{d}/a.csv"], "unsupported file type '.csv'"),
    "empty input": ({"a.txt": b"", "b.jsonl": b"\n\n"}, ["--input", "{d}"], "the input holds no documents"),
    "non-UTF-8 bytes": ({"a.txt": b"fine\nbad \xff byte\n"}, ["--input", "{d}/a.txt"],
                        "a.txt:2: not valid UTF-8 (byte 0xff at column 5)"),
    "missing text field": ({"a.jsonl": b'{"body": "x"}\n{"body": "y"}\n'}, ["--input", "{d}/a.jsonl"],
                           "no documents: skipped 2 records without field 'text' (first at"),
    "unwritable output": ({"a.txt": b"hello", "blocker": b""}, ["--input", "{d}/a.txt", "--output", "{d}/blocker/out"],
                          "cannot write the output folder {d}/blocker/out: {d}/blocker is a file"),
    "missing tokenizer": ({"a.txt": b"hello"}, ["--input", "{d}/a.txt", "--tokenizer", "{d}/none.json"],
                          "tokenizer file not found: {d}/none.json"),
    "output already prepared": ({"a.txt": b"hello", "out/meta.json": b"{}"}, ["--input", "{d}/a.txt"],
                                "already holds a prepared dataset; pass --overwrite"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_one_line_error_and_no_output(tmp_path, tokenizer, case):
    files, args, expected = BAD_INPUTS[case]
    d = tmp_path / "in"
    d.mkdir()
    for name, data in files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
    args = [a.format(d=d) for a in args]
    if "--output" not in args:
        args += ["--output", str(d / "out")]
    if "--tokenizer" not in args:
        args += ["--tokenizer", str(tokenizer)]
    before = sorted(p.relative_to(d) for p in d.rglob("*"))
    r = run_cli(args + ["--workers", "1"])
    assert r.returncode == 2, r.stderr
    error = r.stderr.strip().splitlines()[-1]  # (a progress bar may come before it)
    assert error.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    assert expected.format(d=d) in error, r.stderr
    assert sorted(p.relative_to(d) for p in d.rglob("*")) == before  # nothing written, nothing left behind


def test_failure_midway_removes_the_staging_folder(tmp_path, tokenizer):
    def pieces(skips):
        for i in range(50):
            yield DOCS[i % len(DOCS)] * 20, True
        raise ConfigError("boom")

    with pytest.raises(ConfigError, match="boom"):
        prepare.prepare_dataset(pieces, tmp_path / "out", tokenizer=str(tokenizer), shard_tokens=50, workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_killed_preparation_leaves_nothing_readable(tmp_path, tokenizer):
    """SIGKILL after shards were written: no output folder exists (so training refuses it with a clear
    message), and the next preparation removes the dead run's staging folder."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a.txt").write_text(DOCS[0] * 40000)  # > 1 MB: a full tokenizer task, then shards
    os.mkfifo(d / "b.txt")  # the run blocks here, forever, until killed
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "titanlite.data.prepare", "--input", str(d / "a.txt"), "--input",
                          str(d / "b.txt"), "--output", str(out),
                          "--tokenizer", str(tokenizer), "--workers", "1", "--shard-tokens", "1000"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".out.partial-*/train_00001.bin")):
            assert p.poll() is None and time.monotonic() < deadline, "prepare exited or never wrote a shard"
            time.sleep(0.1)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert not out.exists() and leftovers(tmp_path) == [f".out.partial-{p.pid}"]
    with pytest.raises(ConfigError, match="does not exist; run python -m titanlite.data.prepare"):
        read_meta(out)
    (d / "b.txt").unlink()
    (d / "b.txt").write_text(DOCS[1])
    prepare.main(["--input", str(d), "--output", str(out), "--tokenizer", str(tokenizer), "--workers", "1"])
    assert read_meta(out)["documents"] == 2 and leftovers(tmp_path) == []


def test_overwrite_replaces_a_prepared_dataset(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text(DOCS[0])
    args = ["--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out"), "--tokenizer", str(tokenizer),
            "--workers", "1", "--val-every", "0"]
    prepare.main(args)
    (tmp_path / "a.txt").write_text(DOCS[1])
    prepare.main(args + ["--overwrite"])
    assert decode_docs(tmp_path / "out", "train")[0] == [DOCS[1]]
    assert leftovers(tmp_path) == []


def test_a_hugging_face_dataset_prepares_as_the_same_documents_in_jsonl(tmp_path, tokenizer):
    """--hf-dataset on a save_to_disk folder (a Dataset, and a DatasetDict's split) writes the shards the
    same documents give from a jsonl file, null rows skipped and counted; a missing split or column is
    one line naming it."""
    datasets = pytest.importorskip("datasets")
    rows = [DOCS[0], None, *DOCS[1:]]
    datasets.Dataset.from_dict({"content": rows, "id": list(range(len(rows)))}).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"content": rows})}).save_to_disk(
        str(tmp_path / "dd"))
    write_jsonl(tmp_path / "a.jsonl", [{"content": d} for d in DOCS])
    common = ["--tokenizer", str(tokenizer), "--text-field", "content", "--val-every", "3", "--workers", "1"]
    prepare.main(["--input", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "from_jsonl"), *common])
    for name, extra in (("ds", []), ("dd", ["--hf-split", "validation"])):
        prepare.main(["--hf-dataset", str(tmp_path / name), *extra, "--output", str(tmp_path / f"from_{name}"), *common])
        for split in ("train", "val"):
            assert decode_docs(tmp_path / f"from_{name}", split)[0] == decode_docs(tmp_path / "from_jsonl", split)[0]
        meta = read_meta(tmp_path / f"from_{name}")
        assert meta["documents"] == len(DOCS) and meta["skipped"] == {"rows whose 'content' is null or not a string": 1}
    for args, says in ((["--hf-dataset", str(tmp_path / "dd")], f"--hf-dataset {tmp_path / 'dd'} has no split 'train' "
                                                                 f"(splits: validation); set --hf-split"),
                       (["--hf-dataset", str(tmp_path / "ds"), "--text-field", "body"],
                        f"--hf-dataset {tmp_path / 'ds'} has no column 'body' (columns: content, id); set --text-field")):
        r = run_cli([*args, "--output", str(tmp_path / "bad"), "--tokenizer", str(tokenizer), "--workers", "1"])
        assert (r.returncode, r.stderr.strip().splitlines()[-1]) == (2, f"error: {says}"), r.stderr
        assert not (tmp_path / "bad").exists()
