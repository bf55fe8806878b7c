"""Mixed precision the Hugging Face way (TrainingArguments' `bf16`), on GPU and on CPU.

`bf16=True` runs the model's matrix products under `torch.autocast(dtype=torch.bfloat16)` over float32 weights
(AMP: the weights, their gradients and the optimizer state stay float32). What the trust region acts on stays
float32 too: the TRL trainer computes the LM head, the log-softmax and so the log-probabilities, the entropy and the
ratio w = exp(logp - old_logp) in float32 (`TrustClipGRPOTrainer`), so the ratio of an on-policy update is exactly 1.

On CPU, bfloat16 pays only where the processor has bfloat16 instructions (AVX512-BF16 or AMX on x86, BF16 on
Arm); elsewhere torch emulates it, slower than float32, so such a request is refused up front (`bf16_problem`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def bf16_problem(device_type: str | None = None) -> str | None:
    """Why `bf16=True` cannot be honoured on this machine's `device_type` (default: cuda if present, else cpu),
    or None when it can."""
    import torch

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        return None if torch.cuda.is_bf16_supported() else (
            f"the GPU ({torch.cuda.get_device_name()}) has no bfloat16 support")
    if device_type == "cpu":
        return None if cpu_has_bf16() else (
            "this CPU has no bfloat16 instructions (AVX512-BF16, AMX or Arm BF16): torch would emulate bfloat16, "
            "slower than float32")
    return f"bfloat16 autocast is not set up for device type {device_type!r}"


def resolve_bf16(setting: bool | None) -> bool:
    """The mixed-precision flag a run uses: `setting` itself (True checked against the machine), or for None the
    default: on where it pays without a measurement (a bfloat16 GPU), off on CPU."""
    import torch

    if setting is None:
        return torch.cuda.is_available() and bf16_problem("cuda") is None
    if setting and (problem := bf16_problem()):
        raise ValueError(f"bf16=true cannot be honoured here: {problem}; set bf16: false (--set bf16=false)")
    return setting


class LowPrecisionCopy:
    """A copy of a policy in a low-precision dtype, with any LoRA adapter merged, to sample completions from.

    On CPU, generation under autocast re-casts every float32 weight at every decoding step and runs each LoRA
    adapter beside its base layer; a merged bfloat16 copy does neither and multiplies with the CPU's bfloat16
    instructions. `refresh(policy)` copies the policy's current weights in place (LoRA deltas merged, cast), so the
    copy samples from the current policy up to the rounding of `dtype`. It only decides which tokens are sampled:
    the log-probs of an update still come from the policy itself (as with vLLM in TRL).
    """

    def __init__(self, policy: Any, dtype: Any) -> None:
        self.model = copy.deepcopy(policy)
        if hasattr(self.model, "merge_and_unload"):
            self.model = self.model.merge_and_unload()
        self.model = self.model.to(dtype).eval().requires_grad_(False)
        for module in self.model.modules():
            # The copy runs the model's own forward. A forward patched onto the policy's instance (TRL's fused LM head,
            # accelerate's autocast) was deep-copied as a closure over the policy's bound forward: it would run the
            # policy, not the copy.
            module.__dict__.pop("forward", None)
        # torch 2.13's CPU linear with a non-contiguous 3-D bfloat16 input (generate's last-position slice of the
        # prompt's hidden states) copies the LM head once per row: 8.3 s instead of 23 ms for 32 rows of SmolLM2.
        self.model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: (args[0].contiguous(),))
        names = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        missing = [name for name, _ in merged_parameters(policy) if name not in names]
        if missing:
            raise ValueError(f"LowPrecisionCopy: the merged copy lacks the policy's parameters {missing[:3]}")

    def refresh(self, policy: Any) -> Any:
        """Copy `policy`'s current weights (LoRA merged) into the copy; returns the copy's model."""
        import torch

        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights under each name
        with torch.no_grad():
            for name, value in merged_parameters(policy):
                params[name].copy_(value)
        return self.model


def unwrap_peft(model: Any) -> Any:
    """The model inside a PEFT wrapper (the model itself when it has none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def merged_parameters(model: Any) -> Iterator[tuple[str, Any]]:
    """`(name, tensor)` of `model`'s parameters as the plain model (no PEFT wrapper) would name them, each LoRA
    layer's weight with its active adapters' deltas added; the model itself is not changed (PEFT's own merge would
    round its base weights)."""
    model = unwrap_peft(model)  # named as the model inside a PEFT wrapper
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no adapters
        LoraLayer = ()  # noqa: N806
    inside = None  # the LoRA layer being walked (named_modules is pre-order: its base layer and adapters follow it)
    for name, module in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue  # the base layer and the adapters inside a LoRA layer: merged below
        prefix = f"{name}." if name else ""
        if isinstance(module, LoraLayer):
            inside = prefix
            base = module.get_base_layer()
            deltas = [module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A]
            yield f"{prefix}weight", base.weight + sum(deltas) if deltas else base.weight
            if base.bias is not None:
                yield f"{prefix}bias", base.bias
            continue
        for pname, param in module.named_parameters(recurse=False):
            yield prefix + pname, param


# ----------------------------------------------------------------------------------------------- LoRA under autocast
def merge_lora_under_autocast(policy: Any) -> int:
    """Make each LoRA linear layer of `policy` compute, under low-precision autocast, one product with its merged
    weight, y = x (W + s B A)^T, instead of PEFT's y = round(round(x W^T) + s x A^T B^T). Returns how many layers.

    Why: PEFT adds the adapter's output to the base layer's output after autocast has rounded the latter to bfloat16,
    and rounds the sum again. An adapter's contribution smaller than half a bfloat16 step of the base output is then
    erased, every time, not rounded at random: in a regression of what the layer shows of the adapter on what it adds
    in float32, PEFT's autocast forward shows 0.33 of it, the merged product 1.05 (tests/test_precision.py). On
    SmolLM2-135M after RL the trainer's log-probs under PEFT's forward were off their float32 values by up to 6.4 nats
    (mean 0.079 per token); with the merged product 1.5 (mean 0.017), at the same step time on a CPU. The sampler (vLLM,
    or `LowPrecisionCopy`) multiplies by that merged weight too, so the trainer's log-probs are those of the policy the
    completions come from. Cost: autograd keeps the bfloat16 copy of the merged weight where PEFT's forward keeps the
    base weight's (SmolLM2, 16 completions: 1,342 MB against 1,338 MB; float32 2,204 MB); the float32 merged weight
    lives only during the layer's forward (scripts/lora_autocast_gap.py).

    Outside autocast (float32), with an active LoRA dropout while training, DoRA, a LoRA bias, merged or disabled
    adapters, or per-call arguments (mixed adapter batches), the layer runs PEFT's own forward."""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # no peft: no adapters
        return 0
    layers = [m for m in unwrap_peft(policy).modules() if isinstance(m, LoraLinear)]
    for layer in layers:
        if getattr(layer.forward, "func", None) is not _merged_lora_forward:  # once per layer
            layer.forward = functools.partial(_merged_lora_forward, layer, layer.forward)
    return len(layers)


def _merged_lora_forward(layer: Any, peft_forward: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    import torch
    import torch.nn.functional as F  # noqa: N812

    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    if args or kwargs or not _merged_product_applies(layer, adapters, x):
        return peft_forward(x, *args, **kwargs)
    base = layer.get_base_layer()
    with torch.autocast(x.device.type, enabled=False):  # the merged weight in the weights' dtype, as the sampler's
        weight = base.weight + sum(layer.get_delta_weight(a) for a in adapters)
    return F.linear(x, weight, base.bias)  # autocast rounds it once, then one low-precision product


def _merged_product_applies(layer: Any, adapters: list[str], x: Any) -> bool:
    import torch

    dropout_active = layer.training and any(getattr(layer.lora_dropout[a], "p", 0.0) > 0 for a in adapters)
    return (torch.is_autocast_enabled(x.device.type) and bool(adapters) and not layer.disable_adapters
            and not layer.merged and not layer.fan_in_fan_out and not dropout_active
            and not any(a in getattr(layer, "lora_variant", {}) or layer.use_dora.get(a, False)  # DoRA and others
                        or layer.lora_bias.get(a, False) for a in adapters))
