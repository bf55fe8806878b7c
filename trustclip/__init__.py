"""trustclip: the policy-divergence constraint of GRPO-style RLVR objectives as a first-class object.

Core (pure torch): `get_objective`, `compute_policy_loss`, `ratio_bounds`. Data, reward and evaluation
helpers (`verify_answer`, `pass_at_k`) are imported lazily so `import trustclip` stays light.
"""

from trustclip.objectives import (
    Constraint,
    DeltaController,
    DivergenceConstraint,
    RatioInterval,
    aggregate,
    compute_advantages,
    compute_policy_loss,
    compute_token_loss,
    custom_divergence,
    get_objective,
    list_objectives,
    ratio_bounds,
    register_objective,
)

__version__ = "0.1.0"

_LAZY = {"verify_answer": "trustclip.rewards", "pass_at_k": "trustclip.evaluation.metrics"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trustclip' has no attribute {name!r}")


__all__ = [
    "Constraint", "DeltaController", "DivergenceConstraint", "RatioInterval", "aggregate", "compute_advantages",
    "compute_policy_loss", "compute_token_loss", "custom_divergence", "get_objective", "list_objectives",
    "pass_at_k", "ratio_bounds", "register_objective", "verify_answer",
]
