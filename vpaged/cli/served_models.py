"""The models of one `vpaged serve`: MODEL, `--model NAME=PATH` (repeatable) and `--models-config FILE`.

    vpaged serve random:llama-tiny                                  # one model, named random:llama-tiny
    vpaged serve --model tiny=random:llama-tiny --model small=/models/smol --kv-budget-mib 4096
    vpaged serve --models-config models.toml                        # with options per model

A models file (TOML; JSON when its name ends in .json) has one table per model under `models`: `path` is the
model (a directory or random:NAME), every other key an engine option (an EngineConfig field by its name:
max_model_len, kv_dtype, kv_budget_bytes, kv, ...) of that model alone, over the command line's flags:

    [models.tiny]
    path = "random:llama-tiny"
    max_model_len = 512

    [models.small]
    path = "/models/smol"
    kv_dtype = "int8"
    kv_budget_bytes = "256MiB"    # sizes in bytes or with a unit, as --page-size takes them

Several models share one KV budget (memory/budget/): the `--shared-budget NAME` given, else one
this server creates for itself (`serve-PID-XXXXXX`, of --kv-budget-mib, removed when the server ends), so
that the memory one model's finished burst leaves serves the next burst of another. Each model's pool is a
member named after the model (`vpaged budget show` lists them), and the model's own kv_budget_bytes (the
file's, else --kv-budget-mib) is its ceiling. Every error names the model and the field.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib  # Python 3.11+
except ImportError:  # pragma: no cover - Python 3.10: models files in JSON only
    tomllib = None

from ..errors import InvalidArgumentError, VPagedError
from ..serve.config import FLAT_OPTIONS, EngineConfig
from .engine_flags import PARSERS, byte_count, dest_of, engine_options, flag_of

# Options the server sets for every model: one budget for all of them, each member named after its model.
SET_BY_SERVER = ("shared_budget", "shared_budget_member")
_SIZES = ("kv_budget_bytes", "swap_bytes", "page_size")  # sizes a file may write with a unit ("256MiB")


@dataclass(frozen=True)
class ServedModel:
    """One model of the server: the name clients send, the model's path, and its own engine options."""

    name: str
    path: str
    options: dict = dataclasses.field(default_factory=dict)  # EngineConfig's flat options, over the flags'


def model_flag(text: str) -> tuple[str | None, str]:
    """--model's value: NAME=PATH, or a bare PATH (its name is then the path, as MODEL's is)."""
    name, sep, path = text.partition("=")
    if not sep:
        return None, text
    if not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"--model takes NAME=PATH (or a bare PATH), got {text!r}")
    return name.strip(), path.strip()


def _option_value(name: str, value, where: str):
    if name in _SIZES and isinstance(value, str):
        try:
            return byte_count(value)
        except argparse.ArgumentTypeError as e:
            raise InvalidArgumentError(f"{where}: {name}: {e}") from None
    parse = PARSERS.get(name)
    if parse is not None and isinstance(value, str):
        try:
            return parse(value)
        except (KeyError, ValueError, argparse.ArgumentTypeError):
            raise InvalidArgumentError(f"{where}: {name}: not a valid value: {value!r}") from None
    return value


def read_models_file(path: str) -> list[ServedModel]:
    """The models of a models file (see the module); InvalidArgumentError naming the file, the model and the
    field for anything it cannot use."""
    file = Path(path)
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise InvalidArgumentError(f"--models-config {path}: cannot read it: {e.strerror or e}") from None
    if file.suffix != ".json" and tomllib is None:
        raise InvalidArgumentError(f"--models-config {path}: TOML needs Python 3.11 or later; give a .json file")
    try:
        data = json.loads(raw) if file.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as e:  # tomllib.TOMLDecodeError and JSONDecodeError are ValueErrors
        kind = "JSON" if file.suffix == ".json" else "TOML"
        raise InvalidArgumentError(f"--models-config {path}: not valid {kind}: {e}") from None
    if not isinstance(data, dict) or set(data) - {"models"}:
        extra = sorted(set(data) - {"models"}) if isinstance(data, dict) else []
        raise InvalidArgumentError(
            f"--models-config {path}: expected a `models` table of one table per model"
            + (f", not the keys {extra}" if extra else "")
        )
    tables = data.get("models")
    if not isinstance(tables, dict) or not tables:
        raise InvalidArgumentError(f"--models-config {path}: `models` must be a table of one table per model")
    models = []
    for name, table in tables.items():
        where = f"--models-config {path}: model {name!r}"
        if not name.strip():
            raise InvalidArgumentError(f"--models-config {path}: a model's name must not be empty")
        if not isinstance(table, dict):
            raise InvalidArgumentError(f"{where}: expected a table of path and options, got {table!r}")
        model_path = table.get("path")
        if not isinstance(model_path, str) or not model_path.strip():
            raise InvalidArgumentError(f"{where}: path: give the model (a directory or random:NAME) as a string")
        options = {}
        for key, value in table.items():
            if key == "path":
                continue
            if key in SET_BY_SERVER:
                raise InvalidArgumentError(f"{where}: {key}: set by the server for every model (--shared-budget)")
            if key not in FLAT_OPTIONS:
                raise InvalidArgumentError(f"{where}: {key}: not an engine option (EngineConfig's fields)")
            if key == "kv_dtype" and value == "auto":
                continue  # the default: the model's dtype
            options[key] = _option_value(key, value, where)
        models.append(ServedModel(name, model_path, options))
    return models


def served_models(args) -> list[ServedModel]:
    """Every model `vpaged serve` was given: MODEL (named by --served-model-name, else itself), each --model,
    each table of --models-config, in that order."""
    models = []
    if args.model is not None:
        models.append(ServedModel(args.served_model_name or args.model, args.model))
    elif args.served_model_name is not None:
        raise InvalidArgumentError("--served-model-name names MODEL; name a --model with NAME=PATH instead")
    models += [ServedModel(name or path, path) for name, path in args.models or ()]
    if args.models_config is not None:
        models += read_models_file(args.models_config)
    if not models:
        raise InvalidArgumentError("give a model: MODEL, --model NAME=PATH (repeatable) or --models-config FILE")
    seen = set()
    for m in models:
        if m.name in seen:
            raise InvalidArgumentError(f"two models are named {m.name!r}: each served model needs its own name")
        seen.add(m.name)
    return models


def use_only_model(args, model: ServedModel) -> None:
    """Make args those of one model served alone (today's path: MODEL and its flags), its file options included."""
    args.model, args.served_model_name = model.path, model.name
    for name, value in model.options.items():
        setattr(args, dest_of(name), value)
    if args.shared_budget is not None and args.shared_budget_member is None:
        args.shared_budget_member = model.name  # `vpaged budget show` names the member after the model


def engine_configs(models: list[ServedModel], args, budget: str) -> dict[str, EngineConfig]:
    """The EngineConfig of each model: the flags, then its own options, in `budget` as a member of its name.
    Checked before any model loads; the errors name the model (and, from the config, the field)."""
    base = engine_options(args)
    configs = {}
    for m in models:
        options = {**base, **m.options, "shared_budget": budget, "shared_budget_member": m.name}
        try:
            config = EngineConfig(**options)
        except (VPagedError, TypeError, ValueError) as e:
            raise InvalidArgumentError(f"model {m.name!r}: {e}") from None
        if config.unused_options:
            flags = ", ".join(flag_of(name) for name in config.unused_options)
            raise InvalidArgumentError(f"model {m.name!r}: {flags}: not an option of kv {config.kv}")
        if config.parallel.tensor_parallel_size != 1:
            raise InvalidArgumentError(
                f"model {m.name!r}: tensor_parallel_size: several models in one server run at 1 "
                "(serve a sharded model on its own: `vpaged serve MODEL --tensor-parallel-size N`)"
            )
        configs[m.name] = config
    return configs


def _budget_page_size(configs: dict[str, EngineConfig]) -> int:
    """The one page size of the models' pools (a budget counts pages of one size); the paged baseline
    reserves bytes, whatever its blocks."""
    from ..memory.device import default_page_size

    sizes = {}
    for name, config in configs.items():
        if config.kv != "paged":
            sizes[name] = config.store.page_size or default_page_size(config.model.device)
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{name!r}: {size}" for name, size in sizes.items())
        raise InvalidArgumentError(f"page_size: the models of one budget need one page size, got {listed}")
    return next(iter(sizes.values()), 64 << 10)


@contextlib.contextmanager
def several_engines(models: list[ServedModel], args):
    """Yields ({name: LLMEngine}, the budget's name, its capacity in bytes): every model's engine on one
    shared budget (the --shared-budget given, else one made here and removed on exit). The engines close on
    exit, also on SIGTERM (termination.py: while the models load, or once the server has stopped)."""
    from ..memory import SharedBudget
    from ..serve import LLMEngine, load_model
    from ..serve.http.termination import sigterm_raises

    budget = args.shared_budget
    made_here = budget is None
    if made_here:
        budget = f"serve-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    configs = engine_configs(models, args, budget)
    engines = {}
    with sigterm_raises():
        try:
            if made_here:
                handle = SharedBudget.create(budget, args.kv_budget_bytes, _budget_page_size(configs))
            else:
                handle = SharedBudget.open(budget)
            capacity = handle.capacity_bytes
            handle.close()  # each engine's pool opens the budget for itself
            for m in models:
                config = configs[m.name]
                try:
                    model, tokenizer = load_model(m.path, dtype=config.model.dtype)
                    engines[m.name] = LLMEngine(model, tokenizer, config=config)
                    engines[m.name].store.label_budget_member(m.path)  # `vpaged budget show`: name and model
                except VPagedError as e:
                    raise InvalidArgumentError(f"model {m.name!r} ({m.path}): {type(e).__name__}: {e}") from None
            yield engines, budget, capacity
        finally:
            for engine in engines.values():
                with contextlib.suppress(Exception):
                    engine.close()
            if made_here:  # this server's own budget: it ends with the server, whoever is still a member
                SharedBudget.remove(budget, force=True)
