"""python -m estimation names the setting that cannot fit, and refuses a node layout that cannot run."""

import subprocess
import sys

import pytest

from conftest import child_env


def estimation(*args, tmp) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "estimation", "--job.dump_folder", str(tmp), *args], cwd=tmp,
                          env=child_env(), capture_output=True, text=True, timeout=300)


def test_a_sequence_too_long_for_the_gpu_is_named_with_the_longest_that_fits(tmp_path):
    """The model state fits and one sequence's block inputs do not: the answer is the sequence length,
    with the longest one whose block inputs fit beside the state (which then estimates as fitting)."""
    r = estimation("--training.seq_len", "1000000000", "--estimate.search=false", tmp=tmp_path)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert "training.seq_len 1,000,000,000" in line and "nothing in titanlite's registry" not in line
    longest = int(line.split("what could: training.seq_len ")[1].split(" or less")[0].replace(",", ""))
    assert 1 < longest < 1_000_000_000
    from titanlite.config import load_config
    from estimation.estimate import activation_floor, model_state_floor, usable_bytes
    from estimation.hardware import get_hardware
    from titanlite.models import get_model_args

    cfg = load_config([])
    args = get_model_args(cfg.model.name, cfg.model.flavor)
    state = model_state_floor(args.num_params(), "none", 1)
    usable = usable_bytes(cfg.estimate, get_hardware(cfg.estimate.hardware), 1)
    assert state + activation_floor(args, longest) <= usable < state + activation_floor(args, longest + 1)


def test_a_local_batch_too_large_is_named(tmp_path):
    r = estimation("--training.local_batch_size", "100000", "--estimate.search=false", tmp=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "DOES NOT FIT: local batch 100000 needs" in r.stdout


@pytest.mark.parametrize("layout,node", [(("--estimate.gpus_per_node", "3", "--estimate.ngpu", "16"), 3),
                                         (("--estimate.ngpu", "12"), 8),
                                         (("--estimate.ngpu", "12", "--estimate.gpus_per_node", "5",
                                           "--estimate.recommend", "--training.global_batch_size", "96"), 5)])
def test_nodes_whose_gpus_do_not_divide_the_count_are_refused(tmp_path, layout, node):
    r = estimation(*layout, tmp=tmp_path)
    world = int(layout[layout.index("--estimate.ngpu") + 1])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"error: estimate.ngpu {world} over ") and r.stderr.count("\n") == 1
    assert f"{world // node} node(s) of {node} and one of {world % node}" in r.stderr


def test_nodes_that_divide_the_count_are_estimated(tmp_path):
    r = estimation("--estimate.gpus_per_node", "4", "--estimate.ngpu", "12", "--estimate.search=false",
                   "--parallelism.data_parallel", "ddp", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
