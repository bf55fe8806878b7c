"""Mixed precision the Hugging Face way (TrainingArguments' `bf16`), on GPU and on CPU.

`bf16=True` runs the model's matrix products under `torch.autocast(dtype=torch.bfloat16)` over float32 weights
(AMP: the weights, their gradients and the optimizer state stay float32). What the trust region acts on stays
float32 too: the TRL trainer computes the LM head, the log-softmax and so the log-probabilities, the entropy and the
ratio w = exp(logp - old_logp) in float32 (`TrustClipGRPOTrainer`), so the ratio of an on-policy update is exactly 1.

On CPU, bfloat16 pays only where the processor has bfloat16 instructions (AVX512-BF16 or AMX on x86, BF16 on
Arm); elsewhere torch emulates it, slower than float32, so such a request is refused up front (`bf16_problem`).
"""

from __future__ import annotations

from pathlib import Path

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (/proc/cpuinfo flags) and Arm (Features)


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic: torch's own probes, else the kernel's CPU flags."""
    import torch

    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(probe is not None and probe() for probe in probes):
        return True
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def default_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def bf16_problem(device_type: str | None = None) -> str | None:
    """Why `bf16=True` cannot be honoured on this machine's `device_type` (default: cuda if present, else cpu),
    or None when it can."""
    import torch

    device_type = device_type or default_device_type()
    if device_type == "cuda":
        if torch.cuda.is_bf16_supported():
            return None
        return f"the GPU ({torch.cuda.get_device_name()}) has no bfloat16 support"
    if device_type == "cpu":
        return None if cpu_has_bf16() else (
            "this CPU has no bfloat16 instructions (AVX512-BF16, AMX or Arm BF16): torch would emulate bfloat16, "
            "slower than float32")
    return f"bfloat16 autocast is not set up for device type {device_type!r}"


def resolve_bf16(setting: bool | None, device_type: str | None = None) -> bool:
    """The mixed-precision flag a run uses: `setting` itself (True checked against the machine), or for None the
    default: on where it pays without a measurement (a bfloat16 GPU), off on CPU."""
    device_type = device_type or default_device_type()
    if setting is None:
        return device_type == "cuda" and bf16_problem("cuda") is None
    if setting:
        problem = bf16_problem(device_type)
        if problem:
            raise ValueError(f"bf16=true cannot be honoured here: {problem}; set bf16: false (--set bf16=false)")
    return setting

