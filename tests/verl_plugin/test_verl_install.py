"""The environment `trustclip[verl]` builds imports verl's actor workers and trainers, not only its loss registry.

verl 0.9.1's base requirements leave out what these modules import; its own `verl-core` extra has it, and the
`verl` extra of trustclip installs `verl[verl-core]==0.9.1` (docs/verl.md, "Install").
"""

from __future__ import annotations

import importlib

import pytest

# module -> what it needs beyond verl's base requirements (the line that imports it, in verl 0.9.1)
MODULES = {
    "verl.workers.engine_workers": "fastapi, uvicorn (verl/workers/rollout/utils.py:20-21)",
    "verl.trainer.ppo.ray_trainer": "cachetools (verl/workers/rollout/router.py:21)",
    "verl.trainer.ppo.v1.trainer_base": "TransferQueue, main_ppo's default trainer (verl/trainer/main_ppo.py:137)",
}


@pytest.mark.parametrize("module", MODULES)
def test_verl_actor_and_trainer_modules_import(module: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"{module} does not import ({err}); it needs {MODULES[module]}: reinstall with "
                    f"pip install -e '.[verl]'")
