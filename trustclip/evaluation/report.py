"""Evaluation reports: JSON + CSV + markdown. With several checkpoints every cell is "final (best)": the last
checkpoint's value, and the best over all checkpoints, as in the paper."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trustclip.evaluation.metrics import AVERAGE

if TYPE_CHECKING:
    from trustclip.evaluation.evaluator import EvalResult


def final_and_best(results: Sequence[EvalResult]) -> tuple[dict, dict]:
    """Per benchmark and metric: the last result's value ("final") and the max over results ("best")."""
    if not results:
        raise ValueError("no results")
    final = results[-1].metrics
    best = {b: {m: max(r.metrics[b][m] for r in results if b in r.metrics) for m in ms} for b, ms in final.items()}
    return final, best


def format_table(results: Sequence[EvalResult]) -> str:
    """Markdown table in the paper's Table 2 layout; cells are "final (best)" for several checkpoints."""
    final, best = final_and_best(results)
    k = results[-1].config.k
    lines = [f"| Benchmark | Mean@{k} (%) | Pass@{k} (%) |", "|---|---:|---:|"]
    for bench, ms in final.items():
        cells = [f"{100 * ms[m]:.2f}" + (f" ({100 * best[bench][m]:.2f})" if len(results) > 1 else "")
                 for m in (f"mean@{k}", f"pass@{k}")]
        lines.append(f"| {'**Average**' if bench == AVERAGE else bench} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


REPORT_FILES = ("results.json", "results.csv", "results.md", "samples.jsonl")  # what `write_report` writes


def write_report(results: Sequence[EvalResult], output_dir: str | Path,
                 meta: dict[str, Any] | None = None) -> dict[str, Path]:
    """Write `results.json`, `results.csv`, `results.md` and `samples.jsonl`; returns their paths. `meta` (e.g.
    benchmark sources, the data seed) is stored as is in `results.json`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final, best = final_and_best(results)
    cfg = results[-1].config
    paths = dict(zip(("json", "csv", "md", "samples"), (out / name for name in REPORT_FILES), strict=True))
    payload = {"config": asdict(cfg), "seed": cfg.seed, "meta": meta or {},
               "checkpoints": [r.to_dict() for r in results], "final": final, "best": best}
    paths["json"].write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    tables = [*((r.model, i, r.metrics) for i, r in enumerate(results)), ("final", "", final), ("best", "", best)]
    with paths["csv"].open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["checkpoint", "index", "benchmark", "k", "n_samples", f"mean@{cfg.k}", f"pass@{cfg.k}"])
        writer.writerows([label, i, bench, cfg.k, cfg.n, ms[f"mean@{cfg.k}"], ms[f"pass@{cfg.k}"]]
                         for label, i, metrics in tables for bench, ms in metrics.items())
    lines = ["# Evaluation", "",
             *[f"- checkpoint {i}: `{r.model}` ({r.backend}, {r.elapsed_s:.1f} s)" for i, r in enumerate(results)],
             f"- K = {cfg.k}, samples per problem = {cfg.n}, temperature = {cfg.temperature}, "
             f"top-p = {cfg.top_p}, max new tokens = {cfg.max_new_tokens}, seed = {cfg.seed}",
             *(["- cells are final (best) over the checkpoints"] if len(results) > 1 else []),
             "", format_table(results)]
    paths["md"].write_text("\n".join(lines) + "\n", encoding="utf-8")
    with paths["samples"].open("w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"checkpoint": r.model, "index": i, "benchmark": bench, **row}) + "\n"
                      for i, r in enumerate(results) for bench, rows in r.samples.items() for row in rows)
    return paths
