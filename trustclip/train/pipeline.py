"""`run_pipeline(config) -> summary`: SFT for format -> evaluation before -> RLVR -> evaluation after ->
plots and `summary.json`, everything under `config.output_dir`.

Layout of the output directory:
    config.yaml        the resolved configuration
    state.json         which stages finished (and their seconds); what `--resume` reads
    metrics.jsonl      one line per logged step: {"stage": "sft"|"rl", "step", metrics...}
    sft/final/         the SFT model (LoRA merged), the RL start
    rl/checkpoint-N/   RL checkpoints (for --resume); rl/final/ the trained policy (or adapter)
    eval/before.json, eval/after.json   full evaluation results (Mean@K / Pass@K, curves, seed)
    plots/*.png        reward, entropy, completion length, clip fractions vs step (smoothed)
    summary.json       {"accuracy_before": {split: x}, "accuracy_after": {...}, "seconds": {stage: s}, ...}

Multi-process (`accelerate launch`): SFT and RL train on every process; evaluation, plots and files are
the main process's job, the others wait.
"""

from __future__ import annotations

import functools
import json
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml
from accelerate import PartialState

from trustclip.evaluation.evaluator import evaluate, evaluate_saved_vllm
from trustclip.evaluation.metrics import AVERAGE
from trustclip.files import write_json_atomic, write_text_atomic
from trustclip.metrics_file import METRICS_FILE, drop_rows
from trustclip.models import is_saved_model
from trustclip.run_data import load_benchmarks
from trustclip.settings import TrainConfig, eval_config, model_dtype
from trustclip.train.checks import CheckedRun, check_run, eval_backend, run_generation_room
from trustclip.train.plots import plot_training_curves
from trustclip.train.stages import (
    load_policy,
    policy_source,
    rl_rows,
    run_rl,
    run_sft,
    sft_rows,
)

STAGE_ORDER = ("sft", "eval_before", "rl", "eval_after")
# What a stage's fresh re-run invalidates (itself and everything downstream of its model).
INVALIDATES = {"sft": STAGE_ORDER, "rl": ("rl", "eval_after"), "eval": ("eval_before", "eval_after")}


class Run:
    """Paths, persistent stage state (state.json) and printing of one pipeline run."""

    def __init__(self, config: TrainConfig, printer: Callable[[str], None] | None = None) -> None:
        self.config, self.out = config, Path(config.output_dir)
        # cpu=True on a CPU-only machine: the first PartialState fixes the backend (gloo) for the trainers too.
        self.dist = PartialState(cpu=not torch.cuda.is_available())
        self.main = self.dist.is_main_process
        # flushed: progress must show up promptly even when stdout is a pipe or a file
        self._printer = printer or functools.partial(print, flush=True)
        path = self.out / "state.json"
        self.state: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        self.ran: dict[str, float] = {}  # stages finished by this process

    def print(self, message: str) -> None:
        """A progress line (not with quiet)."""
        if not self.config.quiet:
            self.say(message)

    def say(self, message: str) -> None:
        """A line the user gets even with quiet (the final table)."""
        if self.main:
            self._printer(message)

    def done(self, stage: str) -> bool:
        return bool(self.state.get(stage, {}).get("done"))

    def finish(self, stage: str, seconds: float, **info: Any) -> None:
        self.state[stage] = {"done": True, "seconds": round(seconds, 2), **info}
        self.ran[stage] = seconds
        self.save_state()

    def save_state(self) -> None:
        if self.main:
            write_json_atomic(self.out / "state.json", self.state)  # a kill never leaves half a state file


def prepare_output_dir(run: Run) -> None:
    """Without --resume, the requested stages start from scratch: their state, folders and metrics lines
    (and those of every stage downstream of them) are removed, and config.yaml records the settings. Nothing
    else in output_dir is touched."""
    config, out, metrics = run.config, run.out, run.out / METRICS_FILE
    if not config.resume:  # a resumed run keeps its results and the config.yaml it was started with
        stale = sorted({s for stage in config.stages for s in INVALIDATES[stage]} & set(run.state))
        if stale and run.main:
            print(f"note: {out} holds earlier results of {', '.join(stale)}; redoing them "
                  "(use --resume to continue an interrupted run instead)")
        for stage in stale:
            run.state.pop(stage)
            if run.main and stage in ("sft", "rl"):
                shutil.rmtree(out / stage, ignore_errors=True)
                if metrics.is_file():
                    drop_rows(metrics, stage)
            elif run.main:
                (out / "eval" / f"{stage.removeprefix('eval_')}.json").unlink(missing_ok=True)
        if run.main:
            write_text_atomic(out / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
    run.save_state()
    run.dist.wait_for_everyone()


def run_pipeline(config: TrainConfig | CheckedRun, printer: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the configured stages; returns (and writes) the summary dict. See the module docstring.

    Everything is checked first (`check_run`; a `CheckedRun` was checked already, and its stages' TRL configs are the
    ones the trainers receive), then every data row the run will use is read and validated, and only then is a model
    loaded: a bad setting or a malformed file fails in seconds, not after SFT."""
    t_start = time.perf_counter()
    checked = config if isinstance(config, CheckedRun) else check_run(config)
    config = checked.config
    stages = config.stages
    sft_data = sft_rows(config) if "sft" in stages else None
    rl_data = rl_rows(config) if "rl" in stages else None
    benchmarks = load_benchmarks(config) if config.evaluates else None
    run_generation_room(config, rl_data, benchmarks)  # every prompt fits the model with what is generated after it
    _quiet_libraries()
    run = Run(config, printer)
    prepare_output_dir(run)
    sft_final, rl_final = run.out / "sft" / "final", run.out / "rl" / "final"
    start = sft_final if run.done("sft") and is_saved_model(sft_final) else config.model.name_or_path
    run.print(f"trustclip train: stages {', '.join(stages)} -> {run.out}")
    model, tokenizer = load_policy(start, config)

    if "sft" in stages and not run.done("sft"):
        t = time.perf_counter()
        run.print(f"[sft] {config.sft.max_steps} steps on {config.sft.data or config.data.train} from {start}")
        model = run_sft(model, tokenizer, config, run.out, run.print, rows=sft_data, args=checked.sft)
        if run.main:
            model.save_pretrained(str(sft_final))
            tokenizer.save_pretrained(str(sft_final))
        # The saved folder is now the model's origin: a LoRA adapter trained on it (RL) records it as its base model,
        # not the checkpoint SFT started from (peft reads `name_or_path`).
        model.name_or_path = str(sft_final.resolve())
        run.dist.wait_for_everyone()
        run.finish("sft", time.perf_counter() - t, model=str(sft_final))

    if "eval" in stages and not run.done("eval_before"):
        saved = sft_final if run.done("sft") and is_saved_model(sft_final) else config.model.name_or_path
        _evaluate(run, "before", model, tokenizer, benchmarks, policy_source(saved, config))

    if "rl" in stages and not run.done("rl"):
        t = time.perf_counter()
        r = config.rl
        run.print(f"[rl] {r.objective} {dict(r.objective_kwargs)} for {r.max_steps} steps, G={r.num_generations}, "
                  f"num_iterations={r.num_iterations}, lr={r.learning_rate}")
        trainer = run_rl(model, tokenizer, config, run.out, run.print, benchmarks, rows=rl_data, args=checked.rl)
        model = trainer.accelerator.unwrap_model(trainer.model)
        if run.main:
            trainer.save_model(str(rl_final))
            tokenizer.save_pretrained(str(rl_final))
        run.dist.wait_for_everyone()
        run.finish("rl", time.perf_counter() - t, model=str(rl_final), steps=trainer.state.global_step)
    elif "eval" in stages and run.done("rl") and not run.done("eval_after") and is_saved_model(rl_final):
        model, tokenizer = load_policy(rl_final, config)

    if "eval" in stages and run.done("rl") and not run.done("eval_after"):
        _evaluate(run, "after", model, tokenizer, benchmarks, str(rl_final))

    summary = _summary(run, time.perf_counter() - t_start - sum(run.ran.values()))
    if run.main:
        if config.plots and "rl" in stages and (run.out / METRICS_FILE).is_file():
            try:
                paths = plot_training_curves(run.out / METRICS_FILE, run.out / "plots", config.rl.objective)
                run.print(f"[plots] {len(paths)} figures in {run.out / 'plots'}")
            except ValueError as err:  # e.g. an rl stage that logged nothing
                run.print(f"[plots] skipped: {err}")
        write_json_atomic(run.out / "summary.json", summary)
        print_table(summary, run.say)  # also with quiet: the final table is what quiet keeps
    run.dist.wait_for_everyone()
    return summary


def _evaluate(run: Run, when: str, model: Any, tokenizer: Any, benchmarks: dict, saved: str) -> None:
    """Evaluate the model: in memory with HF, or its saved copy `saved` with vLLM (`eval_backend`)."""
    t, config = time.perf_counter(), run.config
    k = config.eval.k
    if run.main:
        backend = eval_backend(config)
        run.print(f"[eval] {when}: {', '.join(benchmarks)} (Mean@{k}, T={config.eval.temperature}, {backend})")
        if backend == "vllm":
            result = evaluate_saved_vllm(saved, benchmarks, eval_config(config), dtype=model_dtype(config),
                                         tokenizer=tokenizer)
        else:
            result = evaluate(model, tokenizer, benchmarks, eval_config(config))
        key, stats = f"mean@{k}", result.completion_stats.get(AVERAGE, {})
        run.print(f"[eval] {when}: " + ", ".join(f"{name} {100 * m[key]:.1f}%" for name, m in result.metrics.items())
                  + "".join(f", {stat} {v:.3g}" for stat, v in stats.items()) + f" ({time.perf_counter() - t:.0f}s)")
        write_json_atomic(run.out / "eval" / f"{when}.json", result.to_dict())
    run.dist.wait_for_everyone()
    run.finish(f"eval_{when}", time.perf_counter() - t)


def _summary(run: Run, other_seconds: float) -> dict[str, Any]:
    config, k = run.config, run.config.eval.k
    summary: dict[str, Any] = {"objective": config.rl.objective, "objective_kwargs": dict(config.rl.objective_kwargs),
                               "model": config.model.name_or_path, "metric": f"mean@{k}"}
    for when in ("before", "after"):
        path = run.out / "eval" / f"{when}.json"
        if path.is_file():
            metrics = json.loads(path.read_text())["metrics"]
            summary[f"accuracy_{when}"] = {split: m[f"mean@{k}"] for split, m in metrics.items()}
            summary[f"pass_{when}"] = {split: m[f"pass@{k}"] for split, m in metrics.items()}
    seconds = {stage: run.state[stage]["seconds"] for stage in STAGE_ORDER if stage in run.state}
    seconds["other"] = round(max(other_seconds, 0.0), 2)  # imports, loading, data, plots
    seconds["total"] = round(sum(seconds.values()), 2)
    summary["seconds"] = seconds
    if run.done("rl"):
        summary["rl_steps"] = run.state["rl"].get("steps")
        summary["final_model"] = run.state["rl"].get("model")
    summary["output_dir"] = str(run.out)
    return summary


def print_table(summary: dict[str, Any], printer: Callable[[str], None] = print) -> None:
    """Held-out accuracy before -> after, one line per split, and the time per stage."""
    before, after = summary.get("accuracy_before", {}), summary.get("accuracy_after", {})
    splits = list(after or before)
    if splits:
        printer(f"\nheld-out accuracy ({summary['metric']}), objective {summary['objective']}:")
        printer(f"  {'split':<16}{'before':>9}{'after':>9}{'change':>10}")
        for split in splits:
            b, a = before.get(split), after.get(split)
            change = f"{100 * (a - b):+.1f}" if a is not None and b is not None else ""
            printer(f"  {split:<16}{_pct(b):>9}{_pct(a):>9}{change:>10}")
    seconds = summary.get("seconds", {})
    printer("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in seconds.items()))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _quiet_libraries() -> None:
    """Our own progress lines replace the libraries' bars and per-step dict printing."""
    import datasets

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
