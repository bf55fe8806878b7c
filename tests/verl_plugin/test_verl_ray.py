"""The path by which verl's workers get the plugin: a Ray worker process (a local CPU cluster) that imports verl
finds every trustclip loss registered, through the `verl.plugins` entry point of the installed trustclip."""

from __future__ import annotations

import os

import pytest

from trustclip.integrations.verl.plugin import verl_loss_names

ray = pytest.importorskip("ray")  # verl requires ray[default]; here for a clear skip if a verl build drops it


def test_a_ray_worker_that_imports_verl_has_every_trustclip_loss() -> None:
    def registered_in_this_process(_: object) -> tuple[int, dict]:
        import os

        import verl  # noqa: F401  (verl loads the verl.plugins entry points here, in the worker)
        from verl.trainer.ppo import core_algos

        names = sorted(n for n in core_algos.POLICY_LOSS_REGISTRY if n.startswith("trustclip_"))
        return os.getpid(), {n: getattr(core_algos.get_policy_loss_fn(n), "trustclip_objective", None) for n in names}

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(registered_in_this_process)
        plugins_off = task.options(runtime_env={"env_vars": {"VERL_USE_EXTERNAL_PLUGINS": "none"}})
        (pid, found), (pid_off, found_off) = ray.get([task.remote(None), plugins_off.remote(None)], timeout=300)
    finally:
        ray.shutdown()
    assert os.getpid() not in (pid, pid_off)  # separate worker processes, not this one
    assert found == verl_loss_names()
    assert found_off == {}  # negative control: with verl's plugin discovery off, the worker has none
