"""Evaluation: Pass@k / Mean@k metrics (light, numpy only) and the generation-based evaluator.

Layers, bottom up: `metrics`, `config` (EvalArgs / EvalConfig), `generation` (HF / vLLM sampling), `evaluator`
(generate, score, aggregate), `report` (JSON / CSV / markdown writers). All but `metrics` load on first use.
"""

from trustclip.evaluation.metrics import benchmark_metrics, mean_at_k, metric_curves, pass_at_k

_LAZY = {"EvalArgs": "config", "EvalConfig": "config", "EvalResult": "evaluator", "evaluate": "evaluator",
         "evaluate_checkpoints": "evaluator", "final_and_best": "report", "format_table": "report",
         "write_report": "report"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"trustclip.evaluation.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'trustclip.evaluation' has no attribute {name!r}")


__all__ = ["benchmark_metrics", "mean_at_k", "metric_curves", "pass_at_k", *sorted(_LAZY)]
