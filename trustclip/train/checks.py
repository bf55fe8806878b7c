"""`check_run(config)`: everything a run will need, checked before any model is loaded or any step runs, so that a
bad setting costs seconds, not an SFT stage and an evaluation. `trustclip train` (also with `--print-config`),
`trustclip compare` (every run, also with `--dry-run`) and `run_pipeline` itself call it. Reading and validating the
data rows themselves is the pipeline's next step, also before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.utils import HFValidationError
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

from trustclip.data.loaders import BUILTIN_PREFIX, parse_benchmark_spec
from trustclip.evaluation.generation import resolve_backend
from trustclip.files import read_json
from trustclip.input_checks import (
    check_benchmarks,
    check_generation_room,
    check_model,
    check_source,
    check_writable_dir,
)
from trustclip.integrations.trl.loss_options import OPTIONS, refuse_second_spelling
from trustclip.models import (
    TINY_MODEL_NAME,
    TinyModelConfig,
    build_tiny_model,
)
from trustclip.precision import resolve_bf16
from trustclip.settings import TrainConfig, changed_settings, read_run_config
from trustclip.train.stages import grpo_config, sft_config
from trustclip.vllm_env import CPU_HEAD_DIMS


@dataclass(frozen=True)
class CheckedRun:
    """A run's settings as `check_run` passed them: the config and the TRL configs of its training stages, each built
    once (TRL's checks and trustclip's run when they are built). `run_pipeline` runs it; the stages' trainers receive
    `sft` and `rl` as they are."""

    config: TrainConfig
    sft: Any = None  # TRL's SFTConfig of the sft stage; None without one
    rl: Any = None  # the TrustClipGRPOConfig of the rl stage (its objective resolved and checked); None without one


def check_run(config: TrainConfig) -> CheckedRun:
    """Everything the run needs, checked before any work: ValueError / FileNotFoundError naming the first setting the
    run cannot work with. Returns the run with its stages' TRL configs, built here once."""
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
    out = Path(config.output_dir)  # building a TRL config writes nothing to its output_dir
    sft = _trl_config(config, "sft", lambda: sft_config(config, out / "sft")) if "sft" in stages else None
    if "rl" in stages:
        check_trl_kwargs(config)
    rl = _trl_config(config, "rl", lambda: grpo_config(config, out / "rl")) if "rl" in stages else None
    if {"sft", "rl"} & set(stages):
        check_report_to(config.report_to)
    if config.model.lora and importlib.util.find_spec("peft") is None:
        raise ValueError("model.lora=true needs the peft package (pip install peft)")
    return CheckedRun(config, sft, rl)


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


def check_trl_kwargs(config: TrainConfig) -> None:
    """rl.trl_kwargs holds no TRL option the pipeline leaves without effect, and none of TRL's loss options: the rl
    section always gives objective, aggregation and advantage estimator, so TRL's spelling of them is refused as the
    library refuses it (`refuse_second_spelling`), naming the rl settings that compute what it means in TRL."""
    for key, value in config.rl.trl_kwargs.items():
        if key in NOT_APPLICABLE_HERE and value != NOT_APPLICABLE_HERE[key][0]:
            raise ValueError(f"rl.trl_kwargs.{key}={value!r}: {NOT_APPLICABLE_HERE[key][1]}")
    weights = config.rl.trl_kwargs.get("reward_weights")
    if weights is not None and not (isinstance(weights, list) and len(weights) == 1):
        raise ValueError(f"rl.trl_kwargs.reward_weights={weights!r}: trustclip train has one reward function (the "
                         "verified answer), so give one weight, or none")
    refuse_second_spelling({key: value for key, value in config.rl.trl_kwargs.items() if key in OPTIONS},
                           prefix="rl.")


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


def _trl_config(config: TrainConfig, section: str, build: Any) -> Any:
    """A stage's TRL config, built (TRL's checks and trustclip's run there); an error names the option as the recipe
    spells it (`as_recipe_spells`)."""
    try:
        return build()
    except TypeError as err:  # an unknown keyword: from rl.trl_kwargs
        raise ValueError(f"{section}.trl_kwargs: {err}") from None
    except ImportError as err:  # e.g. a deepspeed config without deepspeed
        raise ValueError(f"{section}.trl_kwargs: a package is missing: {' '.join(str(err).split())}") from None
    except ValueError as err:
        raise ValueError(as_recipe_spells(str(err), section, getattr(config, section))) from None


def as_recipe_spells(message: str, section: str, values: Any) -> str:
    """The one translation at the boundary with TRL's configs: their messages (TRL's and TrustClipGRPOConfig's) start
    with the option they refuse as the config spells it (`aggregation='mean' is invalid`); the recipe spells it
    `rl.aggregation` (a key of rl.trl_kwargs: `rl.trl_kwargs.KEY`). Any other message is said to be TRL's check."""
    name = message.partition("=")[0]
    if name in getattr(values, "trl_kwargs", {}):
        return f"{section}.trl_kwargs.{message}"
    if name in {f.name for f in dataclasses.fields(values)}:
        return f"{section}.{message}"
    return f"{section} (as TRL checks it): {message}"


def check_report_to(report_to: list[str]) -> None:
    available = get_available_reporting_integrations()
    for name in [name for name in report_to if name != "all"]:
        if name not in INTEGRATION_TO_CALLBACK:
            raise ValueError(f"report_to: unknown integration {name!r}; valid: none, all, "
                             f"{', '.join(INTEGRATION_TO_CALLBACK)}")
        if name not in available:
            raise ValueError(f"report_to: {name} is not installed (pip install {name}), or use --report-to none")


