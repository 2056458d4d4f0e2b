"""compare / plot / breakdown on three real CPU runs, and the seed guide's analysis snippets run verbatim on them."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from titanlite.config import load_config
from titanlite.metrics.run_log import steady, summarize
from titanlite.tools import compare
from titanlite.train import Trainer

from conftest import ROOT, concurrently

# Verbatim from the seeds' mfu_testing_guide_qwen3.md ("Quick Stats", "Compare All Runs"); the tests
# substitute only the folder name 'out-qwen3-1.8b'.
QUICK_STATS = """import json, glob, os
log = sorted(glob.glob('out-qwen3-1.8b/run_*.json'), key=os.path.getmtime)[-1]
data = json.load(open(log))
iters = data['training_iterations'][50:]  # Skip warmup
avg_mfu = sum(i['mfu'] for i in iters) / len(iters)
avg_tokens = sum(i['tokens_per_sec'] for i in iters) / len(iters)
print(f"Avg MFU: {avg_mfu:.2f}%")
print(f"Avg tokens/sec: {avg_tokens:,.0f}")
"""
COMPARE_ALL_RUNS = """import json, glob, os
logs = sorted(glob.glob('out-qwen3-1.8b/run_*.json'), key=os.path.getmtime, reverse=True)[:5]
print(f"{'Config':<30} {'GPUs':>5} {'BS':>4} {'MFU':>7} {'Tokens/s':>10}")
print("-" * 62)
for log in logs:
    data = json.load(open(log))
    cfg = data['startup_info']['config']
    iters = data['training_iterations'][50:]
    mfu = sum(i['mfu'] for i in iters) / len(iters)
    tok = sum(i['tokens_per_sec'] for i in iters) / len(iters)
    opts = []
    if cfg['compile']: opts.append('compile')
    if cfg['use_dataloader']: opts.append('DL')
    if cfg['use_cuda_graphs']: opts.append('CG')
    name = '+'.join(opts) if opts else 'baseline'
    print(f"{name:<30} {cfg['world_size']:>5} {cfg['batch_size']:>4} {mfu:>6.2f}% {tok:>10,.0f}")
"""

RUNS = [[], ["--training.global_batch_size", "4", "--job.description", "accum2"],
        ["--training.local_batch_size", "4", "--training.dataset", "python_stdlib"]]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """Three tiny runs of 52 log entries each (the seeds' snippets skip the first 50)."""
    out = tmp_path_factory.mktemp("runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and spares a loaded CI machine
    try:
        _train_runs(out)
    finally:
        torch.set_num_threads(threads)
    return out


def _train_runs(out):
    for extra in RUNS:
        cfg = load_config(["--training.dataset", "synthetic", "--training.seq_len", "32", "--training.local_batch_size",
                           "2", "--training.steps", "52", "--metrics.log_freq", "1", "--validation.enable=false",
                           "--metrics.progress_bar=false", "--data.num_workers", "0", "--metrics.peak_tflops", "0.05",
                           "--job.dump_folder", str(out), *extra])
        Trainer(cfg).train()


def _snippet(code: str, folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable], input=code.replace("out-qwen3-1.8b", str(folder)),
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_seed_snippets_run_verbatim(runs_dir):
    r = _snippet(COMPARE_ALL_RUNS, runs_dir)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()[2:]
    assert len(rows) == 3
    assert sorted((row.split()[1], row.split()[2]) for row in rows) == [("1", "2"), ("1", "2"), ("1", "4")]
    assert {row.split()[0] for row in rows} == {"baseline", "DL"}  # python_stdlib goes through the dataloader
    r = _snippet(QUICK_STATS, runs_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Avg MFU: ") and "Avg tokens/sec: " in r.stdout


def test_compare_table_and_csv(runs_dir, tmp_path, capsys):
    """--warmup 50 averages exactly what the seed guide's snippets average (entries after the 50th);
    the default averages the run log's steady entries, the rule every reader of a log shares."""
    assert compare.main([str(runs_dir), "--warmup", "50", "--csv", str(tmp_path / "t.csv")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["Config", "GPUs", "BS", "GA", "MFU", "Tokens/s", "Peak", "GB", "Loss", "Run"]
    assert len(lines) == 2 + 3
    with open(tmp_path / "t.csv") as fh:
        rows = list(csv.DictReader(fh))
    # named by what they ran (the second run's description "accum2" is no label), told apart by BS and GA
    assert [(r["Config"], r["BS"], r["GA"]) for r in rows] == [
        ("llama/debug, synthetic, 1 rank", "2", "1"), ("llama/debug, synthetic, 1 rank", "2", "2"),
        ("llama/debug, python_stdlib, 1 rank", "4", "1")]
    for r, path in zip(rows, sorted(runs_dir.glob("run_*.json"))):
        its = json.loads(path.read_text())["training_iterations"][50:]
        assert float(r["MFU"]) == pytest.approx(sum(e["mfu"] for e in its) / len(its))
        assert float(r["Tokens/s"]) == pytest.approx(sum(e["tokens_per_sec"] for e in its) / len(its))
    assert compare.main([str(runs_dir), "--csv", str(tmp_path / "d.csv")]) == 0
    with open(tmp_path / "d.csv") as fh:
        rows = list(csv.DictReader(fh))
    for r, path in zip(rows, sorted(runs_dir.glob("run_*.json"))):
        log = json.loads(path.read_text())
        st = steady(log["training_iterations"], log["startup_info"]["config"])
        assert [e["iter"] for e in st.entries] == list(range(6, 53))  # iter <= 10% of 52 is warm-up
        assert float(r["Tokens/s"]) == pytest.approx(sum(e["tokens_per_sec"] for e in st.entries) / len(st.entries))
        assert float(r["Tokens/s"]) == pytest.approx(summarize(log["training_iterations"],
                                                               log["startup_info"]["config"])["tokens_per_sec"], abs=0.5)


def test_breakdown_table_cli(runs_dir):
    """python -m titanlite.tools.breakdown: one row per steady entry and rank, the phases adding up to the step."""
    path = sorted(runs_dir.glob("run_*.json"))[0]
    r = subprocess.run([sys.executable, "-m", "titanlite.tools.breakdown", str(path), "--warmup", "50"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"== {path}") and lines[1].split()[:3] == ["iter", "rank", "step"]
    rows = [line.split() for line in lines[2:-1]]
    assert [row[:2] for row in rows] == [["51", "0"], ["52", "0"]]
    log = json.loads(path.read_text())["training_iterations"]
    assert float(rows[0][2]) == pytest.approx(log[50]["breakdown"]["ranks"][0]["step_ms"], abs=0.006)
    assert all(float(row[8]) == pytest.approx(1.0, abs=1e-4) for row in rows)  # sum/step
    assert lines[-1].startswith("largest |sum/step - 1| = ") and lines[-1].endswith("method = wall_clock")


def test_plot_writes_pngs(runs_dir, tmp_path):
    out = tmp_path / "plots"
    r = subprocess.run([sys.executable, "-m", "titanlite.tools.plot", *map(str, sorted(runs_dir.glob("run_*.json"))),
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    names = {p.name for p in out.iterdir()}
    assert {"loss.png", "tokens_per_sec.png", "mfu.png", "memory.png", "overview.png"} <= names
    assert len([n for n in names if n.startswith("breakdown_run_")]) == 3
    for p in out.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("tool", ["compare", "plot", "breakdown"])
def test_unreadable_inputs_fail_in_one_line(tool, tmp_path):
    bad = tmp_path / "run_bad.json"
    bad.write_text('{"startup_info": ')
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    for arg, needle in ((bad, "not valid JSON"), (other, "not a run log"), (tmp_path / "missing.json", "no such file"),
                        (tmp_path / "sub", "no such file")):
        extra = ["--out", str(tmp_path / "o")] if tool == "plot" else []
        r = subprocess.run([sys.executable, "-m", f"titanlite.tools.{tool}", str(arg), *extra],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.count("\n") == 1 and needle in r.stderr and str(arg) in r.stderr


def _logged_run(folder, overrides, world=2, tps=(7000.0, 7100.0, 7200.0, 7300.0, 9000.0)):
    """A run log as the Trainer writes it (the startup record from the resolved configuration), with
    steady entries whose tokens/s are skewed (one fast interval), so their mean and median differ."""
    from titanlite.metrics.reporter import RunFacts, startup_info

    cfg = load_config(["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), *overrides])
    tokens = cfg.training.local_batch_size * cfg.training.seq_len * world
    facts = RunFacts(world, "fsdp", 1, cfg.training.local_batch_size * world, tokens, "sdpa", torch.device("cpu"),
                     "cpu", None, 1_377_408, 1_000_000, 10_000_000, "tokens")
    its = [{"iter": i, "loss": 3.0, "time_ms": 1000 * tokens / t, "tokens_per_sec": t,
            "tokens_per_sec_per_gpu": t / world} for i, t in zip((1, 10, 20, 30, 40, 50), (100.0, *tps))]
    path = folder / "run_1.json"
    path.write_text(json.dumps({"startup_info": startup_info(cfg, facts), "training_iterations": its}))
    return path


def test_a_run_is_labelled_by_what_it_ran(tmp_path, capsys):
    """The debug preset trained on a prepared corpus: compare and diagnose name the model, the dataset
    and its path, the mode and the world size from the resolved configuration, not the preset's
    description, which the overrides did not touch."""
    from titanlite.diagnose import diagnose

    path = _logged_run(tmp_path, ["--training.dataset", "prepared", "--training.dataset_path", "data/mycorpus"])
    assert json.loads(path.read_text())["startup_info"]["config"]["job.description"] == "debug LLaMA on python_stdlib"
    assert compare.main([str(path), "--csv", str(tmp_path / "t.csv")]) == 0
    with open(tmp_path / "t.csv") as fh:
        (row,) = csv.DictReader(fh)
    assert row["Config"] == "llama/debug, prepared data/mycorpus, fsdp, 2 ranks"
    assert "python_stdlib" not in capsys.readouterr().out
    diagnose([path], tmp_path / "d")
    rep = json.loads((tmp_path / "d" / "report.json").read_text())
    assert rep["runs"][0]["ran"] == row["Config"]
    assert f"| {row['Config']} |" in (tmp_path / "d" / "report.md").read_text()


def test_one_throughput_rule_in_every_tool(tmp_path):
    """A run's tokens/s and MFU are the steady entries' mean in the Trainer's summary, compare and
    diagnose alike (run_log.THROUGHPUT_RULE); diagnose's figure from the median step time is a
    different rule and its column says so."""
    from titanlite.diagnose import diagnose
    from titanlite.metrics import run_log

    path = _logged_run(tmp_path, [])
    log = json.loads(path.read_text())
    summary = summarize(log["training_iterations"], log["startup_info"]["config"])["tokens_per_sec"]
    assert summary == pytest.approx((7000 + 7100 + 7200 + 7300 + 9000) / 5, abs=0.5)  # not the median, 7,200
    assert compare.main([str(path), "--csv", str(tmp_path / "t.csv")]) == 0
    with open(tmp_path / "t.csv") as fh:
        (row,) = csv.DictReader(fh)
    assert float(row["Tokens/s"]) == pytest.approx(summary, abs=0.5)
    diagnose([path], tmp_path / "d")
    rep = json.loads((tmp_path / "d" / "report.json").read_text())
    assert rep["runs"][0]["tokens_per_sec_logged"] == pytest.approx(summary, abs=0.5)
    assert run_log.THROUGHPUT_RULE in rep["warmup_rule"]
    md = (tmp_path / "d" / "report.md").read_text()
    assert "tokens/s (logged, steady mean)" in md and "step time (ms, median)" in md


# Every `python -m` command of the project; none may need an optional package to start.
ENTRY_POINTS = ["titanlite.train", "titanlite.config.check", "titanlite.tools.plot", "titanlite.tools.compare",
                "titanlite.tools.breakdown", "titanlite.diagnose", "titanlite.checkpoint.export",
                "titanlite.data.prepare", "estimation", "estimation.calibrate"]
OPTIONAL_MODULES = ["matplotlib", "pyarrow", "wandb", "flash_attn", "pynvml", "transformers"]


def _run_without(blocked: list[str], module: str, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    """`python -m module args` in an interpreter where the `blocked` packages are not installed (None in
    sys.modules: importing one raises ModuleNotFoundError, importlib.util.find_spec answers None)."""
    code = (f"import runpy, sys; sys.modules.update(dict.fromkeys({blocked!r})); "
            f"sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})


def test_the_optional_packages_are_the_extras_of_pyproject():
    """The install line a missing package's message gives names an extra that installs that package."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    from titanlite.errors import OPTIONAL

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, (package, extra) in OPTIONAL.items():
        assert [r for r in extras[extra] if r.split(">")[0].split("=")[0].strip() == package], (module, extra)


@pytest.mark.parametrize("blocked, module, args, needle", [
    ("matplotlib", "titanlite.tools.plot", ["RUN.json", "--out", "plots"],
     "python -m titanlite.tools.plot needs matplotlib, which is not installed (pip install -e '.[plot]'"),
    ("pyarrow", "titanlite.data.prepare", ["--input", "corpus.parquet", "--output", "shards", "--train-tokenizer",
                                           "--vocab-size", "300"],
     "reading corpus.parquet needs pyarrow, which is not installed (pip install -e '.[parquet]'"),
    ("wandb", "titanlite.config.check", ["--metrics.enable_wandb"],
     "metrics.enable_wandb needs wandb, which is not installed (pip install -e '.[wandb]'"),
])
def test_a_missing_optional_package_is_one_line_naming_what_to_install(blocked, module, args, needle, tmp_path):
    (tmp_path / "corpus.parquet").write_bytes(b"PAR1")
    r = _run_without([blocked], module, *args, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: " + needle), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.parquet"]  # nothing written


@pytest.fixture(scope="module")
def helps_without_the_optional_packages():
    """{module: `python -m module --help` without the optional packages} for every entry point, two
    commands at a time (each is mostly its process's start-up)."""
    return dict(zip(ENTRY_POINTS, concurrently(*[lambda m=m: _run_without(OPTIONAL_MODULES, m, "--help")
                                                 for m in ENTRY_POINTS])))


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_command_starts_without_the_optional_packages(helps_without_the_optional_packages, module):
    r = helps_without_the_optional_packages[module]
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
