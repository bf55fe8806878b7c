"""Trainer integrations. `TrustClipGRPOTrainer` / `TrustClipGRPOConfig` (TRL) load lazily so that
`trustclip.trainers` can be imported without TRL."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"TrustClipGRPOTrainer": "trl_trainer", "TrustClipGRPOConfig": "trl_config", "on_policy_warning": "trl_config"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'trustclip.trainers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trustclip.trainers.{_LAZY[name]}"), name)
