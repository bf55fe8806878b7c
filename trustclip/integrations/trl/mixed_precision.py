"""The trainer's mixed-precision pieces: float32 log-probs under autocast, and the low-precision copy of the policy
that TRL's generation samples from (`generation_dtype`), LoRA layers as one product under autocast
(`merged_lora_forward`); the pieces themselves are in `trustclip.precision`."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from trl.trainer.utils import add_fused_lm_head

from trustclip.precision import LowPrecisionCopy, merge_lora_under_autocast, unwrap_peft

logger = logging.getLogger(__name__)


def float32_lm_head(trainer: Any) -> None:
    """TRL's fused LM head multiplies in the autocast dtype (trl/kernels/chunked_logprob.py:330) unless it is added
    with `cast_lm_head_to_fp32`, which runs it outside autocast. TRL's own `cast_lm_head_to_fp32=True` also re-types
    the head module, which fails for a PEFT model with tied embeddings (grpo_trainer.py:1043), so the fused head is
    added again here, around TRL's (whose unfused forward, used by `generate`, it calls unchanged)."""
    model = trainer.model
    base = unwrap_peft(model)
    add_fused_lm_head(base, temperature=trainer.args.temperature, cast_lm_head_to_fp32=True,
                      outputs=("log_probs", "entropy"))


def merged_lora_forward(trainer: Any) -> None:
    """`merge_lora_under_autocast` on the trainer's policy, where each process holds its whole weights (a layer of a
    policy sharded by FSDP or DeepSpeed ZeRO-3 would read a shard or a placeholder: PEFT's forward stays there)."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        logger.info("merged_lora_forward: not applied to a sharded policy (FSDP / DeepSpeed)")
        return
    merge_lora_under_autocast(trainer.model)


def low_precision_sampler(trainer: Any) -> LowPrecisionCopy | None:
    """The copy to sample from (`generation_dtype`), or None: TRL samples from the policy itself."""
    dtype = getattr(trainer.args, "generation_dtype", None)
    if dtype is None:
        return None
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:  # a sharded policy has no whole weights to copy
        raise ValueError("generation_dtype needs the whole policy in each process; it does not combine with FSDP or "
                         "DeepSpeed: leave it unset")
    return LowPrecisionCopy(trainer.model, getattr(torch, dtype))


@contextmanager
def sampling_copy(trainer: Any) -> Iterator[None]:
    """While TRL generates, its `model_wrapped` (what TRL's generation samples from) is the trainer's low-precision
    copy, refreshed with the policy's current weights; without a copy, nothing changes."""
    sampler = trainer._sampler
    if sampler is None:
        yield
        return
    policy = trainer.model_wrapped
    trainer.model_wrapped = sampler.refresh(trainer.accelerator.unwrap_model(trainer.model))
    try:
        yield
    finally:
        trainer.model_wrapped = policy
