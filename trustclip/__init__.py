"""trustclip: the policy-divergence constraint of GRPO-style RLVR objectives as a first-class object.

Core (pure torch): `get_objective`, `compute_policy_loss`, `ratio_bounds`. Every name loads on first use, so
`import trustclip` (and `trustclip --help`) stays light: torch comes with the first objective, the data, reward
and evaluation helpers (`verify_answer`, `pass_at_k`) with their first call.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    **dict.fromkeys(("Constraint", "DeltaController", "DivergenceConstraint", "RatioInterval", "aggregate",
                     "compute_advantages", "compute_policy_loss", "compute_token_loss", "custom_divergence",
                     "get_objective", "list_objectives", "ratio_bounds", "register_objective"), "trustclip.objectives"),
    "verify_answer": "trustclip.rewards",
    "pass_at_k": "trustclip.evaluation.metrics",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'trustclip' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
