"""The one way settings are declared (train sections, eval settings, TrustClipGRPOConfig): a dataclass field with its
help in `metadata["help"]`, as TRL's configs, which `--help` prints and recipes document; and checked (`check`)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

# Checked by pydantic in every section (`trustclip.settings.from_dict`): unknown keys are errors, floats finite.
STRICT = {"extra": "forbid", "allow_inf_nan": False}


def option(default: Any, help: str, **metadata: Any) -> Any:  # noqa: A002 - metadata["help"], as TRL's configs
    """A field with `default` (a list or dict is copied for each instance), its `help` and any other `metadata`."""
    metadata = {"help": help, **metadata}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def check(ok: bool, name: str, value: Any, rule: str) -> None:
    """ValueError `name=value is invalid: must be rule` unless `ok`."""
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: must be {rule}")
