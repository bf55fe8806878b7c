"""Trainer integrations. `TrustClipGRPOTrainer` / `TrustClipGRPOConfig` (TRL) load lazily so that
`trustclip.integrations.trl` can be imported without TRL."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"TrustClipGRPOTrainer": "trainer", "TrustClipGRPOConfig": "config", "on_policy_warning": "config"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'trustclip.integrations.trl' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trustclip.integrations.trl.{_LAZY[name]}"), name)
