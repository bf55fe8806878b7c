"""Evaluation: Pass@k / Mean@k metrics (light, numpy only) and the generation-based evaluator.

The evaluator pulls in torch and transformers, so it is imported lazily.
"""

from trustclip.evaluation.metrics import benchmark_metrics, mean_at_k, metric_curves, pass_at_k

_LAZY = {
    "EvalArgs",
    "EvalConfig",
    "EvalResult",
    "evaluate",
    "evaluate_checkpoints",
    "final_and_best",
    "format_table",
    "write_report",
}


def __getattr__(name: str):
    if name in _LAZY:
        from trustclip.evaluation import evaluator

        return getattr(evaluator, name)
    raise AttributeError(f"module 'trustclip.evaluation' has no attribute {name!r}")


__all__ = ["benchmark_metrics", "mean_at_k", "metric_curves", "pass_at_k", *sorted(_LAZY)]
