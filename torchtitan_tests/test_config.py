import subprocess
import sys

import pytest

from titanlite.config import ConfigError, load_config, resolve_batch, to_toml
from titanlite.config.manager import help_text

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
