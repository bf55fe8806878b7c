"""The three stages of `trustclip train`, each a function of the config and the model in memory:
SFT for format (TRL `SFTTrainer`), RLVR (`TrustClipGRPOTrainer`), and held-out evaluation (Mean@K / Pass@K)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from trustclip.train.callbacks import JsonlMetricsCallback, PeriodicEvalCallback, ProgressCallback
from trustclip.train.config import TrainConfig
from trustclip.train.data import load_rows

Printer = Callable[[str], None]


# ------------------------------------------------------------------ models
def accelerator_kwargs() -> dict[str, Any]:
    """Trainer precision / device flags: bf16 on a bf16-capable GPU, plain fp32 on CPU."""
    import torch

    if torch.cuda.is_available():
        return {"bf16": torch.cuda.is_bf16_supported(), "use_cpu": False}
    return {"bf16": False, "use_cpu": True}


def _dtype(config: TrainConfig) -> Any:
    import torch

    if config.model.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
    return getattr(torch, config.model.dtype)


def load_policy(name_or_path: str | Path, config: TrainConfig) -> tuple[Any, Any]:
    """Model and tokenizer from a hub id, a local checkpoint, a saved LoRA adapter, or `builtin:tiny`."""
    from trustclip.models import TINY_MODEL_NAME, build_tiny_model, load_model_and_tokenizer

    if str(name_or_path) == TINY_MODEL_NAME and config.model.tiny:
        name_or_path = build_tiny_model(**config.model.tiny)  # cached per shape
    path = Path(str(name_or_path))
    kwargs = {"dtype": _dtype(config), "trust_remote_code": config.model.trust_remote_code}
    if (path / "adapter_config.json").is_file():
        import json

        from peft import PeftModel

        base = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
        model, tokenizer = load_model_and_tokenizer(base, **kwargs)
        return PeftModel.from_pretrained(model, str(path), is_trainable=True), tokenizer
    return load_model_and_tokenizer(str(name_or_path), **kwargs)


def lora_config(config: TrainConfig) -> Any:
    if not config.model.lora:
        return None
    from peft import LoraConfig

    m = config.model
    return LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                      target_modules=list(m.lora_target_modules), task_type="CAUSAL_LM")


def _quiet_trainer(trainer: Any, stage: str, config: TrainConfig, max_steps: int, out: Path,
                   printer: Printer) -> None:
    """Replace the Trainer's tqdm / dict printing by metrics.jsonl + compact progress lines."""
    from transformers.trainer_callback import PrinterCallback
    from transformers.trainer_callback import ProgressCallback as HFProgress

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(HFProgress)
    trainer.add_callback(JsonlMetricsCallback(out / "metrics.jsonl", stage))
    if not config.quiet:
        trainer.add_callback(ProgressCallback(stage, every=max(1, max_steps // 15), printer=printer))


def _last_checkpoint(folder: Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(folder)) if folder.is_dir() else None


def _common_args(config: TrainConfig, folder: Path, section: Any) -> dict[str, Any]:
    return dict(
        output_dir=str(folder), max_steps=section.max_steps, learning_rate=section.learning_rate,
        lr_scheduler_type=section.lr_scheduler_type, warmup_steps=section.warmup_steps,
        weight_decay=section.weight_decay, per_device_train_batch_size=section.per_device_train_batch_size,
        gradient_accumulation_steps=section.gradient_accumulation_steps, seed=config.seed,
        report_to=config.report_to or "none", disable_tqdm=True, save_strategy="steps",
        activation_checkpointing=False, gradient_checkpointing=None, dataloader_num_workers=0,
        **accelerator_kwargs(),
    )


# ------------------------------------------------------------------ SFT
def sft_rows(config: TrainConfig) -> list[dict[str, Any]]:
    """Rows with a worked solution for SFT: `sft.data` if set, else the RL training source."""
    d, s = config.data, config.sft
    source = s.data or d.train
    rows = load_rows(source, config, split=s.split if s.data else d.train_split,
                     subset=s.subset if s.data else d.train_subset, limit=s.limit,
                     problem_key=s.problem_key, answer_key=s.answer_key)
    missing = next((i for i, r in enumerate(rows) if not r.get(s.solution_key)), None)
    if missing is not None:
        raise ValueError(f"SFT data {source!r}: row {missing} has no {s.solution_key!r} field (the worked solution); "
                         "set sft.data / sft.solution_key, or skip the sft stage")
    return [{**r, "solution": r[s.solution_key]} for r in rows]


def run_sft(model: Any, tokenizer: Any, config: TrainConfig, out: Path, printer: Printer) -> Any:
    """SFT for format with TRL's SFTTrainer (completion-only loss); returns the trained (merged) model."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from trustclip.data import sft_examples

    s = config.sft
    examples = sft_examples(sft_rows(config), tokenizer, style=config.data.prompt_style)
    folder = out / "sft"
    args = SFTConfig(**_common_args(config, folder, s), max_length=s.max_length, save_steps=max(1, s.max_steps // 2),
                     save_total_limit=1, logging_steps=max(1, s.max_steps // 30), completion_only_loss=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                         processing_class=tokenizer, peft_config=lora_config(config))
    _quiet_trainer(trainer, "sft", config, s.max_steps, out, printer)
    trainer.train(resume_from_checkpoint=_last_checkpoint(folder) if config.resume else None)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if config.model.lora:
        model = model.merge_and_unload()  # RL puts a fresh adapter on the SFT-merged weights (paper's setup)
    return model


# ------------------------------------------------------------------ RL
def grpo_config(config: TrainConfig, folder: Path) -> Any:
    from trustclip.trainers import TrustClipGRPOConfig

    r = config.rl
    extra = dict(r.trl_kwargs)
    if r.steps_per_generation is not None:
        extra["steps_per_generation"] = r.steps_per_generation
    return TrustClipGRPOConfig(
        **_common_args(config, folder, r), objective=r.objective, objective_kwargs=dict(r.objective_kwargs),
        aggregation=r.aggregation, advantage_estimator=r.advantage_estimator, max_grad_norm=r.max_grad_norm,
        num_generations=r.num_generations, num_iterations=r.num_iterations, temperature=r.temperature,
        top_p=r.top_p, top_k=r.top_k, max_completion_length=r.max_completion_length, beta=r.beta,
        mask_truncated_completions=r.mask_truncated_completions, truncated_reward=r.truncated_reward,
        skip_zero_advantage=r.skip_zero_advantage,
        save_steps=r.save_steps, save_total_limit=r.save_total_limit, logging_steps=r.logging_steps, **extra,
    )


def rl_dataset(config: TrainConfig, tokenizer: Any) -> Any:
    from datasets import Dataset

    from trustclip.data import build_prompt_rows

    d = config.data
    rows = load_rows(d.train, config, split=d.train_split, subset=d.train_subset)
    unique = list({r["id"]: r for r in rows}.values())  # hub DAPO-Math-17k repeats each prompt 100 times
    rows = build_prompt_rows(unique[: d.train_limit], tokenizer, d.prompt_style, system_prompt=d.system_prompt)
    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def reward_function(config: TrainConfig) -> Any:
    """The binary verified reward, scoring answers exactly as the evaluation does (`data.answer_fallback`)."""
    from trustclip.rewards import CorrectnessReward

    return CorrectnessReward(timeout=config.rl.reward_timeout, fallback=config.data.answer_fallback)


def run_rl(model: Any, tokenizer: Any, config: TrainConfig, out: Path, printer: Printer,
           periodic_eval: Callable[[Any, int], dict[str, float]] | None = None) -> Any:
    """RLVR with the configured objective; returns the trainer (its model is the trained policy)."""
    from trustclip.trainers import TrustClipGRPOTrainer

    folder = out / "rl"
    trainer = TrustClipGRPOTrainer(
        model, reward_funcs=reward_function(config), args=grpo_config(config, folder),
        train_dataset=rl_dataset(config, tokenizer), processing_class=tokenizer, peft_config=lora_config(config),
    )
    _quiet_trainer(trainer, "rl", config, config.rl.max_steps, out, printer)
    if periodic_eval is not None and config.rl.eval_every:
        trainer.add_callback(PeriodicEvalCallback(trainer, config.rl.eval_every, periodic_eval))
    checkpoint = _last_checkpoint(folder) if config.resume else None
    if checkpoint:
        printer(f"[rl] resuming from {checkpoint}")
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer


# ------------------------------------------------------------------ evaluation
def eval_config(config: TrainConfig) -> Any:
    from trustclip.evaluation import EvalConfig

    e = config.eval
    return EvalConfig(k=e.k, n_samples=e.n_samples, temperature=e.temperature, top_p=e.top_p,
                      max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, seed=e.seed,
                      prompt_style=config.data.prompt_style, backend=e.backend, show_progress=not config.quiet,
                      answer_fallback=config.data.answer_fallback)


def run_eval(model: Any, tokenizer: Any, benchmarks: dict, config: TrainConfig, step: int | None = None) -> Any:
    """Mean@K / Pass@K of the in-memory model on every benchmark (HF generate, same seed every time)."""
    from trustclip.evaluation import evaluate

    return evaluate(model, tokenizer, benchmarks, eval_config(config), step=step)
