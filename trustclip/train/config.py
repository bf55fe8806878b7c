"""Configuration of `trustclip train`: dataclasses (HF style, every field documented in its metadata),
loaded from a YAML recipe and overridden with `--set section.key=value`.

The defaults are the embedded CPU run (`trustclip train` with no arguments): a tiny Qwen3 model on the
built-in arithmetic task, SFT for format, ATR-GRPO (`kl3`, delta 0.07), evaluation before and after.
Recipes in `recipes/` override them (e.g. the paper's Qwen3-1.7B setting).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STAGES = ("sft", "rl", "eval")


def _f(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - mirrors dataclasses' metadata["help"]
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kwargs)
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class ModelArgs:
    name_or_path: str = _f("builtin:tiny", "Hub id, local checkpoint, or `builtin:tiny` (cached tiny Qwen3).")
    dtype: str = _f("auto", "auto (bf16 on GPU, fp32 on CPU), float32, bfloat16 or float16.")
    trust_remote_code: bool = _f(False, "Passed to from_pretrained.")
    tiny: dict[str, Any] = _f({"num_layers": 2}, "Shape of builtin:tiny (build_tiny_model kwargs, e.g. "
                              "{hidden_size: 128}); each shape is built once and cached.")
    lora: bool = _f(False, "Train a LoRA adapter (peft) instead of all weights, in SFT and RL.")
    lora_r: int = _f(32, "LoRA rank.")
    lora_alpha: int = _f(64, "LoRA alpha.")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
    lora_target_modules: list[str] = _f(
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
    train: str = _f("builtin:train", "RL prompts: JSONL/JSON/parquet file, hub dataset id, or builtin:<split>.")
    train_split: str = _f("train", "Split of a hub training dataset.")
    train_subset: str | None = _f(None, "Subset (config name) of a hub training dataset.")
    train_limit: int | None = _f(None, "Keep only the first N training prompts.")
    problem_key: str = _f("problem", "Field holding the problem text.")
    answer_key: str = _f("answer", "Field holding the reference answer.")
    answer_fallback: bool = _f(False, "Score a completion without a \\boxed{} answer by its last `Answer:` line or "
                               "last number (RL reward and eval). Off: the boxed answer the prompt asks for is "
                               "required, so RL cannot learn to drop the format and be scored on a bare number.")
    eval: list[str] = _f(["builtin"], "Held-out benchmarks: NAME=SOURCE specs, or `builtin` (the synthetic splits).")
    eval_split: str = _f("train", "Split of hub benchmark datasets.")
    eval_limit: int | None = _f(None, "Keep only the first N problems of each benchmark.")
    prompt_style: str = _f("auto", "Prompt template: auto, math, tiny, raw, or a template containing {problem}.")
    system_prompt: str | None = _f(None, "Optional system prompt.")
    seed: int = _f(0, "Seed of the built-in synthetic task.")
    builtin_train_levels: list[int] = _f([2, 3, 4], "Levels of the built-in task's train split (1-4).")
    builtin_n_train: int = _f(2000, "Problems in the built-in train split (the RL pool; SFT takes its first "
                              "sft.limit).")
    builtin_n_eval: int = _f(64, "Problems in each built-in held-out split.")
    builtin_max_operand: int | None = _f(9, "Largest operand of the built-in task (null: the task's own, 99).")

    def __post_init__(self) -> None:
        _positive(self, "data", ("builtin_n_train", "builtin_n_eval"))
        _check(self.builtin_max_operand is None or self.builtin_max_operand >= 9, "data.builtin_max_operand",
               self.builtin_max_operand, ">= 9 (or null)")
        for name in ("train_limit", "eval_limit"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"data.{name}", value, ">= 1 (or null)")
        _check(bool(self.eval), "data.eval", self.eval, "at least one benchmark")


@dataclass
class SFTArgs:
    data: str | None = _f(None, "SFT rows (with worked solutions); default: the RL training source.")
    split: str = _f("train", "Split of a hub SFT dataset.")
    subset: str | None = _f(None, "Subset of a hub SFT dataset.")
    solution_key: str = _f("solution", "Field holding the worked solution (the SFT target).")
    problem_key: str | None = _f(None, "Problem field of the SFT rows (default: data.problem_key).")
    answer_key: str | None = _f(None, "Answer field of the SFT rows (default: data.answer_key).")
    limit: int | None = _f(400, "Keep only the first N SFT rows (null: all). SFT is for the format: it sees a "
                           "small part of the pool, RL the whole of it.")
    max_steps: int = _f(200, "SFT optimizer steps (stop early: the point is the format, not the skill).")
    learning_rate: float = _f(3e-3, "SFT learning rate.")
    lr_scheduler_type: str = _f("constant", "SFT learning-rate schedule.")
    warmup_steps: int = _f(0, "SFT warm-up steps.")
    weight_decay: float = _f(0.0, "SFT weight decay.")
    per_device_train_batch_size: int = _f(64, "SFT micro-batch size.")
    gradient_accumulation_steps: int = _f(1, "SFT gradient accumulation.")
    max_length: int | None = _f(256, "Truncate SFT examples to this many tokens.")

    def __post_init__(self) -> None:
        _positive(self, "sft", ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps"))
        _check(self.learning_rate > 0, "sft.learning_rate", self.learning_rate, "> 0")
        _check(self.limit is None or self.limit >= 1, "sft.limit", self.limit, ">= 1 (or null)")


@dataclass
class RLArgs:
    objective: str = _f("kl3", "Objective (see `trustclip objectives`); kl3 = ATR-GRPO.")
    objective_kwargs: dict[str, Any] = _f({"delta": 0.07}, "Objective hyper-parameters, e.g. {delta: 0.07}.")
    aggregation: str = _f("dr_grpo", "dr_grpo (Dr.GRPO, L_max = max_completion_length), token_mean, "
                          "seq_mean_token_mean or seq_mean_token_sum.")
    advantage_estimator: str = _f("dr_grpo", "dr_grpo (R - group mean), grpo (standardised) or rloo.")
    max_steps: int = _f(350, "RL optimizer steps.")
    learning_rate: float = _f(2e-4, "RL (peak) learning rate.")
    lr_scheduler_type: str = _f("cosine", "RL learning-rate schedule (cosine: decays to 0 at max_steps).")
    warmup_steps: int = _f(0, "RL warm-up steps.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm.")
    per_device_train_batch_size: int = _f(256, "Completions per device per micro-batch (prompts x G); large, because "
                                           "a binary reward carries one bit per completion.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer step.")
    num_generations: int = _f(4, "Group size G (completions per prompt).")
    num_iterations: int = _f(2, "Updates per generation batch (mu); >= 2 makes the ratio (and clipping) act.")
    steps_per_generation: int | None = _f(None, "Optimizer micro-steps per generation batch (TRL); "
                                          "> gradient_accumulation_steps also makes updates off-policy.")
    temperature: float = _f(0.7, "Sampling temperature during RL.")
    top_p: float = _f(1.0, "Sampling top-p during RL.")
    top_k: int = _f(0, "Sampling top-k during RL (0 = off).")
    max_completion_length: int = _f(32, "Generation budget per completion (tokens).")
    beta: float = _f(0.0, "KL-to-reference coefficient (0: no reference model).")
    mask_truncated_completions: bool = _f(False, "Exclude completions that hit max_completion_length from the loss "
                                          "(DAPO's overlong filtering).")
    truncated_reward: float | None = _f(0.0, "Reward of a completion cut at max_completion_length (no EOS): 0 makes "
                                        "an unfinished answer a wrong one, so the policy keeps stopping after its "
                                        "answer; null scores its text as it is.")
    skip_zero_advantage: bool = _f(True, "Leave completions with advantage 0 (groups whose rewards all agree) out "
                                   "of the update: DAPO's dynamic-sampling filter, without re-sampling. Same update "
                                   "direction, less compute; raise the prompts per step to keep more groups.")
    reward_timeout: float = _f(5.0, "Hard per-answer timeout of math-verify (seconds).")
    save_steps: int = _f(50, "Checkpoint every N steps (for --resume).")
    save_total_limit: int | None = _f(2, "Keep at most N checkpoints.")
    logging_steps: int = _f(1, "Log metrics every N steps.")
    eval_every: int = _f(0, "Evaluate the held-out benchmarks every N steps during RL (0: off).")
    trl_kwargs: dict[str, Any] = _f({}, "Extra GRPOConfig fields, e.g. {entropy_coef: 0.001, "
                                    "top_entropy_quantile: 0.2}.")

    def __post_init__(self) -> None:
        _positive(self, "rl", ("max_steps", "per_device_train_batch_size", "gradient_accumulation_steps",
                               "num_generations", "num_iterations", "max_completion_length", "save_steps",
                               "logging_steps"))
        _check(self.learning_rate > 0, "rl.learning_rate", self.learning_rate, "> 0")
        _check(self.temperature > 0, "rl.temperature", self.temperature, "> 0")
        _check(0 < self.top_p <= 1, "rl.top_p", self.top_p, "in (0, 1]")
        _check(self.beta >= 0, "rl.beta", self.beta, ">= 0")
        _check(self.eval_every >= 0, "rl.eval_every", self.eval_every, ">= 0")
        _check(self.num_generations >= 2, "rl.num_generations", self.num_generations, ">= 2 (a group needs a baseline)")
        _check(self.steps_per_generation is None or self.steps_per_generation >= 1, "rl.steps_per_generation",
               self.steps_per_generation, ">= 1 (or null)")


@dataclass
class EvalArgs:
    k: int = _f(8, "K of Mean@K / Pass@K.")
    n_samples: int | None = _f(None, "Samples per problem (>= k); default k.")
    temperature: float = _f(0.3, "Evaluation sampling temperature (paper: 0.3).")
    top_p: float = _f(0.95, "Evaluation top-p (paper: 0.95).")
    max_new_tokens: int = _f(32, "Evaluation generation budget.")
    batch_size: int = _f(512, "Sequences per generate call.")
    seed: int = _f(0, "Evaluation sampling seed (same before and after).")
    backend: str = _f("auto", "auto, hf or vllm.")

    def __post_init__(self) -> None:
        _positive(self, "eval", ("k", "max_new_tokens", "batch_size"))
        _check(self.n_samples is None or self.n_samples >= self.k, "eval.n_samples", self.n_samples, ">= eval.k")
        _check(self.temperature >= 0, "eval.temperature", self.temperature, ">= 0")
        _check(0 < self.top_p <= 1, "eval.top_p", self.top_p, "in (0, 1]")


@dataclass
class TrainConfig:
    output_dir: str = _f("runs/default", "Where checkpoints, metrics.jsonl, plots and summary.json go.")
    stages: list[str] = _f(list(STAGES), "Stages to run, in order: sft, rl, eval.")
    seed: int = _f(0, "Training seed.")
    report_to: list[str] = _f(["tensorboard"], "Trainer logging integrations (tensorboard, wandb, none, ...).")
    resume: bool = _f(False, "Continue an interrupted run in output_dir from its last checkpoint.")
    plots: bool = _f(True, "Write PNG training curves at the end.")
    quiet: bool = _f(False, "Print only the final table.")
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    sft: SFTArgs = field(default_factory=SFTArgs)
    rl: RLArgs = field(default_factory=RLArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)

    def __post_init__(self) -> None:
        bad = [s for s in self.stages if s not in STAGES]
        _check(not bad, "stages", self.stages, f"a subset of {list(STAGES)}")
        _check(len(set(self.stages)) == len(self.stages), "stages", self.stages, "without repeats")
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
def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from a (nested) dict, rejecting unknown keys and values of the wrong type."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'}: expected a mapping, got {type(data).__name__} ({data!r})")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(where + k for k in unknown)}; valid: "
                         f"{', '.join(where + k for k in sorted(fields))}")
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value or {}, f"{where}{key}.")
        else:
            kwargs[key] = _coerce(value, hint, f"{where}{key}")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, name)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0])
    if hint is Any:
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name}: expected a mapping like {{key: value}}, got {value!r}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{name}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ValueError(f"{name}: expected a string, got {value!r}")
        return str(value)
    return value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """data["rl"]["learning_rate"] = value for key "rl.learning_rate" (creating sections as needed)."""
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"--set {key}: {part!r} is not a section")
        node = child
    node[leaf] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value` -> (key, YAML-parsed value): numbers, true/false, null, [a, b], {k: v}."""
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE, e.g. rl.learning_rate=1e-5")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ValueError(f"--set {text!r}: value is not valid YAML ({err})") from None
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
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of options at the top level, got {type(data).__name__}")
    data.pop("description", None)  # free text for humans
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


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                **top_level: Any) -> TrainConfig:
    """Defaults <- YAML recipe <- `--set` overrides <- explicit top-level values (e.g. output_dir=...)."""
    data = load_yaml(path) if path else {}
    for text in overrides:
        set_dotted(data, *parse_override(text))
    for key, value in top_level.items():
        if value is not None:
            set_dotted(data, key, value)
    return from_dict(TrainConfig, data)


def option_table() -> list[tuple[str, str, str]]:
    """(dotted name, default, help) of every option, for `--help`."""
    rows = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type[0].isupper()
                                                     and f.type.endswith("Args")):
                walk(typing.get_type_hints(cls)[f.name], f"{prefix}{f.name}.")
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            rows.append((prefix + f.name, repr(default), f.metadata.get("help", "")))

    walk(TrainConfig, "")
    return rows
