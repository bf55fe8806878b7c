"""Test fixture: what it takes to run verl 0.9.1's actor worker on a CPU. Not part of trustclip.

verl 0.9.1 has no CPU device. Each shim below names the verl line it works around (paths relative to the
installed `verl/` package), so that a verl upgrade shows which of them are still needed:

* `CPUPlatform`, installed with verl's own `set_platform`: without a platform for the CPU,
  `plugin/platform/platform_manager.py:117` falls back to 'nvidia' and every `torch.cuda` call fails. Its device
  module is `torch.cpu` plus the calls verl makes that `torch.cpu` lacks: `max_memory_allocated` /
  `max_memory_reserved` (`workers/engine_workers.py:219-220`), `get_device_name` (`utils/flops_counter.py:80`),
  `memory_allocated` / `memory_reserved` / `mem_get_info` (`utils/profiler/performance.py:49-54`), `empty_cache`.
  `current_device()` is "cpu", not an index: `utils/fsdp_utils.py:507` moves the model to `get_device_id()`.
* `VERL_ENGINE_DEVICE=cuda` (verl's own override, `workers/engine/base.py:405-406`): the FSDP engine is registered
  for cuda and npu only (`workers/engine/fsdp/transformer_impl.py:1143`); its code itself runs on the CPU.
* a gloo process group created before verl's: `utils/distributed.py:89` asks for "cpu:gloo,<device>:<backend>", which
  is "cpu:gloo,cuda:nccl" (NCCL needs a GPU) with verl's platforms and "cpu:gloo,cpu:gloo" (rejected by torch as a
  duplicate device type) with this one; verl keeps a group that already exists (line 90).
* `CPU_OVERRIDES` (config, no patch): `attn_implementation=sdpa` (`workers/config/model.py:185` defaults to
  flash_attention_2, a CUDA kernel); `strategy=fsdp2`, because FSDP1 wraps with `device_id` and
  `sync_module_states=True` (`workers/engine/fsdp/transformer_impl.py:441-444`), which need GPU parameters;
  `use_torch_compile=False` only to save ~16 s of compiling on a CPU (`transformer_impl.py:185`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from verl.plugin.platform import PlatformBase, set_platform

CPU_OVERRIDES = [
    "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.strategy=fsdp2",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
]


def _no_bytes(*_args, **_kwargs) -> int:
    return 0


def cpu_device_module() -> SimpleNamespace:
    """`torch.cpu` plus the `torch.cuda` calls verl makes on its device module (memory statistics read as 0)."""
    module = SimpleNamespace(**{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if not name.startswith("_")})
    module.max_memory_allocated = module.max_memory_reserved = _no_bytes
    module.memory_allocated = module.memory_reserved = _no_bytes
    module.mem_get_info = lambda *_args: (0, 0)
    module.empty_cache = lambda: None
    module.get_device_name = lambda *_args: "cpu"
    module.manual_seed = module.manual_seed_all = torch.manual_seed
    module.get_rng_state, module.set_rng_state = torch.get_rng_state, torch.set_rng_state
    return module


class CPUPlatform(PlatformBase):
    """verl platform for the CPU: the device is "cpu", collectives go through gloo, profiling is a no-op."""

    device_name = "cpu"
    vendor_name = "cpu"

    def __init__(self) -> None:
        self._device_module = cpu_device_module()

    @property
    def device_module(self) -> SimpleNamespace:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


def run_verl_on_cpu() -> None:
    """Install the shims in this process: call before verl builds a worker. Reads the torchrun environment
    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which verl's `Worker` reads too."""
    set_platform(CPUPlatform())
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    torch.distributed.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
