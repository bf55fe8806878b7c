"""Tests of the verl plugin against real verl 0.9.1; they run only in the verl environment.

verl pins transformers < 5.11, so it lives in its own virtual environment (`.venv-verl`). In any
environment without verl each module here is reported as skipped, without being imported:

    .venv-verl/bin/python -m pytest tests/verl_plugin -q
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

_spec = importlib.util.find_spec("verl")
# (require the real verl package, not a namespace package of the same name on sys.path)
HAVE_VERL = _spec is not None and _spec.origin not in (None, "namespace")
SKIP_REASON = "verl is not installed here; run these with .venv-verl/bin/python -m pytest tests/verl_plugin"

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


class _SkippedModule(pytest.Module):
    """A test module reported as skipped without being imported (its imports need verl)."""

    def collect(self) -> list:
        pytest.skip(SKIP_REASON)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    return None if HAVE_VERL else _SkippedModule.from_parent(parent, path=module_path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.verl)


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    """Forget which one-time warnings the plugin already emitted in this process."""
    from trustclip.integrations.verl import plugin as verl_plugin

    saved = set(verl_plugin._warned)
    verl_plugin._warned.clear()
    yield
    verl_plugin._warned.clear()
    verl_plugin._warned.update(saved)
