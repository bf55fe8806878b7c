"""Mean@K / Pass@K evaluation of causal LMs on math benchmarks (the paper's Table 2 protocol).

- `evaluate(model, tokenizer, benchmarks, config)`: a model already in memory (periodic eval inside a
  trainer). Generation is batched Hugging Face `generate`.
- `evaluate_checkpoints(paths, benchmarks, config)`: one or more checkpoints of a run, loaded in turn;
  vLLM is used when it is installed, a GPU is present and `backend` allows it.
- `write_report(results, output_dir)`: JSON + CSV + markdown. With several checkpoints every cell is
  "final (best)": the last checkpoint's value, and the best over all checkpoints, as in the paper.

Every problem gets `n_samples` (default K) samples; the unbiased estimator turns them into Pass@k and
Mean@k for k = 1..n (the paper's Figure 4 curves). The sampling seed is recorded in the results.
"""

from __future__ import annotations

import csv
import gc
import importlib.util
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import StrictFloat, StrictInt, StrictStr

from trustclip.evaluation.metrics import benchmark_metrics, metric_curves
from trustclip.rewards import DEFAULT_TIMEOUT

AVERAGE = "average"
BACKENDS = ("auto", "hf", "vllm")


@dataclass
class EvalArgs:
    """How a model is evaluated: sampling, budget and K (the paper's evaluation: T = 0.3, top-p 0.95, K = 8).

    The one declaration of these settings: it is the `eval` section of `trustclip train` (so the defaults are the
    embedded CPU run's), `trustclip eval` and `trustclip compare` read it from there.
    """

    __pydantic_config__ = {"extra": "forbid", "allow_inf_nan": False}  # see trustclip.train.config.from_dict

    k: StrictInt = field(default=8, metadata={"help": "K of Mean@K / Pass@K."})
    n_samples: StrictInt | None = field(default=None, metadata={"help": "Samples per problem (>= k); default k."})
    temperature: StrictFloat = field(default=0.3, metadata={"help": "Sampling temperature (paper: 0.3)."})
    top_p: StrictFloat = field(default=0.95, metadata={"help": "Sampling top-p (paper: 0.95)."})
    max_new_tokens: StrictInt = field(default=32, metadata={"help": "Generation budget per completion (tokens)."})
    batch_size: StrictInt = field(default=512, metadata={"help": "Sequences per generate call."})
    seed: StrictInt = field(default=0, metadata={"help": "Sampling seed (the same before and after training)."})
    backend: StrictStr = field(default="auto", metadata={"help": "trustclip eval: auto (vLLM when installed with a "
                                                                 "GPU), hf or vllm; trustclip train evaluates the "
                                                                 "model in memory with HF (auto or hf)."})

    def __post_init__(self) -> None:
        for name in ("k", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)!r} is invalid: must be an integer >= 1")
        if self.n_samples is not None and self.n_samples < self.k:
            raise ValueError(f"eval.n_samples={self.n_samples!r} is invalid: must be >= eval.k ({self.k})")
        if not self.temperature >= 0:
            raise ValueError(f"eval.temperature={self.temperature!r} is invalid: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p={self.top_p!r} is invalid: must be in (0, 1]")
        if self.backend not in BACKENDS:
            raise ValueError(f"eval.backend={self.backend!r} is invalid: must be one of {', '.join(BACKENDS)}")

    @property
    def n(self) -> int:
        return self.n_samples or self.k


@dataclass
class EvalConfig(EvalArgs):
    """Everything `evaluate` needs: the evaluation settings plus how prompts are written and answers scored.
    `trustclip train` / `trustclip eval` fill the latter from the run's `data.prompt_style`, `data.answer_fallback`
    and `rl.reward_timeout`, so a run is evaluated exactly as it was rewarded."""

    top_k: int | None = None  # None disables top-k (the paper's -1)
    bf16: bool = False  # `evaluate` samples from a merged bfloat16 copy (the run's `bf16`: trustclip.precision)
    prompt_style: str = "auto"  # see trustclip.data.templates
    system_prompt: str | None = None  # None: the chat template's default; "": an empty system turn
    reward_timeout: float = DEFAULT_TIMEOUT
    answer_fallback: bool = False  # True: no \boxed{} -> the last `Answer:` line / last number (trustclip.rewards)
    answer_key: str = "answer"
    show_progress: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} is invalid: must be >= 0 (or None)")
        if not self.reward_timeout > 0:
            raise ValueError(f"reward_timeout={self.reward_timeout!r} is invalid: must be > 0 seconds")


@dataclass
class EvalResult:
    """Scores of one model: `metrics[benchmark]["mean@K" | "pass@K"]` as fractions, plus `average`."""

    model: str
    config: EvalConfig
    metrics: dict[str, dict[str, float]]
    curves: dict[str, dict[str, list[float]]]
    samples: dict[str, list[dict[str, Any]]]
    backend: str
    elapsed_s: float
    step: int | None = None

    def flat_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """`{"eval/<benchmark>/mean@8": ...}` for trainer logging."""
        return {f"{prefix}{b}/{m}": v for b, ms in self.metrics.items() for m, v in ms.items()}

    def to_dict(self, with_samples: bool = False) -> dict[str, Any]:
        out = {
            "model": self.model,
            "step": self.step,
            "backend": self.backend,
            "seed": self.config.seed,
            "elapsed_s": self.elapsed_s,
            "metrics": self.metrics,
            "curves": self.curves,
        }
        if with_samples:
            out["samples"] = self.samples
        return out


# --------------------------------------------------------------------------- generation


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, unit="seq")


def generate_hf(model: Any, tokenizer: Any, prompts: Sequence[str], config: EvalConfig, desc: str = "generate"):
    """`config.n` sampled completions per prompt with batched `model.generate`; returns texts per prompt.

    Prompts are sorted by length so batches pad little. The torch RNG is seeded with `config.seed` inside
    `fork_rng`, so the caller's (e.g. a trainer's) random stream is left untouched.
    """
    import torch

    n = config.n
    jobs = sorted(((i, p) for i, p in enumerate(prompts) for _ in range(n)), key=lambda j: -len(j[1]))
    outputs: list[list[str]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    was_training, old_side = model.training, tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only batches must be left-padded
    do_sample = config.temperature > 0
    gen_kwargs: dict[str, Any] = {"max_new_tokens": config.max_new_tokens, "do_sample": do_sample}
    if do_sample:
        gen_kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k or 0)
    devices = [device.index or 0] if device.type == "cuda" else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(config.seed)
            with _progress(len(jobs), desc, config.show_progress) as bar:
                for start in range(0, len(jobs), config.batch_size):
                    batch = jobs[start : start + config.batch_size]
                    enc = tokenizer([p for _, p in batch], return_tensors="pt", padding=True, add_special_tokens=False)
                    enc = {k: v.to(device) for k, v in enc.items()}
                    out = model.generate(**enc, **gen_kwargs, pad_token_id=tokenizer.pad_token_id)
                    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                    for (i, _), text in zip(batch, texts, strict=True):
                        outputs[i].append(text)
                    bar.update(len(batch))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return outputs


def vllm_available() -> bool:
    """True when vLLM is installed and a CUDA GPU is present."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def check_backend(backend: str) -> None:
    """backend 'vllm' needs vLLM and a CUDA GPU: say so before any model is loaded."""
    if backend == "vllm" and not vllm_available():
        missing = "the vllm package" if importlib.util.find_spec("vllm") is None else "a CUDA GPU"
        raise ValueError(f"eval.backend='vllm' (--backend vllm) needs the vllm package and a CUDA GPU, and {missing} "
                         "is missing here; use --backend hf (or auto)")


def generate_vllm(model_path: str, prompts: Sequence[str], config: EvalConfig) -> list[list[str]]:
    """`config.n` completions per prompt with vLLM (GPU only); the engine is freed afterwards."""
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, seed=config.seed)
    params = SamplingParams(
        n=config.n,
        temperature=config.temperature,
        top_p=config.top_p if config.temperature > 0 else 1.0,
        top_k=config.top_k or -1,
        max_tokens=config.max_new_tokens,
        seed=config.seed,
    )
    try:
        outs = llm.generate(list(prompts), params, use_tqdm=config.show_progress)
        return [[o.text for o in out.outputs] for out in outs]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- evaluation


def evaluate(
    model: Any,
    tokenizer: Any,
    benchmarks: dict[str, Sequence[dict[str, Any]]],
    config: EvalConfig | None = None,
    *,
    model_name: str | None = None,
    step: int | None = None,
    verifier: Any = None,
    generate_fn: Any = None,
) -> EvalResult:
    """Evaluate an in-memory model on `{name: rows}` (rows have `problem` and `answer`).

    Callable from a trainer for periodic eval: the model's train/eval mode, the tokenizer's padding side
    and the global torch RNG state are restored afterwards. `generate_fn(prompts) -> list[list[str]]`
    replaces HF generation (vLLM, a server...); `verifier` is a `trustclip.rewards.MathVerifier`.
    """
    from trustclip.data.templates import format_prompt
    from trustclip.rewards import score_completions

    config = config or EvalConfig()
    if not benchmarks:
        raise ValueError("no benchmarks to evaluate")
    t0 = time.perf_counter()
    metrics, curves, samples = {}, {}, {}
    sampler = model
    if config.bf16 and generate_fn is None:  # one merged bfloat16 copy to sample from, for every benchmark
        import torch

        from trustclip.precision import LowPrecisionCopy

        sampler = LowPrecisionCopy(model, torch.bfloat16).model
    for name, rows in benchmarks.items():
        if not rows:
            raise ValueError(f"benchmark {name!r} has no rows")
        prompts = [
            format_prompt(r["problem"], tokenizer, config.prompt_style, config.system_prompt,
                          **config.chat_template_kwargs) for r in rows
        ]
        if generate_fn is not None:
            completions = generate_fn(prompts)
        else:
            completions = generate_hf(sampler, tokenizer, prompts, config, desc=name)
        flat = [c for group in completions for c in group]
        answers = [str(r[config.answer_key]) for r, group in zip(rows, completions, strict=True) for _ in group]
        scores = score_completions(flat, answers, timeout=config.reward_timeout, fallback=config.answer_fallback,
                                   verifier=verifier)
        correct, pos = [], 0
        for group in completions:
            correct.append(scores[pos : pos + len(group)])
            pos += len(group)
        metrics[name] = benchmark_metrics(correct, [config.k])
        curves[name] = metric_curves(correct)
        samples[name] = [
            {"id": r.get("id"), "answer": r[config.answer_key], "prompt": p, "completions": g, "scores": s}
            for r, p, g, s in zip(rows, prompts, completions, correct, strict=True)
        ]
    metrics[AVERAGE] = {
        m: float(sum(v[m] for v in metrics.values()) / len(metrics)) for m in metrics[next(iter(metrics))]
    }
    name = model_name or getattr(model, "name_or_path", None) or type(model).__name__
    backend = "custom" if generate_fn is not None else "hf"
    return EvalResult(str(name), config, metrics, curves, samples, backend, time.perf_counter() - t0, step)


def evaluate_checkpoints(
    models: Sequence[str],
    benchmarks: dict[str, Sequence[dict[str, Any]]],
    config: EvalConfig | None = None,
    *,
    device: str | None = None,
    dtype: Any = None,
) -> list[EvalResult]:
    """Evaluate checkpoints (paths or hub ids) in order; the last one is the run's "final" model."""
    from trustclip.models import load_model_and_tokenizer, load_tokenizer, resolve_model_name

    config = config or EvalConfig()
    use_vllm = config.backend == "vllm" or (config.backend == "auto" and vllm_available())
    check_backend(config.backend)
    results = []
    for path in models:
        if use_vllm:
            resolved = resolve_model_name(path)
            tokenizer = load_tokenizer(resolved)

            def gen(prompts: Sequence[str], resolved: str = resolved) -> list[list[str]]:
                return generate_vllm(resolved, prompts, config)

            result = evaluate(None, tokenizer, benchmarks, config, model_name=str(path), generate_fn=gen)
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


# --------------------------------------------------------------------------- reports


def final_and_best(results: Sequence[EvalResult]) -> tuple[dict, dict]:
    """Per benchmark and metric: the last result's value ("final") and the max over results ("best")."""
    if not results:
        raise ValueError("no results")
    final = results[-1].metrics
    best = {b: {m: max(r.metrics[b][m] for r in results if b in r.metrics) for m in ms} for b, ms in final.items()}
    return final, best


def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def format_table(results: Sequence[EvalResult]) -> str:
    """Markdown table in the paper's Table 2 layout; cells are "final (best)" for several checkpoints."""
    final, best = final_and_best(results)
    k = results[-1].config.k
    lines = [f"| Benchmark | Mean@{k} (%) | Pass@{k} (%) |", "|---|---:|---:|"]
    for bench, ms in final.items():
        cells = []
        for m in (f"mean@{k}", f"pass@{k}"):
            cell = _pct(ms[m])
            if len(results) > 1:
                cell += f" ({_pct(best[bench][m])})"
            cells.append(cell)
        label = "**Average**" if bench == AVERAGE else bench
        lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def write_report(
    results: Sequence[EvalResult], output_dir: str | Path, meta: dict[str, Any] | None = None
) -> dict[str, Path]:
    """Write `results.json`, `results.csv`, `results.md` and `samples.jsonl`; returns their paths.

    `meta` (e.g. benchmark sources, the data seed) is stored as is in `results.json`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final, best = final_and_best(results)
    cfg = results[-1].config
    paths = {name: out / f"results.{name}" for name in ("json", "csv", "md")}
    paths["samples"] = out / "samples.jsonl"
    payload = {
        "config": asdict(cfg),
        "seed": cfg.seed,
        "meta": meta or {},
        "checkpoints": [r.to_dict() for r in results],
        "final": final,
        "best": best,
    }
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    with paths["csv"].open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["checkpoint", "index", "benchmark", "k", "n_samples", f"mean@{cfg.k}", f"pass@{cfg.k}"])
        rows = [(r.model, str(i), r.metrics) for i, r in enumerate(results)] + [
            ("final", "", final),
            ("best", "", best),
        ]
        for label, idx, metrics in rows:
            for bench, ms in metrics.items():
                writer.writerow([label, idx, bench, cfg.k, cfg.n, ms[f"mean@{cfg.k}"], ms[f"pass@{cfg.k}"]])
    header = [
        "# Evaluation",
        "",
        *[f"- checkpoint {i}: `{r.model}` ({r.backend}, {r.elapsed_s:.1f} s)" for i, r in enumerate(results)],
        f"- K = {cfg.k}, samples per problem = {cfg.n}, temperature = {cfg.temperature}, "
        f"top-p = {cfg.top_p}, max new tokens = {cfg.max_new_tokens}, seed = {cfg.seed}",
        *(["- cells are final (best) over the checkpoints"] if len(results) > 1 else []),
        "",
        "",
    ]
    paths["md"].write_text("\n".join(header) + format_table(results) + "\n", encoding="utf-8")
    with paths["samples"].open("w", encoding="utf-8") as fh:
        for i, r in enumerate(results):
            for bench, rows in r.samples.items():
                for row in rows:
                    fh.write(json.dumps({"checkpoint": r.model, "index": i, "benchmark": bench, **row}) + "\n")
    return paths
