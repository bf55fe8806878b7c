"""Every name of TRL's GRPOTrainer (1.16) that `TrustClipGRPOTrainer` relies on beyond TRL's documented API
(`GRPOConfig`, the constructor, `train()`, `compute_loss`): private methods and trainer state that TRL may rename or
remove in any release, each with what it is for. The trainer checks them at start-up (`check_trl_surface`);
tests/test_trl_surface.py checks that each exists in the installed TRL and that every one trainer.py touches is
listed. The TRL and vLLM names of the weight sync on a CPU (vllm_engine.py) are listed too (VLLM_*), checked when
vLLM is colocated on a CPU, and by tests/test_vllm.py where vLLM is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import transformers
import trl
from trl import GRPOConfig, GRPOTrainer

from trustclip.integrations.trl.zero_advantage import MULTIMODAL_KEYS

# Private methods the subclass overrides -> the parameters its override (or its calls of them) relies on.
OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    "_generate_and_score_completions": ("inputs",),  # drop zero-advantage rows; defer the old log-probs; rloo
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),  # truncated_reward
    "_prepare_inputs": ("generation_batch",),  # count the tokens of each slice of a new generation batch
    "_compute_loss": ("model", "inputs"),  # the trustclip objective's per-token loss replaces TRL's
    "_get_per_token_logps_and_entropies": (  # fused log-probs / entropies; a NaN placeholder when deferred
        "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss", *MULTIMODAL_KEYS),
    # sample from the low-precision copy (generation_dtype)
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations"),
    # transformers.Trainer's, also overridden by GRPOTrainer: the resolved checkpoint of a resume, where the
    # DeltaControlCallback's state is read back
    "_load_optimizer_and_scheduler": ("checkpoint",),
}
# TRL methods the subclass calls -> their parameters it passes.
CALLED_METHODS: dict[str, tuple[str, ...]] = {
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),  # top_entropy_quantile
    "get_off_policy_mask": ("advantages", "per_token_logps", "sampling_per_token_logps", "mask",
                            "off_policy_threshold"),  # off_policy_mask_threshold
}
# Trainer state set by GRPOTrainer.__init__ that the subclass reads (and, where noted, writes). Settings TRL copies
# from its config are read from the config instead (CONFIG_FIELDS).
ATTRIBUTES: dict[str, str] = {
    "model_wrapped": "the model TRL's generation samples from (the low-precision copy while generating)",
    "is_fsdp_enabled": "FSDP shards the policy (no whole weights to copy for generation_dtype)",
    "is_deepspeed_enabled": "DeepSpeed, likewise",
    "_metrics": "per-mode metric buffers the subclass appends its metrics to (TRL logs and clears them)",
    "_buffered_inputs": "the generation batch split into slices (the subclass counts their tokens)",
    "_step": "micro-step counter: which slice of the buffered batch a micro-batch is",
    "_tokenizer": "the tokenizer of the processing class (pad id of a truncated completion)",
    "eos_token_ids": "ids that end a completion (a completion without one was truncated)",
    "reward_funcs": "the reward functions (their verifier counters are logged)",
    "reward_func_names": "their names in TRL's `rewards/<name>/mean|std` metrics (truncated_reward's true scores)",
    "reward_weights": "TRL's weights of the total reward (truncated_reward replaces the weighted total)",
    "_logs": "TRL's completion log (`rewards` per function name: truncated_reward's true scores)",
    "aux_loss_enabled": "MoE router auxiliary loss (from the model's config)",
    "router_aux_loss_coef": "its coefficient",
    "entropy_coef": "entropy coefficient (written by the adaptive controller; TRL saves it)",
    "_last_world_entropy": "the controller's last window entropy (read and written; TRL saves it)",
    "_entropy_window_stats": "the controller's running window sums (read and written)",
}
# Set by transformers.Trainer during train(), not at construction: checked in its source.
TRAINING_ATTRIBUTES: dict[str, str] = {
    "current_gradient_accumulation_steps": "micro-batches in this optimizer step (normalisers)",
}
# GRPOConfig fields the subclass reads besides the ones it passes through (TRL's documented configuration).
CONFIG_FIELDS = ("steps_per_generation", "num_iterations", "gradient_accumulation_steps", "num_generations",
                 "max_completion_length", "temperature", "beta", "use_bias_correction_kl", "use_vllm",
                 "vllm_importance_sampling_correction", "top_entropy_quantile", "off_policy_mask_threshold",
                 "entropy_coef", "use_adaptive_entropy", "entropy_target", "entropy_coef_delta", "entropy_coef_min",
                 "entropy_coef_max", "gradient_checkpointing_kwargs", "importance_sampling_level", "scale_rewards")
CONFIG_PROPERTIES = ("should_save",)  # TrainingArguments properties the subclass (and its callback) reads
# Module-level helpers imported from TRL's internals: module -> names.
FUNCTIONS = {"trl.models.utils": ("disable_gradient_checkpointing",),
             "trl.trainer.utils": ("add_fused_lm_head",  # mixed_precision.py: float32 log-probs
                                   "nanstd")}  # a reward function's std, as TRL logs it
# vLLM colocated on a CPU (vllm_engine.py): "module:Class.method" of TRL and vLLM -> the parameters passed to it.
VLLM_METHODS: dict[str, tuple[str, ...]] = {
    "trl.generation.vllm_generation:VLLMGeneration.sync_weights": (),  # replaced on a CPU
    "trl.generation.vllm_generation:VLLMGeneration._iter_named_params": (),  # the weights, LoRA merged, vLLM's names
    "vllm:LLM.reset_prefix_cache": (),  # stale KV entries after a sync
    "vllm.v1.worker.gpu_worker:Worker.reload_weights": (),  # forwards to the model runner's
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights": ("weights_iterator",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model": (),
    "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead.tie_weights": ("embed_tokens",),
    "vllm.model_executor.layers.vocab_parallel_embedding:UnquantizedEmbeddingMethod.process_weights_after_loading":
        ("layer",),  # re-packs the tied head's weight for the CPU GEMM
}
# Module attributes: TRL's `LLM`, wrapped with enforce_eager while TRL builds its engine (vllm_engine.engine_options);
# the loggers of vLLM's load and layer-wise reload, whose expected warnings vllm_engine drops (LOAD_LOGGER,
# RELOAD_LOGGER name these modules: moved, the filters would drop nothing).
VLLM_MODULE_ATTRIBUTES = {"trl.generation.vllm_generation": ("LLM",), "vllm.model_executor.models.utils": ("logger",),
                          "vllm.model_executor.model_loader.reload.layerwise": ("logger",)}
# The path from the trainer to the vLLM worker, attribute by attribute (instances, after TRL built the engine).
VLLM_INSTANCE_PATH = ("vllm_generation", "llm", "llm_engine", "model_executor", "driver_worker", "model_runner")


def missing_names(trainer: Any = None) -> list[str]:
    """Every listed name the installed TRL lacks, as `what: name (why)`; [] when all are there. `trainer` (an
    instance, optional) lets the instance attributes be checked too."""
    missing = []
    for group, methods in (("overridden method", OVERRIDDEN_METHODS), ("method", CALLED_METHODS)):
        for name, params in methods.items():
            if not callable(getattr(GRPOTrainer, name, None)):
                missing.append(f"{group} GRPOTrainer.{name}")
                continue
            have = inspect.signature(getattr(GRPOTrainer, name)).parameters
            missing += [f"parameter {p!r} of GRPOTrainer.{name}" for p in params if p not in have]
    if trainer is not None:
        missing += [f"attribute GRPOTrainer.{name} ({why})" for name, why in ATTRIBUTES.items()
                    if not hasattr(trainer, name)]
    trainer_source = inspect.getsource(transformers.Trainer)
    missing += [f"attribute Trainer.{name} ({why})" for name, why in TRAINING_ATTRIBUTES.items()
                if f"self.{name} =" not in trainer_source]
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    missing += [f"GRPOConfig field {name}" for name in CONFIG_FIELDS if name not in fields]
    missing += [f"GRPOConfig property {name}" for name in CONFIG_PROPERTIES if not hasattr(GRPOConfig, name)]
    for module, names in FUNCTIONS.items():
        loaded = importlib.import_module(module)
        missing += [f"function {module}.{name}" for name in names if not hasattr(loaded, name)]
    return missing


def missing_vllm_names(trainer: Any = None) -> list[str]:
    """Every listed TRL / vLLM name the CPU weight sync relies on that the installed versions lack ([] when all are
    there); with `trainer` (built with vLLM colocated), also its path to the vLLM worker."""
    missing = []
    for target, params in VLLM_METHODS.items():
        module, qualname = target.split(":")
        owner_name, method = qualname.rsplit(".", 1)
        owner = getattr(importlib.import_module(module), owner_name, None)
        if not callable(getattr(owner, method, None)):
            missing.append(f"method {module}.{qualname}")
            continue
        have = inspect.signature(getattr(owner, method)).parameters
        missing += [f"parameter {p!r} of {module}.{qualname}" for p in params if p not in have]
    for module, names in VLLM_MODULE_ATTRIBUTES.items():
        loaded = importlib.import_module(module)
        missing += [f"attribute {module}.{name}" for name in names if not hasattr(loaded, name)]
    node, path = trainer, "trainer"
    for name in VLLM_INSTANCE_PATH if trainer is not None else ():
        if not hasattr(node, name):
            missing.append(f"attribute {path}.{name}")
            break
        node, path = getattr(node, name), f"{path}.{name}"
    return missing


def check_trl_surface(trainer: Any, vllm_on_cpu: bool = False) -> None:
    """Raise RuntimeError naming every TRL name the subclass relies on that the installed TRL lacks (and, with
    `vllm_on_cpu`, every TRL / vLLM name of the CPU weight sync)."""
    missing = missing_names(trainer=trainer) + (missing_vllm_names(trainer) if vllm_on_cpu else [])
    if missing:
        raise RuntimeError(f"TRL {trl.__version__} lacks what TrustClipGRPOTrainer relies on: {'; '.join(missing)}. "
                           "trustclip supports trl==1.16.* (see trustclip/integrations/trl/surface.py)")
