"""Trainer integrations. `TrustClipGRPOTrainer` / `TrustClipGRPOConfig` (TRL) load lazily so that
`trustclip.trainers` can be imported without TRL."""

from __future__ import annotations

from typing import Any

_LAZY = {
    "TrustClipGRPOTrainer": "trustclip.trainers.trl_trainer",
    "TrustClipGRPOConfig": "trustclip.trainers.trl_config",
    "on_policy_warning": "trustclip.trainers.trl_config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trustclip.trainers' has no attribute {name!r}")


__all__ = ["TrustClipGRPOConfig", "TrustClipGRPOTrainer", "on_policy_warning"]
