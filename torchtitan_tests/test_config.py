import os
import re
import subprocess
import sys

import pytest

from titanlite.config import ConfigError, load_config, resolve_batch, to_toml
from titanlite.config.manager import help_text
from titanlite.parallel.launcher_env import Launch

from conftest import ROOT

DEBUG = str(ROOT / "train_configs" / "debug_model.toml")


def test_precedence_cli_over_toml_over_defaults():
    cfg = load_config(["--job.config_file", DEBUG, "--training.steps=7", "--optimizer.lr", "0.5"])
    assert cfg.training.steps == 7 and cfg.optimizer.lr == 0.5  # CLI
    assert cfg.training.seq_len == 256  # TOML
    assert cfg.training.max_norm == 1.0 and cfg.float8.recipe == "tensorwise"  # defaults


def test_bool_and_flag_forms():
    assert load_config(["--compile.enable"]).compile.enable is True
    assert load_config(["--compile.enable=false"]).compile.enable is False
    assert load_config(["--compile.enable", "true", "--training.steps", "3"]).compile.enable is True
    assert load_config(["--compile.enable", "--training.steps", "3"]).training.steps == 3


@pytest.mark.parametrize("argv, needle", [
    (["--training.lcoal_batch_size", "3"], "training.lcoal_batch_size"),
    (["--trainin.steps", "3"], "trainin"),
    (["--training.local_batch_size=abc"], "training.local_batch_size"),
    (["--training.local_batch_size=0"], "training.local_batch_size must be >= 1"),
    (["--parallelism.data_parallel", "mpi"], "parallelism.data_parallel must be one of"),
    (["--job.config_file", "/no/such.toml"], "/no/such.toml"),
    (["--model.flavor", "70B"], "model.flavor"),
    (["--compile.enable=maybe"], "compile.enable"),
])
def test_bad_input_names_the_key(argv, needle):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_key_inside_toml(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[training]\nlocal_batch_sise = 4\n")
    with pytest.raises(ConfigError, match="bad.toml.*training.local_batch_sise"):
        load_config(["--job.config_file", str(p)])


def test_global_batch_divisibility():
    cfg = load_config(["--training.local_batch_size", "4", "--training.global_batch_size", "16"])
    assert resolve_batch(cfg, 2) == 2 and resolve_batch(cfg, 4) == 1
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        resolve_batch(cfg, 3)


def test_toml_round_trip(tmp_path):
    cfg = load_config(["--job.config_file", DEBUG, "--training.steps", "11", "--compile.enable"])
    p = tmp_path / "resolved.toml"
    p.write_text(to_toml(cfg))
    again = load_config(["--job.config_file", str(p)])
    assert again.training == cfg.training and again.compile == cfg.compile and again.model == cfg.model


def test_help_lists_every_field():
    text = help_text()
    for key in ("--training.local_batch_size", "--parallelism.data_parallel", "--float8.recipe", "--debug."):
        assert key in text


@pytest.mark.parametrize("args, needle", [
    (["--training.local_batch_size=abc"], "training.local_batch_size"),
    (["--training.nope", "1"], "training.nope"),
    (["--job.config_file", "missing.toml"], "missing.toml"),
])
def test_cli_exit_code_2_one_line_no_traceback(args, needle):
    r = subprocess.run([sys.executable, "-m", "titanlite.train", *args], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr


def test_run_train_sh_indivisible_global_batch():
    r = subprocess.run(["./run_train.sh", "--training.local_batch_size", "4", "--training.global_batch_size", "12"],
                       capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ, "NGPU": "2"})
    assert r.returncode == 2 and "training.global_batch_size (12)" in r.stderr and "Traceback" not in r.stderr


def test_several_ranks_need_a_data_parallel_mode():
    r = subprocess.run(["./run_train.sh", "--parallelism.data_parallel", "none"], capture_output=True, text=True,
                       cwd=ROOT, env={**__import__("os").environ, "NGPU": "2"})
    assert r.returncode == 2 and "parallelism.data_parallel=none with 2 ranks" in r.stderr


@pytest.mark.parametrize("argv", [["--optimizer.lr", "nan"], ["--optimizer.lr=inf"], ["--training.max_norm", "-inf"],
                                  ["--optimizer.eps", "1e999"], ["--lr_scheduler.decay_ratio", "NaN"]])
def test_non_finite_numbers_are_refused(argv):
    """nan passes every bound check (nan < lo is False), inf most: both are refused as not finite."""
    with pytest.raises(ConfigError, match=r"expects a finite number") as e:
        load_config(argv)
    assert argv[0].lstrip("-").split("=")[0] in str(e.value) and "\n" not in str(e.value)


def test_non_finite_number_in_toml(tmp_path):
    p = tmp_path / "nan.toml"
    p.write_text("[optimizer]\nlr = nan\n")
    with pytest.raises(ConfigError, match=r"nan.toml: optimizer.lr expects a finite number"):
        load_config(["--job.config_file", str(p)])
    p.write_text(f"[optimizer]\nlr = {10**400}\n")
    with pytest.raises(ConfigError, match=r"nan.toml: optimizer.lr expects a number"):
        load_config(["--job.config_file", str(p)])


@pytest.mark.parametrize("section, line, key, value, wanted", [
    ("training", 'steps = "5"', "training.steps", "'5'", "an integer"),
    ("compile", 'enable = "yes"', "compile.enable", "'yes'", "true or false"),
    ("compile", 'enable = "true"', "compile.enable", "'true'", "true or false"),
    ("optimizer", 'lr = "3e-4"', "optimizer.lr", "'3e-4'", "a number"),
])
def test_toml_strings_are_not_numbers_or_booleans(tmp_path, section, line, key, value, wanted):
    """TOML has types: a quoted value is a string, refused where a number or a boolean is due, as the
    command line refuses --compile.enable=maybe; on the command line, where every value is text, the
    same strings convert."""
    p = tmp_path / "typed.toml"
    p.write_text(f"[{section}]\n{line}\n")
    with pytest.raises(ConfigError) as e:
        load_config(["--job.config_file", str(p)])
    msg = str(e.value)
    assert "typed.toml" in msg and key in msg and value in msg and wanted in msg and "\n" not in msg
    cli_value = line.split(" = ")[1].strip('"')
    assert load_config([f"--{key}", cli_value]) == load_config([f"--{key}={cli_value}"])
    r = subprocess.run([sys.executable, "-m", "titanlite.config.check", "--job.config_file", str(p)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and key in r.stderr and "Traceback" not in r.stderr


def test_cli_text_converts_to_each_type():
    cfg = load_config(["--training.steps", "5", "--compile.enable", "yes", "--optimizer.lr", "3e-4"])
    assert (cfg.training.steps, cfg.compile.enable, cfg.optimizer.lr) == (5, True, 3e-4)


def test_config_file_inside_a_config_file_is_refused(tmp_path):
    """One file is read: a config_file key inside it would be silently ignored, so it is refused."""
    (tmp_path / "base.toml").write_text("[training]\nsteps = 3\n")
    p = tmp_path / "child.toml"
    p.write_text(f'[job]\nconfig_file = "{tmp_path / "base.toml"}"\n')
    with pytest.raises(ConfigError, match=r"child.toml: job.config_file cannot be set inside a config file"):
        load_config(["--job.config_file", str(p)])
    # the resolved config a run writes (run_*_config.toml) names its source only in a comment: it loads
    cfg = load_config(["--job.config_file", DEBUG])
    text = to_toml(cfg)
    assert f'# config_file = "{DEBUG}"' in text
    p.write_text(text)
    assert load_config(["--job.config_file", str(p)]).training == cfg.training


def test_config_file_is_found_from_any_folder(tmp_path, monkeypatch):
    """Relative to the working directory first; the shipped train_configs/ names from the repository."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text("[training]\nsteps = 5\n")
    cfg = load_config(["--job.config_file", "mine.toml"])
    assert cfg.training.steps == 5 and cfg.job.config_file == str(tmp_path / "mine.toml")
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml"])
    assert cfg.training.seq_len == 256 and cfg.job.config_file == DEBUG
    (tmp_path / "train_configs").mkdir()
    (tmp_path / "train_configs" / "debug_model.toml").write_text("[training]\nseq_len = 64\n")
    assert load_config(["--job.config_file", "train_configs/debug_model.toml"]).training.seq_len == 64  # yours wins
    with pytest.raises(ConfigError, match=r"config file not found: nope.toml \(looked in .* and .*\)"):
        load_config(["--job.config_file", "nope.toml"])


@pytest.mark.parametrize("ngpu", ["abc", "0", "-2", "1.5"])
def test_run_train_sh_bad_ngpu(ngpu):
    r = subprocess.run(["./run_train.sh", "--training.steps", "1"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "NGPU": ngpu}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: NGPU must be a positive number of processes on this node; "
                                             f"got '{ngpu}'"]


# A stand-in for the interpreter run_train.sh is given (PYTHON=...): it records what would install
# (pip), or with STUB_ENV the launch (titanlite.launch), instead of doing it, and hands every other call to a real interpreter.
STUB = """#!/usr/bin/env bash
if [ "$1 $2" = "-m pip" ]; then
  echo "${@:3}" >> "$STUB_LOG"
  case "$3" in
    index) echo "Available versions: $STUB_TORCH_VERSIONS"; exit 0 ;;
    install) [[ "${*:4}" == $STUB_FAIL ]] && exit 1; exit 0 ;;
  esac
  exit 0
fi
if [ -n "${STUB_ENV:-}" ] && [ "$1 $2" = "-m titanlite.launch" ]; then env > "$STUB_ENV"; exit 0; fi
exec "$STUB_REAL" "$@"
"""


def stub_python(folder, real: str, record_launch: bool = False):
    stub = folder / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return {"PYTHON": str(stub), "STUB_REAL": real, "STUB_LOG": str(folder / "pip.log"),
            **({"STUB_ENV": str(folder / "launch.env")} if record_launch else {})}


@pytest.fixture(scope="module")
def empty_venv(tmp_path_factory):
    """An interpreter with nothing installed but pip (the state of a fresh virtualenv)."""
    folder = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(folder / "v")], check=True, timeout=300)
    return str(folder / "v" / "bin" / "python")


def fake_nvidia_smi(folder, gpus: int) -> dict:
    (folder / "bin").mkdir(exist_ok=True)
    smi = folder / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n"
                                           for i in range(gpus)) + ("exit 0\n" if gpus else "exit 9\n"))
    smi.chmod(0o755)
    return {"PATH": f"{folder / 'bin'}:{os.environ['PATH']}"}


@pytest.mark.parametrize("gpus, versions, torch_spec, expected", [
    (0, "2.14.0, 2.13.0+cpu, 2.13.0, 2.12.0+cpu", "", "install torch==2.13.0+cpu"),  # a CPU build pip offers
    (0, "2.14.0, 2.13.0", "", "install torch --index-url https://download.pytorch.org/whl/cpu"),
    (2, "2.14.0, 2.13.0+cpu", "", "install torch"),  # PyPI's CUDA build where there is a GPU
    (0, "2.14.0, 2.13.0+cpu", "torch==2.11.0 --index-url https://example.org/whl/cu128",
     "install torch==2.11.0 --index-url https://example.org/whl/cu128"),
])
def test_run_train_sh_installs_what_is_missing(tmp_path, empty_venv, gpus, versions, torch_spec, expected):
    """From the repository folder, where `import titanlite` succeeds without any install, an interpreter
    lacking torch and numpy gets torch (a CPU build on a machine without an NVIDIA GPU, never PyPI's
    CUDA build), then titanlite with the rest of its dependencies."""
    env = {**os.environ, **stub_python(tmp_path, empty_venv), **fake_nvidia_smi(tmp_path, gpus),
           "STUB_TORCH_VERSIONS": versions, "TORCH_SPEC": torch_spec, "STUB_FAIL": "-e *"}
    r = subprocess.run(["./run_train.sh"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    installs = [line for line in (tmp_path / "pip.log").read_text().splitlines() if line.startswith("install")]
    assert installs == [expected, f"install -e {ROOT}"], r.stderr
    lacking = next(line for line in r.stderr.splitlines() if " lacks: " in line)
    assert {"torch", "numpy", "tokenizers"} <= set(lacking.split(" lacks: ")[1].split())
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: pip install -e {ROOT} failed (see above); TITANLITE_INSTALL=0 runs {tmp_path / 'python'} as it is")


def test_run_train_sh_install_off(tmp_path, empty_venv):
    """TITANLITE_INSTALL=0: no check and no pip, whatever the interpreter lacks (a machine set up by hand)."""
    env = {**os.environ, **stub_python(tmp_path, empty_venv), "TITANLITE_INSTALL": "0"}
    r = subprocess.run(["./run_train.sh"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode != 0 and "No module named" in r.stderr  # the run itself meets what is missing
    assert not (tmp_path / "pip.log").exists()


def test_run_train_sh_installs_nothing_present_and_sets_no_nccl_variable(tmp_path):
    """With every dependency present pip never runs; a multi-process launch gets the caller's
    environment with no NCCL_* variable added (those are the cluster owner's to choose)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env.update(stub_python(tmp_path, sys.executable, record_launch=True), NGPU="2")
    r = subprocess.run(["./run_train.sh", "--parallelism.data_parallel", "ddp"], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "pip.log").exists()
    launched = dict(line.split("=", 1) for line in (tmp_path / "launch.env").read_text().splitlines() if "=" in line)
    assert launched["STUB_REAL"] == sys.executable  # it is the launch's environment
    assert [k for k in launched if k.startswith("NCCL_")] == []


def test_missing_deps_checks_versions_and_markers():
    """What run_train.sh installs from: absent and too-old requirements; one whose marker excludes this
    interpreter is not asked for."""
    import importlib.metadata

    from titanlite.tools.missing_deps import missing

    installed = {"torch": "2.10.0", "numpy": "2.1.0"}

    def version_of(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    reqs = ["torch>=2.11", "numpy>=1.24", "tqdm>=4.60", "tomli>=2.0; python_version < '3.0'"]
    assert missing(reqs, version_of) == ["torch>=2.11 (found 2.10.0)", "tqdm"]


MACHINE_PRESETS = sorted((ROOT / "train_configs").glob("*_[18]x*.toml"))


@pytest.mark.parametrize("path", MACHINE_PRESETS, ids=lambda p: p.name)
def test_machine_presets_check_at_their_size_and_say_where_their_figures_come_from(path):
    """Each machine preset loads at its own GPU count with no accumulation left over, names its
    machine in [estimate], and says whether its figures were measured or only predicted."""
    world = int(path.stem.split("_")[-1].split("x")[0])  # llama_1.36b_8xh100 -> 8
    cfg = load_config(["--job.config_file", str(path)], Launch(world_size=world))
    assert cfg.estimate.ngpu == world and path.stem.endswith(cfg.estimate.hardware)
    accum = resolve_batch(cfg, world)
    assert cfg.training.local_batch_size * accum * world == cfg.training.global_batch_size
    head = path.read_text().split("[job]")[0]
    assert ("MEASURED" in head) != ("PREDICTED" in head), "a preset says measured or predicted, once"
    assert cfg.compile.enable


def test_machine_presets_cover_the_machines_users_run():
    names = {p.stem for p in MACHINE_PRESETS}
    assert {f"{m}_{n}" for m in ("llama_1.36b", "qwen3_1.8b") for n in ("1xh100", "8xh100", "8xh200", "8xb200")} <= names
    assert {f"{m}_8b_{n}" for m in ("llama", "qwen3") for n in ("8xh100", "8xh200", "8xb200")} <= names


ALL_PRESETS = sorted((ROOT / "train_configs").glob("*.toml"))


@pytest.mark.parametrize("path", ALL_PRESETS, ids=lambda p: p.name)
def test_presets_warm_up_within_their_steps_or_say_they_only_benchmark(path):
    """A preset's lr peaks within its run and then decays, or its first comment line says it is for
    benchmarking only."""
    cfg = load_config(["--job.config_file", str(path)], Launch(world_size=8 if "_8x" in path.name else 1))
    first = path.read_text().splitlines()[0]
    assert cfg.lr_scheduler.warmup_steps < cfg.training.steps or first.startswith("# Benchmark only"), first


def test_a_warm_up_not_shorter_than_the_run_is_named_in_one_line():
    """The warning names the schedule the run follows: the lr's last value as a share of its peak."""
    from titanlite.optim import lr_factor, schedule_warning

    cfg = load_config(["--training.steps", "1000", "--lr_scheduler.warmup_steps", "2000", "--optimizer.lr", "3e-4"])
    line = schedule_warning(cfg.lr_scheduler, cfg.training.steps, cfg.optimizer.lr)
    end = lr_factor(999, 1000, 2000, "cosine", 0.1, 0.2)
    assert abs(end - 0.5) < 1e-3  # step 1000 of a 2000-step warm-up
    assert line == ("warning: lr_scheduler.warmup_steps (2000) is not shorter than training.steps (1000): the lr "
                    f"rises linearly to 50% of its peak ({end * 3e-4:.2e} of 3.00e-04) at the last step and never "
                    "decays; set training.steps above 2000 or lower lr_scheduler.warmup_steps")
    cfg.lr_scheduler.warmup_steps = 999
    assert schedule_warning(cfg.lr_scheduler, cfg.training.steps, cfg.optimizer.lr) is None


def test_float8_on_two_cpu_processes_is_refused_before_torchrun(tmp_path):
    """A machine without GPUs (nvidia-smi finds none): run_train.sh with NGPU=2 stops in its config
    check (one line, exit 2); the interpreter is started once, on titanlite.launch, whose check
    refuses before torchrun or titanlite.train starts."""
    calls, bin_dir = tmp_path / "calls", tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("python", f'echo "$*" >> {calls}\nexec {sys.executable} "$@"'),
                       ("nvidia-smi", 'echo "No devices were found"\nexit 6')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "NGPU": "2", "TITANLITE_INSTALL": "0", "PYTHON": str(bin_dir / "python"),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    r = subprocess.run([str(ROOT / "run_train.sh"), "--training.dataset", "synthetic", "--float8.enable",
                        "--job.dump_folder", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["error: float8.enable needs a GPU with compute capability >= 8.9 (H100-class), "
                                     "not CPU; set float8.emulate=true to emulate it (tests only, slow)"]
    started = calls.read_text().splitlines()
    assert len(started) == 1 and started[0].startswith("-m titanlite.launch --world-size 2"), started


@pytest.mark.parametrize("args,capabilities,message", [
    (["--float8.enable"], [(8, 0), (9, 0)], "float8.enable needs a GPU with compute capability >= 8.9 (H100-class), "
                                            "not compute capability 8.0"),
    (["--float8.enable"], None, None),  # nvidia-smi cannot tell: the ranks find out
    (["--float8.enable", "--float8.emulate"], [], None),
    (["--parallelism.fsdp_copy_engine_all_gather", "on"], [], "=on needs CUDA GPUs and NCCL; this machine has no GPU"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_option", "x"], None,
     "activation_checkpoint.selective_option must be 'op' or a positive integer N; got 'x'"),
])
def test_launch_check_refuses_what_the_ranks_would(args, capabilities, message):
    from titanlite.config.check import check_launch

    cfg = load_config(args)
    if message is None:
        check_launch(cfg, capabilities)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_launch(cfg, capabilities)


def test_ranks_agree_on_everything_but_where_the_values_came_from(tmp_path):
    """titanlite.config.agree: two nodes reading the same values from config files at other paths, and
    with other dry-run settings, agree; any training setting that differs is named with each value and
    the ranks and hosts holding it, contiguous ranks as a span."""
    from titanlite.config.agree import disagreement, job_settings

    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "job.toml").write_text("[training]\nsteps = 7\n")
    a = job_settings(load_config(["--job.config_file", str(tmp_path / "a" / "job.toml")]))
    b = job_settings(load_config(["--job.config_file", str(tmp_path / "b" / "job.toml"), "--estimate.ngpu", "8"]))
    assert disagreement([("h0", a), ("h1", b)]) is None
    c = job_settings(load_config(["--job.config_file", str(tmp_path / "b" / "job.toml"), "--training.seed", "3",
                                  "--parallelism.data_parallel", "ddp"]))
    assert disagreement([("h0", a), ("h0", a), ("h1", c), ("h1", c), ("h2", a)]) == (
        "the job's ranks resolved different configurations: parallelism.data_parallel is 'fsdp' on ranks 0-1, 4 "
        "(h0, h2), 'ddp' on ranks 2-3 (h1); training.seed is 42 on ranks 0-1, 4 (h0, h2), 3 on ranks 2-3 (h1); "
        "start every node with the same options and config file")
