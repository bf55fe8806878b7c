"""Discovery in fresh interpreters: a plain `import verl` registers every trustclip loss through the
`verl.plugins` entry point; the `VERL_USE_EXTERNAL_MODULES` fallback works; failures are visible."""

from __future__ import annotations

import json

import pytest
from verl_testkit import run_fresh

from trustclip.integrations.verl.plugin import verl_loss_names

REPORT = """
import json
import verl
from verl.trainer.ppo import core_algos
names = sorted(n for n in core_algos.POLICY_LOSS_REGISTRY if n.startswith("trustclip_"))
found = {n: getattr(core_algos.get_policy_loss_fn(n), "trustclip_objective", None) for n in names}
print(json.dumps({"found": found, "vanilla": core_algos.get_policy_loss_fn("vanilla").__module__}))
"""


BROKEN = "import sys; sys.modules['verl.trainer.ppo.core_algos'] = None\nimport verl\nprint('verl imported')"
NO_VERL = ("import sys; sys.modules['verl'] = None\n"
           "try:\n    import trustclip.integrations.verl.plugin\nexcept ImportError as err:\n    print(err)\n")
SCRIPTS = {
    "plain": (REPORT, {}),
    "plugins_off": (REPORT, {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
    "modules_fallback": (REPORT, {"VERL_USE_EXTERNAL_PLUGINS": "none",
                                  "VERL_USE_EXTERNAL_MODULES": "trustclip.integrations.verl.plugin"}),
    "modules_fallback_earlier_path": (REPORT, {"VERL_USE_EXTERNAL_PLUGINS": "none",
                                               "VERL_USE_EXTERNAL_MODULES": "trustclip.integrations.verl_plugin"}),
    # verl's core_algos cannot be imported (as with an incompatible verl), yet `import verl` succeeds
    "broken": (BROKEN, {}),
    "no_verl": (NO_VERL, {}),
}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> dict:
    return run_fresh(SCRIPTS, tmp_path_factory.mktemp("fresh"))


def report(result) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_plain_import_verl_registers_every_objective(fresh) -> None:
    result = report(fresh["plain"])
    assert result["found"] == verl_loss_names()
    assert result["vanilla"] == "verl.trainer.ppo.core_algos"  # verl's own losses untouched


def test_nothing_registers_without_the_entry_point(fresh) -> None:
    """Negative control: with verl's plugin discovery off, no trustclip loss appears by other means."""
    assert report(fresh["plugins_off"])["found"] == {}


def test_external_modules_fallback(fresh) -> None:
    assert report(fresh["modules_fallback"])["found"] == verl_loss_names()


def test_external_modules_fallback_under_the_earlier_module_path(fresh) -> None:
    assert report(fresh["modules_fallback_earlier_path"])["found"] == verl_loss_names()


def test_a_broken_plugin_import_is_logged_at_error_level(fresh) -> None:
    """verl swallows plugin exceptions at DEBUG; the plugin logs them at ERROR (with traceback) first."""
    result = fresh["broken"]
    assert result.returncode == 0 and "verl imported" in result.stdout, result.stderr[-3000:]
    assert "ERROR" in result.stderr and "Traceback" in result.stderr
    assert "trustclip verl plugin: registering the losses failed (ModuleNotFoundError" in result.stderr
    assert "'Unsupported loss mode'" in result.stderr


def test_without_verl_the_plugin_fails_with_install_instructions(fresh) -> None:
    result = fresh["no_verl"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "needs verl, which is not installed" in result.stdout and ".venv-verl" in result.stdout
    assert "ERROR" not in result.stderr  # a plain missing optional dependency is not logged as a failure
