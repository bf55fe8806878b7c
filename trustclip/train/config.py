"""Configuration of `trustclip train`: dataclasses (HF style, every field documented in its metadata), loaded
from a YAML recipe and overridden with `--set section.key=value`.

The defaults are the embedded CPU run (`trustclip train` with no arguments): a tiny Qwen3 model on the
built-in arithmetic task, SFT for format, ATR-GRPO (`kl3`, delta 0.07), evaluation before and after.
Recipes in `recipes/` override them (e.g. the paper's Qwen3-1.7B setting).

Parsing and type checking are pydantic's (`from_dict`): nested sections, unknown keys, strict types (no bool for
an int, no string for a number), finite floats, with the dotted name of every bad key. HF's `HfArgumentParser` /
TRL's `TrlParser` do not fit this layout: they give each dataclass field one flat `--name` (the SFT and RL
sections share `learning_rate`, `max_steps`, ...), parse dict-valued fields only as JSON strings, and their
`parse_dict` builds the dataclass without converting or checking any value.

Each setting is declared once: the optimiser fields of the SFT and RL stages in `OptimizerArgs` (each section
states only its defaults), the evaluation settings in `trustclip.evaluation.EvalArgs`, and the RL fields that
TRL's `GRPOConfig` also has are handed to it by name (`trustclip.train.stages.grpo_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr

from trustclip.evaluation.evaluator import EvalArgs
from trustclip.models import TinyModelConfig
from trustclip.rewards import DEFAULT_TIMEOUT

STAGES = ("sft", "rl", "eval")
# Options that say how a run is driven, not what it computes: they may differ when a run is resumed.
RUN_CONTROL = ("output_dir", "resume", "quiet", "plots", "report_to", "stages")
# TrainingArguments fields every stage takes from the top level of the config (train/stages.py: _trainer_args).
RUN_WIDE = ("output_dir", "seed", "report_to", "bf16", "use_cpu")
# Checked by pydantic in every section: unknown keys are errors, floats must be finite.
STRICT = {"extra": "forbid", "allow_inf_nan": False}


def _f(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - mirrors dataclasses' metadata["help"]
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


def section_defaults(**defaults: Any):
    """Class decorator (under @dataclass): this section's defaults for fields declared in a base class, keeping
    their declaration (type and help). One declaration per field, one default per section."""

    def wrap(cls: type) -> type:
        declared = {f.name: f for f in dataclasses.fields(cls.__mro__[1])}
        for name, value in defaults.items():
            setattr(cls, name, _f(value, declared[name].metadata["help"]))
            cls.__annotations__[name] = declared[name].type
        return cls

    return wrap


@dataclass
class ModelArgs:
    __pydantic_config__ = STRICT

    name_or_path: StrictStr = _f("builtin:tiny", "Hub id, local checkpoint, or `builtin:tiny` (cached tiny Qwen3).")
    dtype: StrictStr = _f("auto", "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16.")
    trust_remote_code: StrictBool = _f(False, "Passed to from_pretrained.")
    # builtin:tiny's own layer count, stated (a run's config records it; compare fingerprints hash it)
    tiny: dict[str, Any] = _f({"num_layers": TinyModelConfig.num_layers}, "Shape of builtin:tiny (build_tiny_model "
                              "kwargs, e.g. {hidden_size: 128}; unset keys: builtin:tiny's own shape); each shape is "
                              "built once and cached.")
    lora: StrictBool = _f(False, "Train a LoRA adapter (peft) instead of all weights, in SFT and RL.")
    lora_r: StrictInt = _f(32, "LoRA rank.")
    lora_alpha: StrictInt = _f(64, "LoRA alpha.")
    lora_dropout: StrictFloat = _f(0.0, "LoRA dropout.")
    lora_target_modules: list[StrictStr] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "Modules given adapters."
    )

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype", self.dtype,
               "auto, float32, bfloat16 or float16")
        _check(self.lora_r >= 1, "model.lora_r", self.lora_r, ">= 1")
        _check(self.lora_alpha > 0, "model.lora_alpha", self.lora_alpha, "> 0")
        _check(0 <= self.lora_dropout < 1, "model.lora_dropout", self.lora_dropout, "in [0, 1)")
        _check(bool(self.lora_target_modules), "model.lora_target_modules", self.lora_target_modules, "non-empty")


@dataclass
class DataArgs:
    __pydantic_config__ = STRICT

    train: StrictStr = _f("builtin:train", "RL prompts: JSONL/JSON/parquet file, hub dataset id, or builtin:<split>.")
    train_split: StrictStr = _f("train", "Split of a hub training dataset.")
    train_subset: StrictStr | None = _f(None, "Subset (config name) of a hub training dataset.")
    train_limit: StrictInt | None = _f(None, "Keep only the first N training prompts.")
    problem_key: StrictStr = _f("problem", "Field holding the problem text.")
    answer_key: StrictStr = _f("answer", "Field holding the reference answer.")
    answer_fallback: StrictBool = _f(False, "Score a completion without a \\boxed{} answer by its last `Answer:` line "
                                     "or last number (RL reward and eval). Off: the boxed answer the prompt asks for "
                                     "is required, so RL cannot learn to drop the format and be scored on a bare "
                                     "number.")
    eval: list[StrictStr] = _f(["builtin"], "Held-out benchmarks: NAME=SOURCE specs, or `builtin` (the synthetic "
                               "splits).")
    eval_split: StrictStr = _f("train", "Split of hub benchmark datasets.")
    eval_limit: StrictInt | None = _f(None, "Keep only the first N problems of each benchmark.")
    prompt_style: StrictStr = _f("auto", "Prompt template: auto, math, tiny, raw, or a template containing {problem}.")
    system_prompt: StrictStr | None = _f(None, "System prompt of every prompt (SFT, RL and evaluation alike). null: "
                                         "the chat template's own default (SmolLM2's names the model, 16 tokens); "
                                         "\"\": an empty system turn, the shortest prompt.")
    seed: StrictInt = _f(0, "Seed of the built-in synthetic task.")
    builtin_train_levels: list[StrictInt] = _f([2, 3, 4], "Levels of the built-in task's train split (1-4).")
    builtin_n_train: StrictInt = _f(2000, "Problems in the built-in train split (the RL pool; SFT takes its first "
                                    "sft.limit).")
    builtin_n_eval: StrictInt = _f(64, "Problems in each built-in held-out split.")
    builtin_max_operand: StrictInt | None = _f(9, "Largest operand of the built-in task (null: the task's own, 99).")

    def __post_init__(self) -> None:
        from trustclip.data.synthetic import LEVELS
        from trustclip.data.templates import resolve_template

        _positive(self, "data", ("builtin_n_train", "builtin_n_eval"))
        _check(self.builtin_max_operand is None or self.builtin_max_operand >= 9, "data.builtin_max_operand",
               self.builtin_max_operand, ">= 9 (or null)")
        _check(bool(self.builtin_train_levels) and set(self.builtin_train_levels) <= set(LEVELS),
               "data.builtin_train_levels", self.builtin_train_levels, f"a non-empty list of levels {sorted(LEVELS)}")
        for name in ("train_limit", "eval_limit"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"data.{name}", value, ">= 1 (or null)")
        _check(bool(self.eval), "data.eval", self.eval, "at least one benchmark")
        try:
            resolve_template(self.prompt_style)
        except ValueError as err:
            raise ValueError(f"data.prompt_style: {err}") from None


@dataclass(kw_only=True)
class OptimizerArgs:
    """The optimiser fields of a training stage (TrainingArguments fields of the same names, handed to TRL by name).
    Each stage's section states its own defaults with `section_defaults`."""

    __pydantic_config__ = STRICT

    max_steps: StrictInt = field(metadata={"help": "Optimizer steps."})
    learning_rate: StrictFloat = field(metadata={"help": "Peak learning rate."})
    lr_scheduler_type: StrictStr = field(metadata={"help": "Learning-rate schedule (transformers SchedulerType; "
                                                          "cosine decays to 0 at max_steps)."})
    warmup_steps: StrictInt = field(metadata={"help": "Warm-up steps."})
    weight_decay: StrictFloat = field(metadata={"help": "AdamW weight decay."})
    per_device_train_batch_size: StrictInt = field(metadata={"help": "Micro-batch size per device (RL: completions, "
                                                                    "prompts x G)."})
    gradient_accumulation_steps: StrictInt = field(metadata={"help": "Micro-batches per optimizer step."})

    def _check_optimizer(self, section: str) -> None:
        _positive(self, section, ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps"))
        _check(self.learning_rate > 0, f"{section}.learning_rate", self.learning_rate, "> 0")
        _check(self.warmup_steps >= 0, f"{section}.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.weight_decay >= 0, f"{section}.weight_decay", self.weight_decay, ">= 0")


# SFT is for the format, not the skill: a small part of the pool, few steps at a high constant rate.
@dataclass
@section_defaults(max_steps=200, learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                  per_device_train_batch_size=64, gradient_accumulation_steps=1)
class SFTArgs(OptimizerArgs):
    data: StrictStr | None = _f(None, "SFT rows (with worked solutions); default: the RL training source.")
    split: StrictStr = _f("train", "Split of a hub SFT dataset.")
    subset: StrictStr | None = _f(None, "Subset of a hub SFT dataset.")
    solution_key: StrictStr = _f("solution", "Field holding the worked solution (the SFT target).")
    problem_key: StrictStr | None = _f(None, "Problem field of the SFT rows (default: data.problem_key).")
    answer_key: StrictStr | None = _f(None, "Answer field of the SFT rows (default: data.answer_key).")
    limit: StrictInt | None = _f(400, "Keep only the first N SFT rows (null: all). SFT is for the format: it sees a "
                                 "small part of the pool, RL the whole of it.")
    max_length: StrictInt | None = _f(256, "Truncate SFT examples to this many tokens.")

    def __post_init__(self) -> None:
        self._check_optimizer("sft")
        _check(self.limit is None or self.limit >= 1, "sft.limit", self.limit, ">= 1 (or null)")
        _check(self.max_length is None or self.max_length >= 1, "sft.max_length", self.max_length, ">= 1 (or null)")


# RL: 64 prompts x G = 4 = 256 completions per micro-batch, large because a binary reward carries one bit per
# completion; the peak rate decays on a cosine to 0 at max_steps.
@dataclass
@section_defaults(max_steps=350, learning_rate=2e-4, lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0,
                  per_device_train_batch_size=256, gradient_accumulation_steps=1)
class RLArgs(OptimizerArgs):
    objective: StrictStr = _f("kl3", "Objective (see `trustclip objectives`); kl3 = ATR-GRPO.")
    objective_kwargs: dict[str, Any] = _f({"delta": 0.07}, "Objective hyper-parameters, e.g. {delta: 0.07}; a recipe "
                                          "or --set that names rl.objective without them gives that objective's own "
                                          "defaults.")
    aggregation: StrictStr = _f("dr_grpo", "dr_grpo (Dr.GRPO, L_max = max_completion_length), token_mean, "
                                "seq_mean_token_mean or seq_mean_token_sum.")
    advantage_estimator: StrictStr = _f("dr_grpo", "dr_grpo (R - group mean), grpo (standardised) or rloo.")
    max_grad_norm: StrictFloat = _f(1.0, "Gradient clipping norm.")
    num_generations: StrictInt = _f(4, "Group size G (completions per prompt).")
    num_iterations: StrictInt = _f(2, "Updates per generation batch (mu); >= 2 makes the ratio (and clipping) act.")
    steps_per_generation: StrictInt | None = _f(None, "Optimizer micro-steps per generation batch (TRL); "
                                                "> gradient_accumulation_steps also makes updates off-policy.")
    temperature: StrictFloat = _f(0.7, "Sampling temperature during RL.")
    top_p: StrictFloat = _f(1.0, "Sampling top-p during RL.")
    top_k: StrictInt = _f(0, "Sampling top-k during RL (0 = off).")
    max_completion_length: StrictInt = _f(32, "Generation budget per completion (tokens).")
    beta: StrictFloat = _f(0.0, "KL-to-reference coefficient (0: no reference model).")
    mask_truncated_completions: StrictBool = _f(False, "Exclude completions that hit max_completion_length from the "
                                                "loss (DAPO's overlong filtering).")
    truncated_reward: StrictFloat | None = _f(0.0, "Reward of a completion cut at max_completion_length (no EOS): 0 "
                                              "makes an unfinished answer a wrong one, so the policy keeps stopping "
                                              "after its answer; null scores its text as it is.")
    skip_zero_advantage: StrictBool = _f(True, "Leave completions with advantage 0 (groups whose rewards all agree) "
                                         "out of the update: DAPO's dynamic-sampling filter, without re-sampling. "
                                         "Same update direction, less compute; raise the prompts per step to keep "
                                         "more groups.")
    reward_timeout: StrictFloat = _f(DEFAULT_TIMEOUT, "Hard per-answer timeout of math-verify (seconds), in the RL "
                                     "reward and the evaluation.")
    save_steps: StrictInt = _f(50, "Checkpoint every N steps (for --resume).")
    save_total_limit: StrictInt | None = _f(2, "Keep at most N checkpoints.")
    logging_steps: StrictInt = _f(1, "Log metrics every N steps.")
    eval_every: StrictInt = _f(0, "Evaluate the held-out benchmarks every N steps during RL (0: off).")
    trl_kwargs: dict[str, Any] = _f({}, "Extra GRPOConfig fields, e.g. {entropy_coef: 0.001, "
                                    "top_entropy_quantile: 0.2}.")

    def __post_init__(self) -> None:
        self._check_optimizer("rl")
        _positive(self, "rl", ("num_generations", "num_iterations", "max_completion_length", "save_steps",
                               "logging_steps"))
        _check(self.temperature > 0, "rl.temperature", self.temperature, "> 0")
        _check(0 < self.top_p <= 1, "rl.top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= 0, "rl.top_k", self.top_k, ">= 0 (0 = off)")
        _check(self.beta >= 0, "rl.beta", self.beta, ">= 0")
        _check(self.max_grad_norm > 0, "rl.max_grad_norm", self.max_grad_norm, "> 0")
        _check(self.reward_timeout > 0, "rl.reward_timeout", self.reward_timeout, "> 0 seconds")
        _check(self.eval_every >= 0, "rl.eval_every", self.eval_every, ">= 0")
        _check(self.num_generations >= 2, "rl.num_generations", self.num_generations, ">= 2 (a group needs a baseline)")
        _check(self.steps_per_generation is None or self.steps_per_generation >= 1, "rl.steps_per_generation",
               self.steps_per_generation, ">= 1 (or null)")
        _check(self.save_total_limit is None or self.save_total_limit >= 1, "rl.save_total_limit",
               self.save_total_limit, ">= 1 (or null)")
        own = sorted(set(self.trl_kwargs) & {f.name for f in dataclasses.fields(self)})
        _check(not own, "rl.trl_kwargs", self.trl_kwargs, f"free of rl options ({', '.join(own)}: set rl.<name>)")
        shared = sorted(set(self.trl_kwargs) & set(RUN_WIDE))  # set once for every stage, at the top level
        _check(not shared, "rl.trl_kwargs", self.trl_kwargs,
               f"free of run-wide settings ({', '.join(shared)}: set them at the top level, e.g. --set bf16=true)")


@dataclass
class TrainConfig:
    __pydantic_config__ = STRICT

    output_dir: StrictStr = _f("runs/default", "Where checkpoints, metrics.jsonl, plots and summary.json go.")
    stages: list[StrictStr] = _f(list(STAGES), "Stages to run, in order: sft, rl, eval.")
    seed: StrictInt = _f(0, "Training seed.")
    bf16: StrictBool | None = _f(None, "Mixed precision (TrainingArguments' bf16) in SFT, RL and evaluation: bfloat16 "
                                 "autocast over float32 weights, with the LM head, log-probs and ratio in float32. "
                                 "null: on with a bfloat16 GPU, off on CPU; true on a CPU without bfloat16 "
                                 "instructions is an error.")
    report_to: list[StrictStr] = _f(["tensorboard"], "Trainer logging integrations (tensorboard, wandb, none, ...).")
    resume: StrictBool = _f(False, "Continue the interrupted run in output_dir from its last checkpoint, with its "
                            "settings (config.yaml).")
    plots: StrictBool = _f(True, "Write PNG training curves at the end.")
    quiet: StrictBool = _f(False, "Print only the final table (no progress lines).")
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    sft: SFTArgs = field(default_factory=SFTArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)

    def __post_init__(self) -> None:
        bad = [s for s in self.stages if s not in STAGES]
        _check(not bad, "stages", self.stages, f"a subset of {list(STAGES)}")
        _check(len(set(self.stages)) == len(self.stages), "stages", self.stages, "without repeats")
        _check(bool(self.output_dir.strip()), "output_dir", self.output_dir, "a directory path")
        self.stages = [s for s in STAGES if s in self.stages]  # always run in pipeline order
        self.report_to = [r for r in self.report_to if r != "none"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------ validation helpers
def _check(ok: bool, name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {rule}")


def _positive(obj: Any, section: str, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        _check(isinstance(value, int) and value >= 1, f"{section}.{name}", value, "an integer >= 1")


# ------------------------------------------------------------------ dict <-> dataclass
@functools.cache
def _adapter(cls: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Build dataclass `cls` from a (nested) dict: a section given in part keeps the defaults of the rest, any other
    value replaces its default. Raises ValueError naming every bad key (unknown, wrong type, invalid value)."""
    from pydantic import ValidationError

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
        valid = ", ".join(".".join([*loc[:-1], f]) for f in _section_fields(cls, loc[:-1]))
        return f"unknown option {name}; valid: {valid}"
    if error["type"] in ("dataclass_type", "dataclass_args_type"):
        return f"{name}: expected a mapping of options, got {error['input']!r}"
    return f"{name}={error['input']!r} is invalid: {message[0].lower()}{message[1:]}"


def _section_fields(cls: type, path: list[str]) -> list[str]:
    for part in path:
        cls = typing.get_type_hints(cls)[part]
    return [f.name for f in dataclasses.fields(cls)]


def _field_hint(key: str) -> Any:
    """Type hint of the dotted option `key` (None for an unknown key or one inside a mapping value)."""
    cls: Any = TrainConfig
    for part in key.split("."):
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
    if isinstance(value, str) and typing.get_origin(_field_hint(key)) is list:
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
    node: Any = data
    for part in key.split("."):
        node = node[part]
    return node


class _YamlLoader(__import__("yaml").SafeLoader):
    """YAML 1.1 as PyYAML reads it, plus YAML 1.2's floats without a dot (`1e-5`), which it reads as strings."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    import yaml

    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value` -> (key, YAML-parsed value): numbers, true/false, null, [a, b], {k: v}."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE, e.g. rl.learning_rate=1e-5")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ValueError(f"--set {text!r}: value is not valid YAML ({' '.join(str(err).split())})") from None
    return key, value


def load_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe as a dict. `base: other.yaml` (relative to the recipe) is loaded first and deep-merged under it,
    so a baseline recipe states only what differs from the recipe it extends."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.resolve() in _seen:
        raise ValueError(f"{path}: circular `base:` chain {' -> '.join(map(str, _seen))}")
    try:
        data = yaml_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: invalid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of options at the top level, got {type(data).__name__}")
    data.pop("description", None)  # free text for humans
    own_objective_defaults(data)
    base = data.pop("base", None)
    if base is None:
        return data
    return deep_merge(load_yaml(path.parent / base, (*_seen, path.resolve())), data)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Sections merge key by key; any other value (lists and objective_kwargs included) is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in REPLACED_MAPPINGS:
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


# Mappings that are values, not sections: a recipe's objective_kwargs replaces its base's.
REPLACED_MAPPINGS = ("objective_kwargs", "trl_kwargs")


def own_objective_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """A layer of settings (a recipe file, a `--set`) that names `rl.objective` without `rl.objective_kwargs` means
    that objective at its own defaults: the kwargs of the objective it replaces (the embedded default's delta 0.07,
    a base recipe's) do not carry over."""
    rl = data.get("rl")
    if isinstance(rl, dict) and "objective" in rl and "objective_kwargs" not in rl:
        rl["objective_kwargs"] = {}
    return data


def explicit_settings(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                      objective: str | None = None, reset_objective_kwargs: bool = True,
                      **top_level: Any) -> dict[str, Any]:
    """What a command line states, as a nested dict (no defaults): the recipe; then `objective` or `--set
    rl.objective=NAME` (the same: rl.objective, with its hyper-parameters back to the objective's own defaults unless
    `reset_objective_kwargs` is False, as on resume); then the other `--set` overrides (so that
    `--set rl.objective_kwargs.delta=0.1` applies to the new objective, in any order); then explicit top-level values
    (dotted keys, e.g. output_dir=...; None means not given)."""
    data = load_yaml(path) if path else {}
    parsed = [parse_override(text) for text in overrides]
    named = [value for key, value in parsed if key == "rl.objective"]
    if named and objective is not None and any(value != objective for value in named):
        raise ValueError(f"--objective {objective} and --set rl.objective={named[-1]} name two objectives; give one")
    objective = named[-1] if named else objective
    if objective is not None:
        set_dotted(data, "rl.objective", objective)
        if reset_objective_kwargs:
            set_dotted(data, "rl.objective_kwargs", {})
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


def resume_config(explicit: dict[str, Any]) -> TrainConfig:
    """The configuration of the run being resumed: its saved config.yaml, with what the command line states on top.
    A stated value that differs from the run's (other than how the run is driven, RUN_CONTROL) is an error naming
    the key and both values: a resumed run continues the run it resumes."""
    out = Path(explicit.get("output_dir") or TrainConfig.output_dir)
    saved_path = out / "config.yaml"
    if not out.is_dir():
        raise FileNotFoundError(f"--resume: {out} does not exist: there is no run to resume (drop --resume to start "
                                "one, or give the run's --output-dir)")
    if not saved_path.is_file():
        raise FileNotFoundError(f"--resume: {out} holds no trustclip run ({saved_path.name} is missing)")
    saved = read_run_config(saved_path, "--resume")
    saved_config = from_dict(TrainConfig, saved).to_dict()
    # quiet is this command's choice, not the run's
    merged = from_dict(TrainConfig, _merge_all({**saved, "quiet": False}, {**explicit, "resume": True}))
    conflicts = [f"{key}={get_dotted(merged.to_dict(), key)!r} (the run has {get_dotted(saved_config, key)!r})"
                 for key in _leaf_keys(explicit) if key.split(".")[0] not in RUN_CONTROL
                 and get_dotted(merged.to_dict(), key) != get_dotted(saved_config, key)]
    if conflicts:
        raise ValueError(f"--resume: {'; '.join(conflicts)} differ from {saved_path}: a resumed run keeps its "
                         "settings; drop the override(s), or start a new run in another --output-dir")
    return merged


def read_run_config(path: Path, what: str) -> dict[str, Any]:
    """A run's saved settings (its config.yaml) as a dict, checked: a file that is not YAML, not a mapping, or holds
    settings this version rejects is a ValueError naming the file (`what`: the command or option reading it)."""
    import yaml

    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
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


def _merge_all(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep merge into every mapping, so `--set rl.objective_kwargs.delta=...` touches one hyper-parameter."""
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge_all(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _leaf_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted names of the options `data` sets (a mapping-valued option such as rl.objective_kwargs is one name)."""
    keys = []
    for key, value in data.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(_field_hint(prefix + key)):
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(prefix + key)
    return keys


def changed_settings(config: TrainConfig, saved: dict[str, Any]) -> list[str]:
    """Dotted names of the options whose value in `config` differs from the saved run's (RUN_CONTROL aside)."""
    now, before = config.to_dict(), from_dict(TrainConfig, saved).to_dict()
    return [key for key in _leaf_keys(now) if key.split(".")[0] not in RUN_CONTROL
            and get_dotted(now, key) != get_dotted(before, key)]


def option_table() -> list[tuple[str, str, str]]:
    """(dotted name, default, help) of every option, for `--help`."""
    rows = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                rows.append((prefix + f.name, repr(value), f.metadata.get("help", "")))

    walk(TrainConfig(), "")
    return rows
