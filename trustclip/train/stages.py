"""The three stages of `trustclip train`, each a function of the config and the model in memory:
SFT for format (TRL `SFTTrainer`), RLVR (`TrustClipGRPOTrainer`), and held-out evaluation (Mean@K / Pass@K)."""

from __future__ import annotations

import functools
import json
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_callback import ProgressCallback as HFProgress
from transformers.trainer_utils import sort_checkpoints
from trl import SFTConfig

from trustclip.data import build_prompt_rows, sft_examples
from trustclip.evaluation.evaluator import evaluate
from trustclip.files import read_json
from trustclip.integrations.trl.compat import checkpointing_off
from trustclip.integrations.trl.config import TrustClipGRPOConfig
from trustclip.metrics_file import METRICS_FILE
from trustclip.models import TINY_MODEL_NAME, build_tiny_model, load_model_and_tokenizer
from trustclip.precision import resolve_bf16
from trustclip.rewards import CorrectnessReward
from trustclip.run_data import load_rows
from trustclip.settings import TrainConfig, eval_config, library_settings, model_dtype
from trustclip.train.callbacks import JsonlMetricsCallback, PeriodicEvalCallback, ProgressCallback

Printer = Callable[[str], None]


# ------------------------------------------------------------------ models
def policy_source(name_or_path: str | Path, config: TrainConfig) -> str:
    """Where the run's model `name_or_path` loads from: `builtin:tiny` at the run's shape (model.tiny; built once
    and cached per shape), anything else as named."""
    if str(name_or_path) == TINY_MODEL_NAME and config.model.tiny:
        return str(build_tiny_model(**config.model.tiny))
    return str(name_or_path)


def load_policy(name_or_path: str | Path, config: TrainConfig) -> tuple[Any, Any]:
    """Model and tokenizer from a hub id, a local checkpoint, a saved LoRA adapter, or `builtin:tiny`."""
    name_or_path = policy_source(name_or_path, config)
    path = Path(str(name_or_path))
    kwargs = {"dtype": model_dtype(config), "trust_remote_code": config.model.trust_remote_code}
    if (path / "adapter_config.json").is_file():
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


def _quiet_trainer(trainer: Any, stage: str, config: TrainConfig, out: Path, printer: Printer) -> None:
    """Replace the Trainer's tqdm / dict printing by metrics.jsonl + compact progress lines."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(HFProgress)
    trainer.add_callback(JsonlMetricsCallback(out / METRICS_FILE, stage))
    if not config.quiet:
        trainer.add_callback(ProgressCallback(stage, every=getattr(config, stage).max_steps // 15, printer=printer))


def last_checkpoint(folder: Path, printer: Printer = print) -> str | None:
    """The newest complete `checkpoint-N` in `folder` (None: there is none). A kill can leave the newest one half
    written (HF Trainer writes its files in place, trainer_state.json last): it is skipped, and said so."""
    # by step, as the Trainer's own rotation orders them; only exact `checkpoint-N` names (not a `checkpoint-10-old`)
    checkpoints = [p for p in sort_checkpoints(str(folder)) if re.fullmatch(r"checkpoint-\d+", Path(p).name)]
    for path in reversed(checkpoints):
        problem = checkpoint_problem(Path(path))
        if problem is None:
            return path
        printer(f"note: skipping {path}: {problem} (a kill while it was being written)")
    if checkpoints:
        printer(f"note: no complete checkpoint in {folder}: this stage starts from its beginning")
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None when it is complete: trainer_state.json (written
    last) and every other JSON file parse, and every weight / state file is whole (safetensors checks its header
    against the file's size; a torch `.pt` / `.pth` / `.bin` zip archive has its directory, written at its end)."""
    if not (folder / "trainer_state.json").is_file():
        return "trainer_state.json is missing"
    if not any(folder.glob("*.safetensors")) and not (folder / "pytorch_model.bin").is_file():
        return "it holds no model weights"
    for path in sorted(folder.iterdir()):
        if path.suffix == ".json" and read_json(path) is None:
            return f"{path.name} is not valid JSON"
        if path.suffix == ".safetensors" and not _whole_safetensors(path):
            return f"{path.name} is cut short"
        if path.suffix in (".pt", ".pth", ".bin") and not zipfile.is_zipfile(path):
            return f"{path.name} is cut short"
    return None


def _whole_safetensors(path: Path) -> bool:
    try:
        with safe_open(path, framework="pt"):
            return True
    except (OSError, SafetensorError):
        return False


def _trainer_args(config: TrainConfig, folder: Path, section: Any) -> dict[str, Any]:
    """TrainingArguments of a stage: the section's library options (`library_settings`: each field names the TRL
    field it fills), and the settings every stage shares (the GPU if there is one, the run's `bf16`)."""
    return dict(
        library_settings(section),
        output_dir=str(folder), seed=config.seed, report_to=config.report_to or "none", disable_tqdm=True,
        save_strategy="steps", **checkpointing_off(), dataloader_num_workers=0,
        bf16=resolve_bf16(config.bf16), use_cpu=not torch.cuda.is_available(),
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


def sft_config(config: TrainConfig, folder: Path) -> Any:
    """TRL's SFTConfig of the SFT stage (its own checks run here)."""
    s = config.sft
    return SFTConfig(**_trainer_args(config, folder, s), save_steps=max(1, s.max_steps // 2),
                     save_total_limit=1, logging_steps=max(1, s.max_steps // 30), completion_only_loss=True)


def run_sft(model: Any, tokenizer: Any, config: TrainConfig, out: Path, printer: Printer,
            rows: list[dict[str, Any]], args: Any = None) -> Any:
    """SFT for format with TRL's SFTTrainer (completion-only loss); returns the trained (merged) model. `args`: the
    stage's SFTConfig as `check_run` built it (None: built here)."""
    from datasets import Dataset
    from trl import SFTTrainer

    examples = sft_examples(rows, tokenizer, style=config.data.prompt_style, system_prompt=config.data.system_prompt)
    folder = out / "sft"
    args = sft_config(config, folder) if args is None else args
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                         processing_class=tokenizer, peft_config=lora_config(config))
    _quiet_trainer(trainer, "sft", config, out, printer)
    trainer.train(resume_from_checkpoint=last_checkpoint(folder, printer) if config.resume else None)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if config.model.lora:
        model = model.merge_and_unload()  # RL puts a fresh adapter on the SFT-merged weights (paper's setup)
    return model


# ------------------------------------------------------------------ RL
def grpo_config(config: TrainConfig, folder: Path) -> Any:
    """TRL's GRPOConfig (with the objective) of the RL stage, plus `rl.trl_kwargs`; its checks (and TRL's) run here."""
    return TrustClipGRPOConfig(**_trainer_args(config, folder, config.rl), **config.rl.trl_kwargs)


def rl_rows(config: TrainConfig) -> list[dict[str, Any]]:
    """The RL prompt pool: `data.train`, each prompt once (hub DAPO-Math-17k repeats each 100 times), first
    `data.train_limit`."""
    d = config.data
    rows = load_rows(d.train, config, split=d.train_split, subset=d.train_subset)
    return list({r["id"]: r for r in rows}.values())[: d.train_limit]


def rl_dataset(config: TrainConfig, tokenizer: Any, rows: list[dict[str, Any]] | None = None) -> Any:
    from datasets import Dataset

    d = config.data
    rows = build_prompt_rows(rows if rows is not None else rl_rows(config), tokenizer, d.prompt_style,
                             system_prompt=d.system_prompt)
    return Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])


def reward_function(config: TrainConfig) -> Any:
    """The binary verified reward, scoring answers exactly as the evaluation does (`data.answer_fallback`)."""
    return CorrectnessReward(timeout=config.rl.reward_timeout, fallback=config.data.answer_fallback)


def run_rl(model: Any, tokenizer: Any, config: TrainConfig, out: Path, printer: Printer,
           benchmarks: dict[str, list[dict[str, Any]]] | None, rows: list[dict[str, Any]], args: Any = None) -> Any:
    """RLVR with the configured objective, evaluating `benchmarks` every rl.eval_every steps; returns the trainer
    (its model is the trained policy). `args`: the stage's TrustClipGRPOConfig as `check_run` built it, objective
    resolved (None: built here)."""
    from trustclip.integrations.trl import TrustClipGRPOTrainer

    folder = out / "rl"
    trainer = TrustClipGRPOTrainer(
        model, reward_funcs=reward_function(config), args=grpo_config(config, folder) if args is None else args,
        train_dataset=rl_dataset(config, tokenizer, rows), processing_class=tokenizer, peft_config=lora_config(config),
    )
    _quiet_trainer(trainer, "rl", config, out, printer)
    if benchmarks and config.rl.eval_every:
        trainer.add_callback(PeriodicEvalCallback(trainer, config.rl.eval_every, functools.partial(
            evaluate, tokenizer=tokenizer, benchmarks=benchmarks, config=eval_config(config))))
    checkpoint = last_checkpoint(folder, printer) if config.resume else None
    if checkpoint:
        printer(f"[rl] resuming from {checkpoint}")
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer
