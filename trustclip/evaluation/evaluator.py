"""Mean@K / Pass@K of causal LMs on math benchmarks (the paper's Table 2 protocol): `n_samples` (default K) samples
per problem, scored as the RL reward scores them, give the metrics at K and their curves over k = 1..n (Figure 4)."""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trustclip.data.templates import format_prompt
from trustclip.evaluation.config import EvalConfig
from trustclip.evaluation.generation import Sample, check_backend, generate_hf, generate_vllm, vllm_available
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

    def flat_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """`{"eval/<benchmark>/mean@8": ...}` for trainer logging."""
        return {f"{prefix}{b}/{m}": v for b, ms in self.metrics.items() for m, v in ms.items()}

    def to_dict(self) -> dict[str, Any]:
        """Everything but the samples (`write_report` puts those in samples.jsonl)."""
        return {"model": self.model, "step": self.step, "backend": self.backend, "seed": self.config.seed,
                "elapsed_s": self.elapsed_s, "metrics": self.metrics, "curves": self.curves,
                "completion_stats": self.completion_stats}


def evaluate(model: Any, tokenizer: Any, benchmarks: dict[str, Sequence[dict[str, Any]]],
             config: EvalConfig | None = None, *, model_name: str | None = None, step: int | None = None,
             generate_fn: Any = None) -> EvalResult:
    """Evaluate an in-memory model on `{name: rows}` (rows have `problem` and `answer`). Callable from a trainer for
    periodic eval: the model's train/eval mode, the tokenizer's padding side and the global torch RNG state are
    restored afterwards. `generate_fn(prompts) -> list[list[str | Sample]]` replaces HF generation (vLLM, a server)."""
    config = config or EvalConfig()
    if not benchmarks:
        raise ValueError("no benchmarks to evaluate")
    t0 = time.perf_counter()
    metrics, curves, samples, stats = {}, {}, {}, {}
    sampler = model
    if config.bf16 and generate_fn is None:  # one merged bfloat16 copy to sample from, for every benchmark
        import torch

        sampler = LowPrecisionCopy(model, torch.bfloat16).model
    for name, rows in benchmarks.items():
        if not rows:
            raise ValueError(f"benchmark {name!r} has no rows")
        prompts = [format_prompt(r["problem"], tokenizer, config.prompt_style, config.system_prompt) for r in rows]
        if generate_fn is not None:
            completions = [[_as_sample(c, tokenizer) for c in group] for group in generate_fn(prompts)]
        else:
            completions = generate_hf(sampler, tokenizer, prompts, config, desc=name)
        stats[name] = completion_stats([c for group in completions for c in group])
        flat = [c.text for group in completions for c in group]
        answers = [str(r["answer"]) for r, group in zip(rows, completions, strict=True) for _ in group]
        scores = iter(score_completions(flat, answers, timeout=config.reward_timeout, fallback=config.answer_fallback))
        correct = [[next(scores) for _ in group] for group in completions]
        metrics[name] = benchmark_metrics(correct, [config.k])
        curves[name] = metric_curves(correct)
        samples[name] = [
            {"id": r.get("id"), "answer": r["answer"], "prompt": p, "completions": [c.text for c in g],
             "scores": s, "tokens": [c.tokens for c in g]}
            for r, p, g, s in zip(rows, prompts, completions, correct, strict=True)
        ]
    metrics[AVERAGE] = _average(list(metrics.values()))
    if all(stats.values()):
        stats[AVERAGE] = _average(list(stats.values()))
    name = model_name or getattr(model, "name_or_path", None) or type(model).__name__
    backend = "custom" if generate_fn is not None else "hf"
    return EvalResult(str(name), config, metrics, curves, samples, backend, time.perf_counter() - t0, step,
                      {b: v for b, v in stats.items() if v})


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
    """Evaluate checkpoints (paths or hub ids) in order; the last one is the run's "final" model. vLLM samples when
    it is installed, a GPU is present and `config.backend` allows it; else each model is loaded for HF `generate`."""
    config = config or EvalConfig()
    use_vllm = config.backend == "vllm" or (config.backend == "auto" and vllm_available())
    check_backend(config.backend)
    results = []
    for path in models:
        if use_vllm:
            resolved = resolve_model_name(path)
            gen = functools.partial(generate_vllm, resolved, config=config)
            result = evaluate(None, load_tokenizer(resolved), benchmarks, config, model_name=str(path), generate_fn=gen)
            result.backend = "vllm"
        else:
            import torch

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            if dtype is None and device.startswith("cuda"):
                dtype = torch.bfloat16
            model, tokenizer = load_model_and_tokenizer(path, device=device, dtype=dtype)
            result = evaluate(model, tokenizer, benchmarks, config, model_name=str(path))
            del model
            gc.collect()
        results.append(result)
    return results
