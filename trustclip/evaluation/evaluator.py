"""Mean@K / Pass@K of causal LMs on math benchmarks (the paper's Table 2 protocol): `n_samples` (default K) samples
per problem, scored as the RL reward scores them, give the metrics at K and their curves over k = 1..n (Figure 4)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trustclip.data.templates import format_prompt
from trustclip.evaluation.config import EvalConfig
from trustclip.evaluation.generation import Sample, generate_hf, generate_vllm, resolve_backend
from trustclip.evaluation.metrics import AVERAGE, benchmark_metrics, metric_curves
from trustclip.models import load_model_and_tokenizer, load_tokenizer, resolve_model_name
from trustclip.precision import LowPrecisionCopy
from trustclip.rewards import score_completions


@dataclass
class EvalResult:
    """Scores of one model: `metrics[benchmark]["mean@K" | "pass@K"]` as fractions, plus `average`;
    `completion_stats[benchmark]` the mean completion length (tokens) and, where the backend gives logits, the
    token-weighted mean entropy of the policy (nats per token, T = 1) over the sampled completions."""

    model: str
    config: EvalConfig
    metrics: dict[str, dict[str, float]]
    curves: dict[str, dict[str, list[float]]]
    samples: dict[str, list[dict[str, Any]]]
    backend: str
    elapsed_s: float
    step: int | None = None
    completion_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    solved: dict[str, list[int]] = field(default_factory=dict)  # benchmark -> correct samples of each problem, in order

    def flat_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """`{"eval/<benchmark>/mean@8": ...}` for trainer logging."""
        return {f"{prefix}{b}/{m}": v for b, ms in self.metrics.items() for m, v in ms.items()}

    def to_dict(self) -> dict[str, Any]:
        """Everything but the samples (`write_report` puts those in samples.jsonl)."""
        return {"model": self.model, "step": self.step, "backend": self.backend, "seed": self.config.seed,
                "elapsed_s": self.elapsed_s, "metrics": self.metrics, "curves": self.curves,
                "completion_stats": self.completion_stats, "solved": self.solved}


def evaluate(model: Any, tokenizer: Any, benchmarks: dict[str, Sequence[dict[str, Any]]],
             config: EvalConfig | None = None, *, model_name: str | None = None, step: int | None = None,
             generate_fn: Any = None) -> EvalResult:
    """Evaluate an in-memory model on `{name: rows}` (rows have `problem` and `answer`). Callable from a trainer for
    periodic eval: the model's train/eval mode, the tokenizer's padding side and the global torch RNG state are
    restored afterwards. `generate_fn(prompts) -> list[list[str | Sample]]` replaces HF generation (vLLM, a server):
    it is called once, with every benchmark's prompts in order (one engine start for all of them)."""
    config = config or EvalConfig()
    if not benchmarks:
        raise ValueError("no benchmarks to evaluate")
    if empty := [name for name, rows in benchmarks.items() if not rows]:
        raise ValueError(f"benchmark {empty[0]!r} has no rows")
    t0 = time.perf_counter()
    metrics, curves, samples, stats, solved = {}, {}, {}, {}, {}
    prompts = {name: [format_prompt(r["problem"], tokenizer, config.prompt_style, config.system_prompt) for r in rows]
               for name, rows in benchmarks.items()}
    generated = (_generate_once(generate_fn, prompts, tokenizer) if generate_fn is not None
                 else _generate_hf_each(model, tokenizer, prompts, config))
    for name, rows in benchmarks.items():
        completions = generated[name]
        stats[name] = completion_stats([c for group in completions for c in group])
        flat = [c.text for group in completions for c in group]
        answers = [str(r["answer"]) for r, group in zip(rows, completions, strict=True) for _ in group]
        scores = iter(score_completions(flat, answers, timeout=config.reward_timeout, fallback=config.answer_fallback))
        correct = [[next(scores) for _ in group] for group in completions]
        metrics[name] = benchmark_metrics(correct, [config.k])
        solved[name] = [sum(bool(c) for c in group) for group in correct]  # per-problem solve rates, from the files
        curves[name] = metric_curves(correct)
        samples[name] = [
            {"id": r.get("id"), "answer": r["answer"], "prompt": p, "completions": [c.text for c in g],
             "scores": s, "tokens": [c.tokens for c in g]}
            for r, p, g, s in zip(rows, prompts[name], completions, correct, strict=True)
        ]
    metrics[AVERAGE] = _average(list(metrics.values()))
    if all(stats.values()):
        stats[AVERAGE] = _average(list(stats.values()))
    name = model_name or getattr(model, "name_or_path", None) or type(model).__name__
    backend = "custom" if generate_fn is not None else "hf"
    return EvalResult(str(name), config, metrics, curves, samples, backend, time.perf_counter() - t0, step,
                      {b: v for b, v in stats.items() if v}, solved)


def _generate_hf_each(model: Any, tokenizer: Any, prompts: dict[str, list[str]],
                      config: EvalConfig) -> dict[str, list[list[Sample]]]:
    """HF `generate` per benchmark (its own progress bar), from one merged bfloat16 copy under `config.bf16`."""
    sampler = model
    if config.bf16:
        import torch

        sampler = LowPrecisionCopy(model, torch.bfloat16).model
    return {name: generate_hf(sampler, tokenizer, ps, config, desc=name) for name, ps in prompts.items()}


def _generate_once(generate_fn: Any, prompts: dict[str, list[str]], tokenizer: Any) -> dict[str, list[list[Sample]]]:
    """One `generate_fn` call for every benchmark's prompts, split back per benchmark."""
    flat = [p for ps in prompts.values() for p in ps]
    groups = list(generate_fn(flat))
    if len(groups) != len(flat):
        raise ValueError(f"generate_fn returned {len(groups)} groups of completions for {len(flat)} prompts")
    it = iter(groups)
    return {name: [[_as_sample(c, tokenizer) for c in next(it)] for _ in ps] for name, ps in prompts.items()}


def _as_sample(completion: str | Sample, tokenizer: Any) -> Sample:
    """A custom generator's completion as a `Sample`: its length from the tokenizer when it gave only text."""
    if isinstance(completion, Sample):
        return completion
    tokens = len(tokenizer(completion, add_special_tokens=False)["input_ids"]) if tokenizer is not None else None
    return Sample(completion, tokens)


def completion_stats(samples: Sequence[Sample]) -> dict[str, float]:
    """Mean length (tokens) of the completions and their token-weighted mean entropy, each where every sample has it."""
    out = {}
    if samples and all(s.tokens is not None for s in samples):
        out["length"] = sum(s.tokens for s in samples) / len(samples)
        if all(s.entropy is not None for s in samples) and sum(s.tokens for s in samples):
            out["entropy"] = sum(s.entropy * s.tokens for s in samples) / sum(s.tokens for s in samples)
    return out


def _average(per_benchmark: Sequence[dict[str, float]]) -> dict[str, float]:
    """The `average` row: each key's unweighted mean over the benchmarks (keys every benchmark has)."""
    keys = [k for k in per_benchmark[0] if all(k in v for v in per_benchmark)]
    return {k: float(sum(v[k] for v in per_benchmark) / len(per_benchmark)) for k in keys}


def evaluate_checkpoints(models: Sequence[str], benchmarks: dict[str, Sequence[dict[str, Any]]],
                         config: EvalConfig | None = None, *, device: str | None = None,
                         dtype: Any = None) -> list[EvalResult]:
    """Evaluate checkpoints (paths, hub ids or built-in names) in order; the last one is the run's "final" model.
    vLLM samples where `config.backend` asks for it or (auto) where it runs (`resolve_backend`); else each model is
    loaded for HF `generate`. `dtype` is the precision models load in (default: bfloat16 on a GPU, float32 on a CPU)."""
    config = config or EvalConfig()
    backend = resolve_backend(config.backend)
    results = []
    for path in models:
        if backend == "vllm":
            result = evaluate_saved_vllm(path, benchmarks, config, dtype=dtype)
        else:
            import torch

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            if dtype is None:  # explicit, as vLLM gets it (`sampling_dtype`): else each takes the checkpoint's own
                dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
            model, tokenizer = load_model_and_tokenizer(path, device=device, dtype=dtype)
            result = evaluate(model, tokenizer, benchmarks, config, model_name=str(path))
            del model
            gc.collect()
        results.append(result)
    return results


def evaluate_saved_vllm(path: str | Path, benchmarks: dict[str, Sequence[dict[str, Any]]], config: EvalConfig, *,
                        dtype: Any = None, tokenizer: Any = None, step: int | None = None) -> EvalResult:
    """`evaluate` of a saved model (a folder, hub id or built-in name; a LoRA adapter is merged first) with vLLM, in
    the precision HF would sample it in (`sampling_dtype`); `result.backend` is 'vllm'."""
    with vllm_readable(path) as folder:
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(folder)
        gen = functools.partial(generate_vllm, folder, config=config, dtype=dtype)
        result = evaluate(None, tokenizer, benchmarks, config, model_name=str(path), step=step, generate_fn=gen)
    result.backend = "vllm"
    return result


@contextlib.contextmanager
def vllm_readable(path: str | Path) -> Iterator[str]:
    """A model vLLM can load: a built-in name's cached folder, a full model folder or hub id as given, or a LoRA
    adapter merged into its base and saved, with its tokenizer, into a temporary folder (removed afterwards)."""
    resolved = resolve_model_name(path)
    if not (Path(resolved) / "adapter_config.json").is_file():
        yield resolved
        return
    from peft import PeftModel

    base = json.loads((Path(resolved) / "adapter_config.json").read_text())["base_model_name_or_path"]
    model, tokenizer = load_model_and_tokenizer(base)
    if (Path(resolved) / "tokenizer_config.json").is_file():  # the run's tokenizer, saved beside its adapter
        tokenizer = load_tokenizer(resolved)
    merged = PeftModel.from_pretrained(model, resolved).merge_and_unload()
    with tempfile.TemporaryDirectory(prefix="trustclip-merged-") as folder:
        merged.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model, merged
        gc.collect()
        yield folder
