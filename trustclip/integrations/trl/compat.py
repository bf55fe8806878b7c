"""Public transformers API that changed inside the supported range (pyproject.toml: transformers >= 5.17), one shim
each, so that no call passes a keyword that only one end of the range knows. tests/test_compat.py checks each shim
against the installed release; `make test-min` runs them at the range's lower end."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainingArguments


def checkpointing_off() -> dict[str, Any]:
    """TrainingArguments keywords that turn activation (gradient) checkpointing off.

    transformers 5.2x renamed `gradient_checkpointing` to `activation_checkpointing` and kept the old name as a
    deprecated alias that wins when the new one is unset; TRL's GRPOConfig / SFTConfig default the old name to True.
    So a release with the new name needs the new one False and the alias None (no FutureWarning, no True default),
    and an older release (5.17-5.19: only `gradient_checkpointing`) needs that one False."""
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    if "activation_checkpointing" in names:
        return {"activation_checkpointing": False, "gradient_checkpointing": None}
    return {"gradient_checkpointing": False}

