"""TRL 1.16 `GRPOTrainer` with the per-token policy loss replaced by any trustclip objective.

TRL computes each `loss_type`'s per-token loss inline in `_compute_loss`, so the subclass overrides `_compute_loss`
and changes that one step: the objective's per-token loss, aggregated with exact global normalisers (`step_counts`).
The rest follows TRL's loss: its methods where it has them (fused log-probs, the high-entropy and off-policy masks),
its formulas where they are inline (vLLM importance weights, the k3 reference KL, the entropy bonus and its adaptive
controller, whose state TRL saves, the MoE auxiliary loss, the metric names), each checked against TRL's own loss by
the tests. The private TRL names used are listed in `surface.py` and checked at start-up.

Off-policy updates: the ratio w = pi / pi_old differs from 1 only when a generation batch serves more than one
optimizer step (`num_iterations >= 2` or `steps_per_generation > gradient_accumulation_steps`); otherwise every
clipping objective is the plain policy gradient, and the trainer warns loudly at start-up.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import operator
import warnings
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanstd

from trustclip import metric_names as names
from trustclip.integrations.trl.config import (
    TrustClipGRPOConfig,
    check_delta_control,
    generation_period,
    on_policy_warning,
    settings_line,
)
from trustclip.integrations.trl.delta_control import DeltaControlCallback, controller_for
from trustclip.integrations.trl.full_vocab import FullVocabForward, prompt_and_completion, row_slices
from trustclip.integrations.trl.mixed_precision import (
    float32_lm_head,
    low_precision_sampler,
    merged_lora_forward,
    sampling_copy,
)
from trustclip.integrations.trl.step_counts import StepCounts
from trustclip.integrations.trl.surface import check_trl_surface
from trustclip.integrations.trl.vllm_engine import (
    engine_options,
    needs_cpu_engine,
    prepare_cpu_engine,
    use_in_place_sync,
)
from trustclip.integrations.trl.zero_advantage import MULTIMODAL_KEYS, drop_zero_advantage, loss_mask
from trustclip.objectives import Objective, PolicyBatch, TokenLoss, aggregate, compute_token_loss
from trustclip.objectives.full_kl import CHUNK_ELEMENTS
from trustclip.objectives.registry import resolve_name
from trustclip.objectives.statistics import reduce_statistics, token_statistics

logger = logging.getLogger(__name__)


class TrustClipGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose policy loss is a trustclip objective.

    Use it like TRL's trainer; pass a [`TrustClipGRPOConfig`] (or a plain `GRPOConfig` plus `objective=`, read as
    `TrustClipGRPOConfig.from_grpo_config` reads it):

        trainer = TrustClipGRPOTrainer(model, reward_funcs=reward, args=TrustClipGRPOConfig(
            output_dir="out", objective="kl3", objective_kwargs={"delta": 0.07}, num_iterations=2),
            train_dataset=dataset)
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, *,
                 objective: str | Objective | None = None, **kwargs: Any) -> None:
        if args is None:
            raise ValueError("TrustClipGRPOTrainer needs args=TrustClipGRPOConfig(...) (or GRPOConfig and objective=)")
        if not isinstance(args, TrustClipGRPOConfig):  # a plain GRPOConfig: trustclip's own fields at their defaults
            if objective is None:
                raise ValueError("with a plain GRPOConfig pass objective=NAME (or use TrustClipGRPOConfig)")
            args = TrustClipGRPOConfig.from_grpo_config(
                args, objective=objective.name if isinstance(objective, Objective) else objective)
        self.aggregation, self.advantage_estimator = args.aggregation, args.advantage_estimator
        # the config resolved and checked its objective when it was built; one given here replaces it
        self._objective = objective if isinstance(objective, Objective) else args.build_objective(
            None if objective is None or objective == args.objective else objective)
        if self._objective.name != resolve_name(args.objective).name:  # the config checked its own objective's batches
            check_delta_control(args, self._objective.name)
        # adaptive delta (atr_adaptive, or adaptive_delta with any objective that has a delta): None without it
        self.delta_controller = controller_for(self._objective, args.adaptive_delta, args.adaptive_delta_kwargs)
        self._delta_callback = None
        if self.delta_controller is not None:
            self._delta_callback = DeltaControlCallback(
                self.delta_controller, gradient_accumulation_steps=args.gradient_accumulation_steps,
                generate_every=generation_period(args))
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self._delta_callback]
        self._defer_old_logps = False  # set while TRL scores a generation batch whose old log-probs can wait
        self._scored = None  # truncated_reward: what each reward function returned, for its metrics
        self._score_later = False  # its slices' old log-probs are due when TRL buffers them (`_score_old_logps`)
        on_cpu = needs_cpu_engine(args)  # vLLM's CPU build: its own set-up and weight sync (vllm_engine.py)
        if on_cpu:
            prepare_cpu_engine()
        colocated = args.use_vllm and args.vllm_mode == "colocate"  # TRL builds the engine in this process
        with engine_options(enforce_eager=args.vllm_enforce_eager) if colocated else contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, **kwargs)
        check_trl_surface(self, vllm_on_cpu=on_cpu)  # every private TRL name used below exists (surface.py)
        if on_cpu:
            use_in_place_sync(self)
        if (args.bf16 or args.fp16) and not args.cast_lm_head_to_fp32:
            float32_lm_head(self)  # the log-probs, and so the ratio, in float32
        if (args.bf16 or args.fp16) and args.merged_lora_forward:
            merged_lora_forward(self)  # LoRA layers as one product with the merged weight, as the sampler's
        self._sampler = low_precision_sampler(self)  # generation_dtype's copy of the policy, or None
        self._step_counts = StepCounts(  # the exact normalisers of each optimizer step
            steps_per_generation=args.steps_per_generation, num_iterations=args.num_iterations,
            gradient_accumulation_steps=args.gradient_accumulation_steps)
        self._buffer_seen = None
        self._full_vocab = FullVocabForward(  # truly_ppo's forward, and pi_old's LM head
            args.full_kl_storage, args.full_kl_topk, args.temperature, self.accelerator.unwrap_model,
            self.accelerator.autocast)
        line, translated = settings_line(args, self._objective)  # what a TRL user's settings became
        (logger.warning if translated else logger.info)(line)
        message = on_policy_warning(args, self._objective.name)
        if message:
            logger.warning("\n%s\ntrustclip WARNING: %s\n%s", "!" * 100, message, "!" * 100)
            warnings.warn(message, UserWarning, stacklevel=2)

    @property
    def objective(self) -> Objective:
        """The objective of the next update (with adaptive delta: at the controller's current delta)."""
        return self._objective if self.delta_controller is None else self.delta_controller.objective

    # ------------------------------------------------------------------ generation side
    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        with sampling_copy(self):  # generation_dtype: TRL samples from the refreshed low-precision copy
            return super()._generate_single_turn(*args, **kwargs)

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        skip = self.args.skip_zero_advantage and self.model.training
        full_kl = "full_kl" in self.objective.requires
        # TRL's old-log-prob forward over the whole batch waits (`_score_old_logps`; truly_ppo's old pass, below),
        # except with beta > 0 (the placeholder would replace the reference model's forward too) or when vLLM's
        # importance-sampling correction needs the old log-probs before the rewards.
        deferred = (self.model.training or full_kl) and self.args.beta == 0.0 and not (
            self.args.use_vllm and self.args.vllm_importance_sampling_correction)
        self._defer_old_logps = deferred
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._defer_old_logps = False
        if self._scored is not None:
            self._log_function_scores(self._scored)
        group = self.args.num_generations
        if self.advantage_estimator == "rloo" and group > 1:
            # R_i - mean_{j != i} R_j = G / (G - 1) (R_i - mean_g R); TRL produced the latter (scale_rewards=none)
            output["advantages"] = output["advantages"] * (group / (group - 1))
        if skip:
            output = self.drop_zero_advantage(output)
        self._score_later = deferred and not full_kl and "old_per_token_logps" in output
        if full_kl and "old_per_token_logps" in output:
            # pi_old's log-probs and what the KL needs of it, from the code path that scores the current policy
            # (ratio 1 exactly before the first update)
            output["old_per_token_logps"], stored = self._old_policy(output)
            output |= stored
        return output

    def _score_old_logps(self, slices: list[dict[str, Any]]) -> None:
        """Old log-probs of a new generation batch's (kept) rows, by TRL's shuffled slices, from the model that sampled
        them. A slice used only before the next update gets none: the loss takes the current ones (ratio exactly 1, as
        TRL does when a whole batch is on-policy). One forward per other slice, alike on every process (ZeRO-3)."""
        self._score_later = False
        on_policy = self._step_counts.on_policy_slices(self._step)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for piece, fresh in zip(slices, on_policy, strict=True):
                if fresh:
                    del piece["old_per_token_logps"]
                else:
                    piece["old_per_token_logps"] = self._completion_logps(
                        self.model, piece, batch_size=piece["completion_ids"].size(0))[0]

    def drop_zero_advantage(self, output: dict[str, Any]) -> dict[str, Any]:
        """This process's generation batch without its zero-advantage completions (`skip_zero_advantage`; see
        `trustclip.integrations.trl.zero_advantage`), counted over every process; logs the kept fraction."""
        kept, fraction = drop_zero_advantage(output, self.args.steps_per_generation, self._sum_over_processes)
        self._metrics["train"][names.KEPT_FRACTION].append(fraction)
        return kept

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, reduction="sum")

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._scored = None
        if self.args.truncated_reward is not None:
            finished = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            truncated = torch.tensor([len(ids) > 0 and ids[-1] not in finished for ids in completion_ids_list],
                                     device=rewards.device)
            self._scored = rewards.clone()
            # TRL's total is the weighted sum of the functions' scores (sum_then_normalize): a truncated row gets the
            # scores t w / |w|^2, whose weighted sum is t; each function's metrics report what it returned
            weights = self.reward_weights.to(rewards.device, rewards.dtype)
            rewards[self.accelerator.gather(truncated)] = self.args.truncated_reward * weights / weights.square().sum()
        # Reward functions with a `metrics()` method (trustclip.rewards.CorrectnessReward) report cumulative
        # verifier counters; log their totals over processes (the first such function: they share a verifier).
        counters = next((f.metrics() for f in self.reward_funcs if callable(getattr(f, "metrics", None))), None)
        if counters:
            mode = "train" if self.model.training else "eval"
            keys = [k for k in (names.REWARD_TIMEOUTS, names.REWARD_ERRORS) if k in counters]
            local = torch.tensor([counters[k] for k in keys], dtype=torch.float32, device=self.accelerator.device)
            for key, total in zip(keys, self._sum_over_processes(local).tolist(), strict=True):
                self._metrics[mode][key].append(total)
        return rewards

    def _log_function_scores(self, scored: torch.Tensor) -> None:
        """Each reward function's mean / std and logged scores (TRL's `rewards/<name>/...`) as it returned them, in
        place of the truncated_reward stand-ins TRL logged (the total `reward` is the replaced one)."""
        mode = "train" if self.model.training else "eval"
        self._scored = None
        for i, name in enumerate(self.reward_func_names):
            self._metrics[mode][f"rewards/{name}/mean"][-1] = torch.nanmean(scored[:, i]).item()
            self._metrics[mode][f"rewards/{name}/std"][-1] = nanstd(scored[:, i]).item()
            logged = self._logs["rewards"][name]
            for _ in range(min(len(logged), scored.size(0))):
                logged.pop()
            logged.extend(scored[:, i].tolist())

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not self._buffer_seen:
            self._buffer_seen = self._buffered_inputs
            self.count_slices(self._buffered_inputs)
            if self._score_later:
                self._score_old_logps(self._buffered_inputs)
        return inputs

    def count_slices(self, slices: list[dict[str, Any]]) -> None:
        """Record the valid tokens and sequences of each slice of a new generation batch, over every process."""
        self._step_counts.count(slices, self._sum_over_processes)

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        # Defined here (not inherited) so that libraries patching GRPOTrainer.compute_loss (e.g. Unsloth, whose
        # version never calls _compute_loss) cannot silently bypass the objective.
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return self._compute_loss(model, inputs)

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss step with the trustclip objective's per-token loss (module docstring)."""
        mode = "train" if self.model.training else "eval"
        mask = loss_mask(inputs)
        logps, entropies, aux_loss, extras = self._policy_forward(model, inputs)
        has_tokens = bool(mask.any())
        # A micro-batch with no valid token (e.g. all completions truncated and masked) still runs the same
        # code and collectives, with one dummy token of weight 0, so the loss and gradient are exactly zero.
        weights, entropy_mask = self._token_weights(inputs, logps, entropies, mask)
        out, batch = compute_token_loss(
            self.objective, logp=logps, old_logp=inputs.get("old_per_token_logps"), advantages=inputs["advantages"],
            mask=mask if has_tokens else _one_token_mask(mask),
            token_weights=weights if has_tokens else torch.zeros_like(logps), fused=self.args.fused_loss, **extras,
        )
        per_token_loss, per_token_kl = out.loss, None
        if self.args.beta != 0.0:
            per_token_kl = self._reference_kl(inputs, logps, batch)
            per_token_loss = per_token_loss + self.args.beta * per_token_kl * batch.mask * (1.0 if has_tokens else 0.0)
        denominators = self._step_counts.denominators(  # global, of this micro-batch's optimizer step, per process
            self.aggregation, inputs, micro_step=self._step, training=mode == "train",
            accumulation=self._accumulation(mode), processes=self.accelerator.num_processes)
        max_len = self.args.max_len_normalizer or self.args.max_completion_length
        loss = aggregate(per_token_loss, batch.mask, self.aggregation, max_len=max_len, **denominators)
        # Per-micro-batch policy loss before the accumulation / process split (TRL's `policy_loss`).
        policy_loss = loss.detach() * self.accelerator.num_processes * self._accumulation(mode)
        values, tokens = self._log_objective_metrics(mode, out, batch, mask.to(logps.dtype), entropies, per_token_kl,
                                                     policy_loss)
        if "sampling_per_token_logps" in inputs:
            self._log_sampler_gap(mode, inputs, logps, mask)
        if self._delta_callback is not None and mode == "train":
            for key, value in self._delta_callback.record(values, tokens, self._step).items():
                self._metrics[mode][key].append(value)
        loss = loss + self._entropy_bonus(entropies, mask if entropy_mask is None else mask * entropy_mask, mode)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        return loss

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, *args: Any, **kwargs: Any):
        if self._defer_old_logps:  # TRL's old-log-prob forward of a whole generation batch: a NaN placeholder
            placeholder = torch.full((input_ids.size(0), logits_to_keep), math.nan, device=input_ids.device)
            return placeholder, None, None
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          *args, **kwargs)

    def _completion_logps(self, model: Any, inputs: dict[str, Any], **kwargs: Any):
        """TRL's fused (log-probs, entropies, aux loss) of the completions in `inputs` under `model`."""
        return self._get_per_token_logps_and_entropies(
            model, *prompt_and_completion(inputs), inputs["completion_ids"].size(1),
            **{k: inputs.get(k) for k in MULTIMODAL_KEYS}, **kwargs,
        )

    def _policy_forward(self, model: Any, inputs: dict[str, Any]):
        """(logps, entropies, aux_loss, extras) of the current policy on the completions."""
        extras: dict[str, torch.Tensor] = {}
        if "full_kl" in self.objective.requires:
            keys = self._full_vocab.keys
            old = {key: inputs[key] for key in keys} if keys[0] in inputs else None
            logps, entropies, kl = self._full_vocab_forward(model, inputs, old=old)
            # KL(pi_old(.|s) || pi(.|s)) per position; zero when on-policy (pi_old == pi).
            extras["full_kl"] = torch.zeros_like(logps) if kl is None else kl
            aux_loss = None
        else:
            logps, entropies, aux_loss = self._completion_logps(
                model, inputs, compute_entropy=True, compute_aux_loss=self.aux_loss_enabled)
        if "entropy" in self.objective.requires:
            extras["entropy"] = entropies.detach()
        return logps, entropies, aux_loss, extras

    def _token_weights(self, inputs: dict[str, Any], logps: torch.Tensor, entropies: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Product of TRL's per-token gates (entropy mask, off-policy sequence mask, vLLM IS weights) or None,
        and the entropy mask alone (the entropy bonus acts on it, as in TRL)."""
        gates, entropy_mask = [], None
        if self.args.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.args.top_entropy_quantile)
            gates.append(entropy_mask)
        if self.args.off_policy_mask_threshold is not None:
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            advantages = inputs["advantages"]
            gates.append(self.get_off_policy_mask(
                advantages=advantages.unsqueeze(1) if advantages.dim() == 1 else advantages,
                per_token_logps=logps, sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask, off_policy_threshold=self.args.off_policy_mask_threshold,
            ))
        if self.args.use_vllm and self.args.vllm_importance_sampling_correction:
            gates.append(inputs["importance_sampling_ratio"])
        # no start value: one gate is used as it is, not multiplied by 1 into a new tensor
        gates = [gate.to(logps.dtype).expand_as(logps) for gate in gates]
        weights = functools.reduce(operator.mul, gates) if gates else None
        return weights, entropy_mask

    def _reference_kl(self, inputs: dict[str, Any], logps: torch.Tensor, batch: PolicyBatch) -> torch.Tensor:
        """k3 estimate of KL(pi || pi_ref) per token, as TRL (optionally IS-corrected)."""
        delta = inputs["ref_per_token_logps"] - logps
        kl = torch.exp(delta) - delta - 1
        if self.args.use_bias_correction_kl:
            kl = kl * batch.ratio
        return torch.where(batch.mask > 0, kl, torch.zeros_like(kl))

    def _accumulation(self, mode: str) -> int:
        return self.current_gradient_accumulation_steps if mode == "train" else 1

    def _entropy_bonus(self, entropies: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor | float:
        """-coef * mean entropy over the tokens the loss acts on, with TRL's adaptive controller (TRL's formulas, and
        its state: TRL saves it with each checkpoint)."""
        if not (self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy):
            return 0.0
        mask = mask.to(entropies.dtype)
        entropy = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / self._accumulation(mode)
        coef = self.entropy_coef
        if self.args.use_adaptive_entropy:
            coef = coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            if mode == "train":
                self._update_adaptive_entropy(entropies, mask)
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return -coef * entropy

    def _update_adaptive_entropy(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self._sum_over_processes(self._entropy_window_stats)
        world = (totals[0] / totals[1].clamp(min=1.0)).item()
        step = self.args.entropy_coef_delta
        if world <= self.args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
        self._last_world_entropy = world
        self._entropy_window_stats = None

    def _log_objective_metrics(self, mode: str, out: TokenLoss, batch: PolicyBatch, mask: torch.Tensor,
                               entropies: torch.Tensor, per_token_kl: torch.Tensor | None,
                               policy_loss: torch.Tensor) -> tuple[dict[str, float], float]:
        """The objective's statistics (`trustclip.objectives.statistics`) plus the entropy, the reference KL and the
        policy loss, as token-weighted means over every process (one all-reduce, one all-gather). Returns them with
        the global number of valid tokens."""
        stats = token_statistics(out, batch)
        stats.means[names.ENTROPY] = entropies.detach()
        if per_token_kl is not None:
            stats.means[names.KL_REF] = per_token_kl.detach()
        stats.scalars[names.POLICY_LOSS] = policy_loss
        values, tokens = reduce_statistics(
            stats, mask, sum_over_processes=self._sum_over_processes, num_processes=self.accelerator.num_processes,
            max_over_processes=lambda extremes: self.accelerator.gather(extremes).view(-1, 2).max(dim=0).values)
        for key, value in values.items():
            trl_level = key in (names.ENTROPY, names.KL_REF, names.POLICY_LOSS)  # logged under TRL's names only
            for name in [key] if trl_level else names.logged_names(key):
                self._metrics[mode][name].append(value)
        self._log_sequence_clip_extremes(mode, out, mask)
        return values, tokens

    def _log_sampler_gap(self, mode: str, inputs: dict[str, Any], logps: torch.Tensor, mask: torch.Tensor) -> None:
        """Mean and max over every process of |log pi_sampler - log pi_old| per completion token (vLLM's log-probs of
        the tokens it sampled, temperature applied, against the trainer's). pi_old is the current policy on a slice
        that is used before the next update (the loss takes it as pi_old there), TRL's old log-probs otherwise."""
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None or bool(old.isnan().all()) else old
        gap = (old.detach().float() - inputs["sampling_per_token_logps"].float()).abs()
        valid = mask.bool() & ~gap.isnan()  # tokens vLLM could not score are NaN
        gap = torch.where(valid, gap, torch.zeros_like(gap))
        total, count = self._sum_over_processes(torch.stack([gap.sum(), valid.sum().to(gap.dtype)])).tolist()
        self._metrics[mode][names.SAMPLER_GAP_MEAN].append(total / max(count, 1.0))
        self._metrics[mode][names.SAMPLER_GAP_MAX].append(self.accelerator.gather(gap.max()[None]).max().item())

    def _log_sequence_clip_extremes(self, mode: str, out: TokenLoss, mask: torch.Tensor) -> None:
        """TRL's `clip_ratio/low_min` and `clip_ratio/high_max`: over every process's sequences, the smallest fraction
        of a sequence's tokens clipped low and the largest clipped high (a sequence without valid tokens counts
        nowhere). Reduced on each process first: with skip_zero_advantage processes hold different numbers of rows."""
        tokens = mask.sum(-1)
        low = (out.clipped_low.to(mask.dtype) * mask).sum(-1) / tokens  # NaN for a sequence without tokens
        high = (out.clipped_high.to(mask.dtype) * mask).sum(-1) / tokens
        extremes = self.accelerator.gather(torch.stack([_nan_extreme(low, torch.amin), _nan_extreme(high, torch.amax)]))
        extremes = extremes.view(-1, 2)
        low_min, high_max = _nan_extreme(extremes[:, 0], torch.amin), _nan_extreme(extremes[:, 1], torch.amax)
        self._metrics[mode][names.TRL_CLIP_LOW_MIN].append(low_min.item())
        self._metrics[mode][names.TRL_CLIP_HIGH_MAX].append(high_max.item())

    # ------------------------------------------------------------------ truly_ppo: the full-vocabulary KL
    def _old_policy(self, output: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pi_old's log-probs of the completions and what the loss needs of its full distribution per position (no
        gradient; `full_kl_storage`), in steps_per_generation forwards of at most a micro-batch."""
        chunk = max(1, output["completion_ids"].size(0) // self.args.steps_per_generation)
        logps, stored = [], []
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for rows in row_slices(output, chunk):
                logp, _, kept = self._full_vocab_forward(self.model, rows, keep=True)
                logps.append(logp)
                stored.append(kept)
        self._full_vocab.keep_head(self.model, "train" if self.model.training else "eval")
        return torch.cat(logps), {key: torch.cat([s[key] for s in stored]) for key in self._full_vocab.keys}

    def _full_vocab_forward(self, model: Any, inputs: dict[str, Any], *, old: dict[str, torch.Tensor] | None = None,
                            keep: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(log-prob, entropy, KL to `old` / what to `keep` / None) per completion token (`full_vocab`)."""
        return self._full_vocab(model, inputs, old=old, keep=keep, mode="train" if self.model.training else "eval",
                                chunk_elements=CHUNK_ELEMENTS)

    # ------------------------------------------------------------------ adaptive delta: resume
    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._delta_callback is not None and checkpoint is not None:
            self._delta_callback.load(checkpoint, self._objective.name)


def _nan_extreme(values: torch.Tensor, extreme: Any) -> torch.Tensor:
    """`extreme` (torch.amin / amax) of the non-NaN values; NaN when there are none (TRL's nanmin / nanmax)."""
    kept = values[~values.isnan()]
    return extreme(kept) if kept.numel() else torch.full((), math.nan, dtype=values.dtype, device=values.device)


def _one_token_mask(mask: torch.Tensor) -> torch.Tensor:
    dummy = torch.zeros_like(mask)
    dummy[0, 0] = 1
    return dummy
