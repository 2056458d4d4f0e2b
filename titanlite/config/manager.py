"""TOML + CLI configuration: parse, type-check, validate, print, save.

Precedence: CLI > TOML (`--job.config_file`) > dataclass defaults. Every failure raises
`ConfigError` with a one-line message naming the key or file; `run_cli` turns it into exit code 2.
This module does not import torch, so `python -m titanlite.config.check` answers in a blink.

Paths: every relative path, on the command line or inside the TOML, is relative to the working
directory of the process (the folder the user runs from), as for any command-line tool. One
convenience: a relative `--job.config_file` that does not exist there is looked up in the repository
this package sits in, so the shipped `train_configs/...` names work from any folder.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import math
import os
import sys
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from titanlite.config.job_config import JobConfig
from titanlite.config.settings import parallel_settings, run_mode
from titanlite.errors import BAD_INPUT_EXIT, ConfigError, to_pipe
from titanlite.parallel.launcher_env import Launch
from titanlite.parallel.modes import MODES
from titanlite.parallel.policy import bf16_gradients_refusal, bf16_transport_error, hsdp_shape

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]  # the checkout holding titanlite/ and train_configs/
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


def _fields(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls, include_extras=False)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def _type_name(tp) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"a comma-separated list of {_type_name(get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _convert(key: str, tp, value: Any, text: bool = False) -> Any:
    """Convert a value to `tp`, or raise ConfigError naming `key`. `text`: the value is command-line
    text, where every value is a string ("5", "true"); elsewhere (TOML, code) a number or a boolean
    must be one, as TOML writes it, so `steps = "5"` is refused like `--training.steps=five`."""
    bad = ConfigError(f"{key} expects {_type_name(tp)}, got {value!r}")
    origin = get_origin(tp)
    if not text and tp in (bool, int, float) and isinstance(value, str):
        raise ConfigError(f"{key} expects {_type_name(tp)}, got the string {value!r} (write it without quotes)")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is list:
        (elem,) = get_args(tp)
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list):
            raise bad
        return [_convert(key, elem, v.strip() if isinstance(v, str) else v, text) for v in items if v != ""]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise bad
        try:
            number = float(value)
        except (ValueError, OverflowError):  # OverflowError: a TOML integer beyond any float
            raise bad from None
        if not math.isfinite(number):  # nan/inf would pass every bound check (nan < lo is False)
            raise ConfigError(f"{key} expects a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise bad


def _check_bounds(key: str, f: dataclasses.Field, value: Any) -> None:
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    why = f" ({f.metadata['why']})" if "why" in f.metadata else ""
    if lo is not None and value < lo:
        raise ConfigError(f"{key} must be >= {lo}; got {value}{why}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key} must be <= {hi}; got {value}{why}")


def _lookup(section: str, key: str):
    sections = _sections()
    if section not in sections:
        near = difflib.get_close_matches(section, sections, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise ConfigError(f"unknown config section '{section}'{hint}; sections: {', '.join(sections)}")
    fields = _fields(sections[section])
    if key not in fields:
        near = difflib.get_close_matches(key, fields, n=1)
        hint = f" (did you mean '{section}.{near[0]}'?)" if near else ""
        raise ConfigError(f"unknown config key '{section}.{key}'{hint}; {section} keys: {', '.join(fields)}")
    return fields[key]


def registry_choices(f: dataclasses.Field) -> list[str] | None:
    """The keys of the registry a field names in metadata["registry"] ("module:attribute"), or None."""
    spec = f.metadata.get("registry")
    if not spec:
        return None
    module, attr = spec.split(":")
    return list(getattr(importlib.import_module(module), attr))


def set_key(cfg: JobConfig, dotted: str, value: Any, text: bool = False) -> None:
    """Set `section.key` to `value` with every check a loaded value gets (type, bounds, registry);
    `text`: the value is command-line text (see _convert). The TOML and CLI loaders use it, and so does
    estimation's recommender for its candidate settings."""
    if dotted.count(".") != 1:
        raise ConfigError(f"config keys look like --section.key; got '--{dotted}'")
    section, key = dotted.split(".")
    tp, f = _lookup(section, key)
    converted = _convert(dotted, tp, value, text)
    if isinstance(converted, (int, float)) and not isinstance(converted, bool):
        _check_bounds(dotted, f, converted)
    choices = registry_choices(f)
    if choices is not None and converted not in choices:
        raise ConfigError(f"{dotted} must be one of {', '.join(choices)}; got {converted!r}")
    setattr(getattr(cfg, section), key, converted)


def _split_cli(argv: list[str]) -> list[tuple[str, Any]]:
    """Turn argv into (dotted key, raw value) pairs; bare boolean flags become True."""
    pairs, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise ConfigError(f"unexpected argument '{tok}': options look like --section.key value")
        body = tok[2:]
        if "=" in body:
            k, v = body.split("=", 1)
            pairs.append((k, v))
            i += 1
            continue
        k = body
        is_bool = False
        if k.count(".") == 1 and k.split(".")[0] in _sections():
            try:
                is_bool = _lookup(*k.split("."))[0] is bool
            except ConfigError:
                pass
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if is_bool and (nxt is None or nxt.startswith("--") or nxt.lower() not in _TRUE | _FALSE):
            pairs.append((k, True))
            i += 1
        elif nxt is None:
            raise ConfigError(f"--{k} needs a value")
        else:
            pairs.append((k, nxt))
            i += 2
    return pairs


def find_config_file(name: str) -> str:
    """The config file `name` relative to the working directory; a relative name missing there is
    taken from the repository (the shipped train_configs/). Returns an absolute path."""
    if os.path.isfile(name):
        return os.path.abspath(name)
    if not os.path.isabs(name) and (REPO / name).is_file():
        return str(REPO / name)
    where = "" if os.path.isabs(name) else f" (looked in {os.getcwd()} and {REPO})"
    raise ConfigError(f"config file not found: {name}{where} (--job.config_file)")


def load_config(argv: list[str] | None = None, launch: Launch | None = None) -> JobConfig:
    """Build a JobConfig from defaults, the TOML named by --job.config_file, then the CLI, and
    validate it for the job `launch` describes (its world size and ranks per host; default: what the
    launcher's environment says now, one process where it says nothing). Every check of a
    configuration happens here, so a config that loads can run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = _split_cli(argv)
    cfg = JobConfig()
    config_file = next((v for k, v in pairs if k == "job.config_file"), "")
    if config_file:
        config_file = find_config_file(config_file)
        try:
            with open(config_file, "rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {config_file} is not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{config_file}: top-level key '{section}' must be a [section] table")
            for key, value in table.items():
                if (section, key) == ("job", "config_file"):
                    raise ConfigError(f"{config_file}: job.config_file cannot be set inside a config file (one file "
                                      f"is read; it does not include another): pass it as --job.config_file")
                try:
                    set_key(cfg, f"{section}.{key}", value)
                except ConfigError as e:
                    raise ConfigError(f"{config_file}: {e}") from None
    for k, v in pairs:
        set_key(cfg, k, v, text=True)
    cfg.job.config_file = config_file
    validate(cfg)
    launch = launch or Launch.from_environ()
    check_combination(cfg, launch.world_size, launch.ranks_per_host)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Cross-field checks that need no knowledge of the world size."""
    from titanlite.models import MODEL_REGISTRY  # registry lookups, not string literals

    if cfg.model.name not in MODEL_REGISTRY:
        raise ConfigError(f"model.name must be one of {', '.join(MODEL_REGISTRY)}; got '{cfg.model.name}'")
    flavors = MODEL_REGISTRY[cfg.model.name].flavors
    if cfg.model.flavor not in flavors:
        raise ConfigError(f"model.flavor for {cfg.model.name} must be one of {', '.join(flavors)}; got '{cfg.model.flavor}'")
    gb, lb = cfg.training.global_batch_size, cfg.training.local_batch_size
    if gb != -1 and gb < lb and not cfg.estimate.recommend:  # the recommender picks the local batch itself
        raise ConfigError(f"training.global_batch_size ({gb}) is smaller than training.local_batch_size ({lb})")


def resolve_batch(cfg: JobConfig, dp_size: int) -> int:
    """Gradient accumulation steps for the configured global batch on `dp_size` data-parallel ranks."""
    lb, gb = cfg.training.local_batch_size, cfg.training.global_batch_size
    if gb == -1:
        return 1
    if gb % (lb * dp_size) != 0:
        raise ConfigError(
            f"training.global_batch_size ({gb}) must be divisible by training.local_batch_size ({lb}) "
            f"x data-parallel ranks ({dp_size}) = {lb * dp_size}")
    return gb // (lb * dp_size)


def check_world_size(cfg: JobConfig, world: int) -> None:
    """Several ranks need a data-parallel mode: without one they would train unsynchronised copies."""
    if world > 1 and cfg.parallelism.data_parallel == "none":
        raise ConfigError(f"parallelism.data_parallel=none with {world} ranks would train unsynchronised copies; "
                          f"choose ddp, zero1, fsdp or hsdp (or run one process)")


def refuse(cfg: JobConfig, world: int, setting: str) -> None:
    """Raise when this run's data-parallel mode cannot run `setting` (its Mode record says why)."""
    mode = run_mode(cfg, world)
    if setting in mode.refuses:
        raise ConfigError(f"{setting} with parallelism.data_parallel={mode.name}: {mode.refuses[setting]}")


def check_cuda_graphs(cfg: JobConfig, world: int) -> None:
    """Refuse, with the reason, the combinations a captured step cannot run correctly."""
    refuse(cfg, world, "training.cuda_graphs")
    if run_mode(cfg, world).name == "ddp" and cfg.parallelism.ddp_reduce_dtype != "float32":
        raise ConfigError("training.cuda_graphs with parallelism.ddp_reduce_dtype=bfloat16: the bf16 hook copies the "
                          "reduced bucket back in a host-side future callback, which a replayed graph would not "
                          "run; use float32 (the default)")
    if cfg.training.on_nan == "skip":
        raise ConfigError("training.cuda_graphs needs training.on_nan=stop: a captured step cannot decide on the "
                          "host to skip its optimizer update")


def check_moments_dtype(cfg: JobConfig, world: int) -> None:
    """optimizer.moments_dtype=bfloat16 runs in MasterAdamW, and only with a beta2 bf16 can follow."""
    refuse(cfg, world, "optimizer.moments_dtype=bfloat16")
    if cfg.optimizer.beta2 > 0.99:
        # v moves by (1 - beta2) of its gap to g^2 per step; bf16 keeps 8 significant bits, so below
        # about 1% the rounded store swallows the move and v stops following the gradients
        raise ConfigError(f"optimizer.moments_dtype=bfloat16 with optimizer.beta2={cfg.optimizer.beta2}: the second "
                          f"moment would change by less than bf16 resolves per step; use beta2 <= 0.99 or float32")


def check_combination(cfg: JobConfig, world: int, ranks_per_host: int | None = None) -> None:
    """Combinations that cannot work, refused with the reason: at start-up, and before torchrun by
    `python -m titanlite.config.check` (so a multi-rank run gets one line, not a worker traceback).
    `ranks_per_host`: the launcher's (titanlite.parallel.launcher_env.Launch), None where unknown."""
    check_world_size(cfg, world)
    if run_mode(cfg, world).name == "hsdp":
        hsdp_shape(parallel_settings(cfg).data_parallel, world, ranks_per_host)
    if cfg.training.cuda_graphs:
        check_cuda_graphs(cfg, world)
    if cfg.optimizer.moments_dtype == "bfloat16":
        check_moments_dtype(cfg, world)
    if cfg.compile.coordinate_descent_tuning and not cfg.compile.enable:
        raise ConfigError("compile.coordinate_descent_tuning needs compile.enable: without compile there are no "
                          "generated kernels to tune")
    if cfg.parallelism.fsdp_copy_engine_all_gather == "on" and not MODES[cfg.parallelism.data_parallel].shards_params:
        raise ConfigError(f"parallelism.fsdp_copy_engine_all_gather=on with parallelism.data_parallel="
                          f"{cfg.parallelism.data_parallel}: only fsdp and hsdp gather parameters")
    if cfg.parallelism.fsdp_accumulate == "sharded" and not MODES[cfg.parallelism.data_parallel].shards_params:
        raise ConfigError(f"parallelism.fsdp_accumulate=sharded with parallelism.data_parallel="
                          f"{cfg.parallelism.data_parallel}: only fsdp and hsdp shard the gradients")
    check_bf16_transport(cfg, "cuda")  # a GPU's compute here; check_launch knows whether there is one


def check_bf16_transport(cfg: JobConfig, device_type: str) -> None:
    """parallelism.fsdp_gradient_transport=bfloat16 refused where a run on `device_type` has no bf16 FSDP
    gradients to carry (policy.bf16_gradients_refusal)."""
    if cfg.parallelism.fsdp_gradient_transport == "bfloat16":
        settings = parallel_settings(cfg)
        if why := bf16_gradients_refusal(settings.data_parallel, settings.precision, device_type):
            raise bf16_transport_error(why)


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: JobConfig) -> str:
    lines = []
    for section, table in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for k, v in table.items():
            # a config file cannot name another one: where the values came from stays a comment
            comment = "# " if (section, k) == ("job", "config_file") else ""
            lines.append(f"{comment}{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def help_text() -> str:
    out = ["usage: ./run_train.sh [--job.config_file X.toml] [--section.key value | --section.key=value ...]",
           "Booleans: --compile.enable / --compile.enable=false. Lists: comma-separated. CLI > TOML > defaults.", ""]
    for section, cls in _sections().items():
        out.append(f"[{section}]")
        for name, (tp, f) in _fields(cls).items():
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            bounds = "".join(f" {b}={f.metadata[b]}" for b in ("min", "max") if b in f.metadata)
            choices = registry_choices(f)
            kind = "one of " + ", ".join(choices) if choices else _type_name(tp)
            out.append(f"  --{section}.{name} ({kind}; default {default!r}{bounds})")
            out.append(f"      {f.metadata.get('help', '')}")
        out.append("")
    return "\n".join(out)


def run_cli(main, argv: list[str] | None = None) -> None:
    """Run `main(argv)`; a ConfigError becomes one line on stderr and exit code 2 (and a closed pipe on
    stdout ends it quietly, errors.to_pipe)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        sys.exit(0)
    try:
        code = to_pipe(main, argv)
    except ConfigError as e:
        if Launch.from_environ().is_main:  # every rank finds the same error: one line
            print(f"error: {e}", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)
    if code:  # the mains return nothing; a code is to_pipe's, where stdout's reader went away
        sys.exit(code)
