"""The settings of a run, which `trustclip train` runs, `trustclip eval` reads back and `trustclip compare` plans:
dataclasses (every field documented in its metadata), loaded from a YAML recipe and overridden with `--set
section.key=value`. The defaults are the embedded CPU run (`trustclip train` with no arguments); recipes in
`recipes/` override them (e.g. the paper's Qwen3-1.7B setting).

Parsing and type checking are pydantic's (`from_dict`). HF's `HfArgumentParser` / TRL's `TrlParser` do not fit
this layout: they give each dataclass field one flat `--name` (the SFT and RL sections share `learning_rate`,
`max_steps`, ...), parse dict-valued fields only as JSON strings, and their `parse_dict` converts and checks no value.

Each setting is declared once, and every field of a section is visible in its class: a field TRL's `SFTConfig` or
trustclip's `TrustClipGRPOConfig` also has takes its help and default from there (`library_option`; a value given
there is the embedded run's own), the evaluation settings are `trustclip.evaluation.EvalArgs`, and the stages hand
exactly those fields to TRL, each to the field its declaration names (`library_settings`, `train/stages.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError
from trl import SFTConfig

from trustclip.data.synthetic import LEVELS
from trustclip.data.templates import resolve_template
from trustclip.evaluation.config import EvalArgs, EvalConfig
from trustclip.integrations.trl.config import TrustClipGRPOConfig
from trustclip.models import TinyModelConfig
from trustclip.options import STRICT, check, option
from trustclip.precision import resolve_bf16
from trustclip.rewards import DEFAULT_TIMEOUT

STAGES = ("sft", "rl", "eval")
# Options that say how a run is driven, not what it computes: they may differ when a run is resumed, and compare leaves
# them out of a run's fingerprint. `stages` is not one of them: which stages a run has decides what it computes (RL
# from the SFT model or from the base model; a shared SFT run is the stage sft alone), so a resumed run keeps them.
RUN_CONTROL = ("output_dir", "resume", "quiet", "plots", "report_to")
# TrainingArguments fields every stage takes from the top level of the config (train/stages.py: _trainer_args).
RUN_WIDE = ("output_dir", "seed", "report_to", "bf16", "use_cpu")


@dataclass
class ModelArgs:
    __pydantic_config__ = STRICT

    name_or_path: StrictStr = option("builtin:tiny", "Hub id, local checkpoint, or `builtin:tiny` (cached tiny Qwen3).")
    dtype: StrictStr = option("auto", "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16.")
    trust_remote_code: StrictBool = option(False, "Passed to from_pretrained.")
    # builtin:tiny's own layer count, stated (a run's config records it; compare fingerprints hash it)
    tiny: dict[str, Any] = option({"num_layers": TinyModelConfig.num_layers}, "Shape of builtin:tiny "
                                  "(build_tiny_model kwargs, e.g. {hidden_size: 128}; unset keys: builtin:tiny's own "
                                  "shape); each shape is built once and cached.")
    lora: StrictBool = option(False, "Train a LoRA adapter (peft) instead of all weights, in SFT and RL.")
    lora_r: StrictInt = option(32, "LoRA rank.")
    lora_alpha: StrictInt = option(64, "LoRA alpha.")
    lora_dropout: StrictFloat = option(0.0, "LoRA dropout.")
    lora_target_modules: list[StrictStr] = option(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "Modules given adapters."
    )

    def __post_init__(self) -> None:
        check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype", self.dtype,
               "auto, float32, bfloat16 or float16")
        check(self.lora_r >= 1, "model.lora_r", self.lora_r, ">= 1")
        check(self.lora_alpha > 0, "model.lora_alpha", self.lora_alpha, "> 0")
        check(0 <= self.lora_dropout < 1, "model.lora_dropout", self.lora_dropout, "in [0, 1)")
        check(bool(self.lora_target_modules), "model.lora_target_modules", self.lora_target_modules, "non-empty")


@dataclass
class DataArgs:
    __pydantic_config__ = STRICT

    train: StrictStr = option("builtin:train", "RL prompts: JSONL/JSON/parquet file, hub dataset id, or "
                              "builtin:<split>.")
    train_split: StrictStr = option("train", "Split of a hub training dataset.")
    train_subset: StrictStr | None = option(None, "Subset (config name) of a hub training dataset.")
    train_limit: StrictInt | None = option(None, "Keep only the first N training prompts.")
    problem_key: StrictStr = option("problem", "Field holding the problem text.")
    answer_key: StrictStr = option("answer", "Field holding the reference answer.")
    answer_fallback: StrictBool = option(False, "Score a completion without a \\boxed{} answer by its last `Answer:` "
                                         "line or last number (RL reward and eval). Off: the boxed answer the prompt "
                                         "asks for is required, so RL cannot learn to drop the format and be scored "
                                         "on a bare number.")
    eval: list[StrictStr] = option(["builtin"], "Held-out benchmarks: NAME=SOURCE specs, or `builtin` (the synthetic "
                                   "splits).")
    eval_split: StrictStr = option("train", "Split of hub benchmark datasets.")
    eval_limit: StrictInt | None = option(None, "Keep only the first N problems of each benchmark.")
    prompt_style: StrictStr = option("auto", "Prompt template: auto, math, tiny, raw, or a template containing "
                                     "{problem}.")
    system_prompt: StrictStr | None = option(None, "System prompt of every prompt (SFT, RL and evaluation alike). "
                                             "null: the chat template's own default (SmolLM2's names the model, 16 "
                                             "tokens); \"\": an empty system turn, the shortest prompt.")
    seed: StrictInt = option(0, "Seed of the built-in synthetic task.")
    builtin_train_levels: list[StrictInt] = option([2, 3, 4], "Levels of the built-in task's train split (1-4).")
    builtin_n_train: StrictInt = option(2000, "Problems in the built-in train split (the RL pool; SFT takes its first "
                                        "sft.limit).")
    builtin_n_eval: StrictInt = option(64, "Problems in each built-in held-out split.")
    builtin_max_operand: StrictInt | None = option(9, "Largest operand of the built-in task (null: the task's own, "
                                                   "99).")

    def __post_init__(self) -> None:
        _positive(self, "data", ("builtin_n_train", "builtin_n_eval"))
        check(self.builtin_max_operand is None or self.builtin_max_operand >= 9, "data.builtin_max_operand",
               self.builtin_max_operand, ">= 9 (or null)")
        check(bool(self.builtin_train_levels) and set(self.builtin_train_levels) <= set(LEVELS),
               "data.builtin_train_levels", self.builtin_train_levels, f"a non-empty list of levels {sorted(LEVELS)}")
        _positive(self, "data", ("train_limit", "eval_limit"), nullable=True)
        check(bool(self.eval), "data.eval", self.eval, "at least one benchmark")
        try:
            resolve_template(self.prompt_style)
        except ValueError as err:
            raise ValueError(f"data.prompt_style: {err}") from None


def _check_optimizer(section: Any, name: str) -> None:
    _positive(section, name, ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps"))
    check(section.learning_rate > 0, f"{name}.learning_rate", section.learning_rate, "> 0")
    check(section.warmup_steps >= 0, f"{name}.warmup_steps", section.warmup_steps, ">= 0")
    check(section.weight_decay >= 0, f"{name}.weight_decay", section.weight_decay, ">= 0")


def library_option(library: type, name: str, *own: Any, rule: str = "") -> Any:
    """A section field that is also the field `name` of `library` (TRL's SFTConfig, TrustClipGRPOConfig), which the
    stage hands over to that field (`library_settings`): the library's help, plus `rule` (what trustclip train
    requires beyond the library's own checks, or how it reads the field), and the library's default unless the
    section states its own (`own`: the embedded CPU run's value). The section declares the field's type, strictly (no
    bool for an int, no string for a number; a step count TRL also takes as a fraction of the run keeps a whole number
    whole)."""
    declared = {f.name: f for f in dataclasses.fields(library)}.get(name)
    if declared is None:  # a misspelt or stale name would otherwise reach TRL only when the stage runs
        raise TypeError(f"{library.__name__} has no field {name!r}")
    help_text = declared.metadata["help"] + (f" In trustclip train: {rule}." if rule else "")
    return option(own[0] if own else declared.default, help_text, library_field=name)


def library_settings(section: Any) -> dict[str, Any]:
    """The section's `library_option` fields as the library's keyword arguments ({library field: value}): the one
    hand-over from a recipe section to TRL's config, declared field by field above."""
    return {f.metadata["library_field"]: getattr(section, f.name)
            for f in dataclasses.fields(section) if "library_field" in f.metadata}


@dataclass
class SFTArgs:
    """The SFT stage (TRL's SFTTrainer). SFT is for the format, not the skill: a small part of the pool, few steps at a
    high constant rate."""

    __pydantic_config__ = STRICT

    max_steps: StrictInt = library_option(SFTConfig, "max_steps", 200)
    learning_rate: StrictFloat = library_option(SFTConfig, "learning_rate", 3e-3)
    lr_scheduler_type: StrictStr = library_option(SFTConfig, "lr_scheduler_type", "constant")
    warmup_steps: StrictInt | StrictFloat = library_option(SFTConfig, "warmup_steps")
    weight_decay: StrictFloat = library_option(SFTConfig, "weight_decay")
    per_device_train_batch_size: StrictInt = library_option(SFTConfig, "per_device_train_batch_size", 64)
    gradient_accumulation_steps: StrictInt = library_option(SFTConfig, "gradient_accumulation_steps")
    max_length: StrictInt | None = library_option(SFTConfig, "max_length", 256)
    data: StrictStr | None = option(None, "SFT rows (with worked solutions); default: the RL training source.")
    split: StrictStr = option("train", "Split of a hub SFT dataset.")
    subset: StrictStr | None = option(None, "Subset of a hub SFT dataset.")
    solution_key: StrictStr = option("solution", "Field holding the worked solution (the SFT target).")
    problem_key: StrictStr | None = option(None, "Problem field of the SFT rows (default: data.problem_key).")
    answer_key: StrictStr | None = option(None, "Answer field of the SFT rows (default: data.answer_key).")
    limit: StrictInt | None = option(400, "Keep only the first N SFT rows (null: all). SFT is for the format: it sees "
                                     "a small part of the pool, RL the whole of it.")

    def __post_init__(self) -> None:
        _check_optimizer(self, "sft")
        _positive(self, "sft", ("limit", "max_length"), nullable=True)


_GRPO = TrustClipGRPOConfig
_A_NAME = "a name (a recipe states it)"


@dataclass
class RLArgs:
    """The RL stage (TrustClipGRPOTrainer): 64 prompts x G = 4 = 256 completions per micro-batch, large because a
    binary reward carries one bit per completion; the peak rate decays on a cosine to 0 at max_steps. An unfinished
    answer scores 0 (truncated_reward), so the policy keeps stopping after its answer, and zero-advantage groups are
    left out of the update (same direction, less compute). The sampler is HF generate unless use_vllm; vLLM runs in the
    training process (colocate: one machine, CPU or GPU), not as TRL's default separate server. The library resolves
    an unset objective / aggregation / advantage_estimator to kl3 / dr_grpo / dr_grpo; here a recipe states them."""

    __pydantic_config__ = STRICT

    max_steps: StrictInt = library_option(_GRPO, "max_steps", 350)
    learning_rate: StrictFloat = library_option(_GRPO, "learning_rate", 2e-4)
    lr_scheduler_type: StrictStr = library_option(_GRPO, "lr_scheduler_type", "cosine")
    warmup_steps: StrictInt | StrictFloat = library_option(_GRPO, "warmup_steps")
    weight_decay: StrictFloat = library_option(_GRPO, "weight_decay")
    per_device_train_batch_size: StrictInt = library_option(
        _GRPO, "per_device_train_batch_size", 256, rule="counts completions (prompts x num_generations)")
    gradient_accumulation_steps: StrictInt = library_option(_GRPO, "gradient_accumulation_steps")
    objective: StrictStr | None = library_option(_GRPO, "objective", "kl3", rule=_A_NAME)
    objective_kwargs: dict[str, Any] | StrictStr | None = library_option(
        _GRPO, "objective_kwargs", {"delta": 0.07}, rule="a mapping ({}: the objective's own defaults)")
    aggregation: StrictStr | None = library_option(_GRPO, "aggregation", "dr_grpo", rule=_A_NAME)
    advantage_estimator: StrictStr | None = library_option(_GRPO, "advantage_estimator", "dr_grpo", rule=_A_NAME)
    max_grad_norm: StrictFloat = library_option(_GRPO, "max_grad_norm", rule="> 0 (it always clips)")
    num_generations: StrictInt | None = library_option(_GRPO, "num_generations", 4)
    num_iterations: StrictInt = library_option(_GRPO, "num_iterations", 2)
    steps_per_generation: StrictInt | None = library_option(_GRPO, "steps_per_generation")
    temperature: StrictFloat = library_option(_GRPO, "temperature", 0.7)
    top_p: StrictFloat = library_option(_GRPO, "top_p")
    top_k: StrictInt = library_option(_GRPO, "top_k")
    max_completion_length: StrictInt | None = library_option(_GRPO, "max_completion_length", 32)
    beta: StrictFloat = library_option(_GRPO, "beta")
    mask_truncated_completions: StrictBool = library_option(_GRPO, "mask_truncated_completions")
    truncated_reward: StrictFloat | None = library_option(_GRPO, "truncated_reward", 0.0)
    skip_zero_advantage: StrictBool = library_option(_GRPO, "skip_zero_advantage", True)
    save_steps: StrictInt | StrictFloat = library_option(_GRPO, "save_steps", 50, rule="an integer >= 1")
    save_total_limit: StrictInt | None = library_option(_GRPO, "save_total_limit", 2)
    logging_steps: StrictInt | StrictFloat = library_option(_GRPO, "logging_steps", 1, rule="an integer >= 1")
    use_vllm: StrictBool = library_option(_GRPO, "use_vllm")
    vllm_mode: StrictStr = library_option(_GRPO, "vllm_mode", "colocate")
    vllm_enforce_eager: StrictBool = library_option(_GRPO, "vllm_enforce_eager")
    vllm_importance_sampling_correction: StrictBool = library_option(_GRPO, "vllm_importance_sampling_correction")
    merged_lora_forward: StrictBool = library_option(_GRPO, "merged_lora_forward")
    reward_timeout: StrictFloat = option(DEFAULT_TIMEOUT, "Hard per-answer timeout of math-verify (seconds), in the "
                                         "RL reward and the evaluation.")
    eval_every: StrictInt = option(0, "Evaluate the held-out benchmarks every N steps during RL (0: off), with HF "
                                     "generate on the model in memory, whatever eval.backend says.")
    trl_kwargs: dict[str, Any] = option({}, "Extra GRPOConfig fields, e.g. {entropy_coef: 0.001, "
                                        "top_entropy_quantile: 0.2}.")

    def __post_init__(self) -> None:
        _check_optimizer(self, "rl")
        _positive(self, "rl", ("num_generations", "num_iterations", "max_completion_length", "save_steps",
                               "logging_steps"))
        for name in ("objective", "aggregation", "advantage_estimator"):  # the library's None: a recipe names them
            check(isinstance(getattr(self, name), str), f"rl.{name}", getattr(self, name), "a name")
        check(isinstance(self.objective_kwargs, dict), "rl.objective_kwargs", self.objective_kwargs, "a mapping")
        check(self.temperature > 0, "rl.temperature", self.temperature, "> 0")
        check(0 < self.top_p <= 1, "rl.top_p", self.top_p, "in (0, 1]")
        check(self.top_k >= 0, "rl.top_k", self.top_k, ">= 0 (0 = off)")
        check(self.max_grad_norm > 0, "rl.max_grad_norm", self.max_grad_norm, "> 0")
        check(self.reward_timeout > 0, "rl.reward_timeout", self.reward_timeout, "> 0 seconds")
        check(self.eval_every >= 0, "rl.eval_every", self.eval_every, ">= 0")
        _positive(self, "rl", ("steps_per_generation", "save_total_limit"), nullable=True)
        own = sorted(set(self.trl_kwargs) & {f.name for f in dataclasses.fields(self)})
        check(not own, "rl.trl_kwargs", self.trl_kwargs, f"free of rl options ({', '.join(own)}: set rl.<name>)")
        shared = sorted(set(self.trl_kwargs) & set(RUN_WIDE))  # set once for every stage, at the top level
        check(not shared, "rl.trl_kwargs", self.trl_kwargs,
               f"free of run-wide settings ({', '.join(shared)}: set them at the top level, e.g. --set bf16=true)")


@dataclass
class TrainConfig:
    __pydantic_config__ = STRICT

    output_dir: StrictStr = option("runs/default", "Where checkpoints, metrics.jsonl, plots and summary.json go.")
    stages: list[StrictStr] = option(list(STAGES), "Stages to run, in order: sft, rl, eval.")
    seed: StrictInt = option(0, "Training seed.")
    bf16: StrictBool | None = option(None, "Mixed precision (TrainingArguments' bf16) in SFT, RL and evaluation: "
                                     "bfloat16 autocast over float32 weights, with the LM head, log-probs and ratio "
                                     "in float32. null: on with a bfloat16 GPU, off on CPU; true on a CPU without "
                                     "bfloat16 instructions is an error.")
    report_to: list[StrictStr] = option(["tensorboard"], "Trainer logging integrations (tensorboard, wandb, none, "
                                        "...).")
    resume: StrictBool = option(False, "Continue the interrupted run in output_dir from its last checkpoint, with its "
                                "settings (config.yaml).")
    plots: StrictBool = option(True, "Write PNG training curves at the end.")
    quiet: StrictBool = option(False, "Print only the final table (no progress lines).")
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    sft: SFTArgs = field(default_factory=SFTArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)

    def __post_init__(self) -> None:
        check(set(self.stages) <= set(STAGES), "stages", self.stages, f"a subset of {list(STAGES)}")
        check(len(set(self.stages)) == len(self.stages), "stages", self.stages, "without repeats")
        check(bool(self.output_dir.strip()), "output_dir", self.output_dir, "a directory path")
        self.stages = [s for s in STAGES if s in self.stages]  # always run in pipeline order
        self.report_to = [r for r in self.report_to if r != "none"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def evaluates(self) -> bool:
        return "eval" in self.stages or ("rl" in self.stages and self.rl.eval_every > 0)


def _positive(obj: Any, section: str, names: tuple[str, ...], *, nullable: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (nullable and value is None):
            check(isinstance(value, int) and value >= 1, f"{section}.{name}", value,
                  ">= 1 (or null)" if nullable else "an integer >= 1")


# ------------------------------------------------------------------ dict <-> dataclass
_adapter = functools.cache(TypeAdapter)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build dataclass `cls` from a (nested) dict: a section given in part keeps the defaults of the rest, any other
    value replaces its default. Raises ValueError naming every bad key (unknown, wrong type, invalid value)."""
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a mapping of options, got {type(data).__name__} ({data!r})")
    try:
        return _adapter(cls).validate_python(data)
    except ValidationError as err:
        raise ValueError("; ".join(_describe(e, cls) for e in err.errors())) from None


def _describe(error: dict[str, Any], cls: type) -> str:
    """One pydantic error as `dotted.name=value is invalid: ...` (or `unknown option ...; valid: ...`)."""
    loc = [str(part) for part in error["loc"] if not isinstance(part, int)]
    name = ".".join(loc) or "config"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "value_error":
        return message  # our own __post_init__ checks name the key already
    if error["type"] == "unexpected_keyword_argument":
        section = field_hint(".".join(loc[:-1]), cls)
        valid = ", ".join(".".join([*loc[:-1], f.name]) for f in dataclasses.fields(section))
        return f"unknown option {name}; valid: {valid}"
    if error["type"] in ("dataclass_type", "dataclass_args_type"):
        return f"{name}: expected a mapping of options, got {error['input']!r}"
    return f"{name}={error['input']!r} is invalid: {message[0].lower()}{message[1:]}"


def field_hint(key: str, root: type | None = None) -> Any:
    """Type hint of the dotted option `key` of `root` (TrainConfig; "": root itself; None for an unknown key or one
    inside a mapping value)."""
    cls: Any = root or TrainConfig
    for part in filter(None, key.split(".")):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """data["rl"]["learning_rate"] = value for key "rl.learning_rate" (creating sections as needed). A string given
    to a list option is split at commas (`--set stages=rl,eval`)."""
    if isinstance(value, str) and typing.get_origin(field_hint(key)) is list:
        value = [v.strip() for v in value.split(",") if v.strip()]
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {key}: {part!r} is not a section")
        node = child
    node[leaf] = value


def get_dotted(data: dict[str, Any], key: str) -> Any:
    return functools.reduce(operator.getitem, key.split("."), data)


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus YAML 1.2's floats without a dot (`1e-5`), which it reads as strings."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ValueError(" ".join(str(err).split())) from None


def parse_value(raw: str) -> Any:
    """A value as a command line writes it (`--set`, `--sweep`), read as YAML: numbers (`1e-5` too),
    true/false, null, [a, b], {k: v}; nothing is ""."""
    try:
        return yaml_load(raw) if raw.strip() else ""
    except ValueError as err:
        raise ValueError(f"value {raw!r} is not valid YAML ({err})") from None


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value` -> (key, `parse_value(value)`)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE, e.g. rl.learning_rate=1e-5")
    try:
        return key, parse_value(raw)
    except ValueError as err:
        raise ValueError(f"--set {text!r}: {err}") from None


def load_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe as a dict. `base: other.yaml` (relative to the recipe) is loaded first and deep-merged under it,
    so a baseline recipe states only what differs from the recipe it extends."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.resolve() in _seen:
        raise ValueError(f"{path}: circular `base:` chain {' -> '.join(map(str, _seen))}")
    try:
        data = yaml_load(path.read_text(encoding="utf-8")) or {}
    except ValueError as err:  # UnicodeDecodeError too
        raise ValueError(f"{path}: invalid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of options at the top level, got {type(data).__name__}")
    data.pop("description", None)  # free text for humans
    own_objective_defaults(data)
    base = data.pop("base", None)
    if base is None:
        return data
    return deep_merge(load_yaml(path.parent / base, (*_seen, path.resolve())), data)


# Mappings that are values, not sections: a recipe's objective_kwargs replaces its base's.
REPLACED_MAPPINGS = ("objective_kwargs", "trl_kwargs")


def deep_merge(base: dict[str, Any], override: dict[str, Any], replaced: tuple[str, ...] = REPLACED_MAPPINGS
               ) -> dict[str, Any]:
    """Sections merge key by key; any other value (lists, and the mappings `replaced`) is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in replaced:
            out[key] = deep_merge(out[key], value, replaced)
        else:
            out[key] = value
    return out


def name_objective(rl: dict[str, Any], objective: str, kwargs: dict[str, Any] | None = None, *,
                   keep_own: bool = False) -> dict[str, Any]:
    """Name `objective` in `rl`, the rl section of a layer of settings: the one rule for which hyper-parameters apply
    when an objective is named (a recipe file, `--objective`, `--set rl.objective=...`, `--set rl={...}`, an
    objective compare runs). They are `kwargs` over the objective's own defaults: the section's objective_kwargs
    belonged to the objective named before (the embedded default's delta 0.07, a base recipe's) and do not carry
    over, except with `keep_own` when that objective is this one under any name (compare keeps a recipe's
    hyper-parameters for the recipe's own objective). Returns the hyper-parameters kept from the section."""
    from trustclip.objectives.registry import resolve_name

    kept: dict[str, Any] = {}
    if keep_own and resolve_name(rl["objective"]).name == resolve_name(objective).name:
        kept = dict(rl.get("objective_kwargs") or {})
    rl["objective"], rl["objective_kwargs"] = objective, kept | dict(kwargs or {})
    return kept


def own_objective_defaults(data: dict[str, Any]) -> None:
    """A layer of settings (a recipe file, a `--set rl={...}`) that names `rl.objective` without
    `rl.objective_kwargs` means that objective at its own defaults (`name_objective`)."""
    rl = data.get("rl")
    if isinstance(rl, dict) and "objective" in rl and "objective_kwargs" not in rl:
        name_objective(rl, rl["objective"])


def explicit_settings(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                      objective: str | None = None, reset_objective_kwargs: bool = True,
                      **top_level: Any) -> dict[str, Any]:
    """What a command line states, as a nested dict (no defaults), in this order: the recipe; `objective` or `--set
    rl.objective=NAME` (its hyper-parameters reset to the objective's own unless `reset_objective_kwargs` is False, as
    on resume); the other `--set` overrides (so `rl.objective_kwargs.delta=0.1` applies to the new objective);
    `top_level` values (dotted keys; None: not given)."""
    data = load_yaml(path) if path else {}
    parsed = [parse_override(text) for text in overrides]
    named = [value for key, value in parsed if key == "rl.objective"]
    if named and objective is not None and any(value != objective for value in named):
        raise ValueError(f"--objective {objective} and --set rl.objective={named[-1]} name two objectives; give one")
    objective = named[-1] if named else objective
    if objective is not None:
        set_dotted(data, "rl.objective", objective)
        if reset_objective_kwargs:
            name_objective(data["rl"], objective)
    for key, value in parsed:
        if key != "rl.objective":
            set_dotted(data, key, value)
            if key == "rl" and isinstance(value, dict):  # --set 'rl={objective: X}': X at its own defaults too
                own_objective_defaults(data)
    for key, value in top_level.items():
        if value is not None:
            set_dotted(data, key, value)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                **top_level: Any) -> TrainConfig:
    """Defaults <- YAML recipe <- `--set` overrides <- explicit top-level values (e.g. output_dir=...)."""
    return from_dict(TrainConfig, explicit_settings(path, overrides, **top_level))


# Settings added after runs were saved, with the value such a run used (its config.yaml lacks them): resumed, it
# continues with that value, not with the new default.
EARLIER_VALUES: dict[str, dict[str, Any]] = {"rl": {"merged_lora_forward": False}}


def resume_config(explicit: dict[str, Any]) -> TrainConfig:
    """The configuration of the run being resumed: its saved config.yaml, with what the command line states on top
    (`check_run` then refuses a stated value that differs from the run's: a resumed run continues the run it
    resumes)."""
    out = Path(explicit.get("output_dir") or TrainConfig.output_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"--resume: {out} does not exist: there is no run to resume (drop --resume to start "
                                "one, or give the run's --output-dir)")
    saved = read_run_config(out / "config.yaml", "--resume")
    for section, values in EARLIER_VALUES.items():  # a run saved before a setting existed keeps what it did then
        if isinstance(saved.get(section), dict):
            saved[section] = {**values, **saved[section]}
    # quiet is this command's choice, not the run's; `--set rl.objective_kwargs.delta=...` touches one value
    return from_dict(TrainConfig, deep_merge({**saved, "quiet": False}, {**explicit, "resume": True}, replaced=()))


def read_run_config(path: Path, what: str) -> dict[str, Any]:
    """A run's saved settings (its config.yaml) as a dict, checked: a missing file, or one that is not YAML, not a
    mapping, or holds settings this version rejects, is an error naming the file (`what`: the option reading it)."""
    if not path.is_file():
        raise FileNotFoundError(f"{what}: {path.parent} holds no trustclip run ({path.name} is missing)")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        detail = " ".join(str(err).split())
        raise ValueError(f"{what}: {path} is not a readable run configuration ({detail}); restore it from a copy, "
                         "or start a new run in another output folder") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} is not a run configuration (a mapping of options; got "
                         f"{type(data).__name__}); restore it, or start a new run in another output folder")
    try:
        from_dict(TrainConfig, data)
    except ValueError as err:
        raise ValueError(f"{what}: {path} holds settings this trustclip rejects: {err}") from None
    return data


def _options(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field]]:
    """(dotted name, value, field) of every option of the dataclass `obj` (a mapping such as rl.objective_kwargs is
    one option)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _options(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value, f


def changed_settings(config: TrainConfig, saved: dict[str, Any]) -> list[str]:
    """`key=value (the run has value)` for each option whose value in `config` differs from the saved run's
    (RUN_CONTROL aside): what a resumed run may not change."""
    before = {name: value for name, value, _ in _options(from_dict(TrainConfig, saved))}
    return [f"{name}={value!r} (the run has {before[name]!r})" for name, value, _ in _options(config)
            if name.split(".")[0] not in RUN_CONTROL and value != before[name]]


def option_table() -> list[tuple[str, str, str]]:
    """(dotted name, default, help) of every option, for `--help`."""
    return [(name, repr(value), f.metadata.get("help", "")) for name, value, f in _options(TrainConfig())]


# ------------------------------------------------------------------ settings derived for the stages
def model_dtype(config: TrainConfig) -> Any:
    """The torch dtype models of the run are loaded in (`model.dtype`; auto: bf16 on a bf16 GPU, else fp32)."""
    import torch

    if config.model.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return getattr(torch, config.model.dtype)


def eval_config(config: TrainConfig) -> Any:
    """The evaluation of a run: its `eval` section, with prompts written and answers scored as in its RL stage."""
    return EvalConfig(**dataclasses.asdict(config.eval), bf16=resolve_bf16(config.bf16),
                      prompt_style=config.data.prompt_style, system_prompt=config.data.system_prompt,
                      answer_fallback=config.data.answer_fallback,
                      reward_timeout=config.rl.reward_timeout, show_progress=not config.quiet)
