"""TRL 1.16 `GRPOTrainer` with the policy loss replaced by any trustclip objective.

The loss (`_compute_loss`, TRL's extension point) is replaced; generation, rewards, the fused LM-head log-prob
path (`_get_per_token_logps_and_entropies`), reference model, PEFT, checkpointing and logging are TRL's, with
small hooks. Every private TRL name the subclass overrides or touches is listed in `trl_surface.py` and checked
at start-up. What the override keeps from TRL's own loss: the high-entropy token mask
(`top_entropy_quantile`), the off-policy sequence mask (`off_policy_mask_threshold`), vLLM importance
weights, the k3 KL to a reference model (`beta`), the entropy bonus (static or adaptive), the MoE
auxiliary loss, and the `clip_ratio/*` / `entropy` metric names.

Normalisation (the contract with `transformers.Trainer`, `loss_is_scaled_for_ga = True`): each
micro-batch returns its share of the one-big-batch loss of the optimizer step, so that summing over
gradient-accumulation steps and averaging over processes (DDP) gives exactly the gradient of the whole
step's batch. Sequence aggregations divide by the step's number of sequences, `token_mean` by its number of
valid tokens, both counted over all processes from the buffered generation batch when the accumulation
window lies inside one generation batch (always true with TRL's default steps_per_generation). The counts
matter with `skip_zero_advantage`, which leaves processes with micro-batches of different sizes.

Off-policy updates: the ratio w = pi / pi_old differs from 1 only when a generation batch is used for more
than one optimizer step: `num_iterations >= 2` (mu updates per batch) or `steps_per_generation >
gradient_accumulation_steps` (one batch split over several optimizer steps). Otherwise every clipping
objective reduces to the plain policy gradient; the trainer warns loudly at start-up.

Adaptive delta (`atr_adaptive`): a `DeltaController` moves delta once per generation batch, from the token-weighted
mean of its statistic (`kl3_mean` or `clip_frac`, over all processes) on the batch's off-policy micro-batches (those
after its first optimizer step; on the first the ratio is 1 and says nothing about the update). The new delta
applies from the next generation batch, so every update of one batch uses one delta, as PPO keeps beta fixed within
an iteration. The controller's state is saved in each checkpoint (`delta_controller.json`, written before
`trainer_state.json`) and restored on resume; `objective/delta` and `objective/controller_<statistic>` are logged.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from trustclip import metric_names as names
from trustclip.files import write_json_atomic
from trustclip.objectives import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    Objective,
    aggregate,
    compute_token_loss,
    get_objective,
)
from trustclip.objectives.adaptive import ADAPTIVE_OBJECTIVES, controller_for
from trustclip.objectives.batch import PolicyBatch
from trustclip.objectives.loss import offpolicy_tokens
from trustclip.objectives.registry import TokenLoss
from trustclip.objectives.topk_kl import DEFAULT_TOPK, TopKLogProbs, exact_kl, topk_kl, topk_logprobs
from trustclip.trainers.trl_options import LOSS_OPTIONS as TRL_LOSS_OPTIONS
from trustclip.trainers.trl_options import OPTIONS as TRL_OPTIONS
from trustclip.trainers.trl_options import SCALE_REWARDS_OF, spelled
from trustclip.trainers.trl_options import translate as translate_trl_options
from trustclip.trainers.trl_surface import check_trl_surface

logger = logging.getLogger(__name__)

# TRL's reward scaling that yields each advantage estimator (rloo additionally rescales by G / (G - 1)).
DELTA_CONTROLLER_FILE = "delta_controller.json"  # in each checkpoint folder, for atr_adaptive

# truly_ppo: what the generation batch keeps of pi_old per completion token (split per micro-batch like every (B, ...)
# tensor), per `full_kl_storage`
FULL_KL_STORAGES = ("hidden", "topk")
_OLD_HIDDEN_KEYS = ("old_hidden_states",)
_OLD_TOPK_KEYS = ("old_topk_indices", "old_topk_logps", "old_tail_logps")
# Elements of one (positions, V) chunk of the LM head's output in truly_ppo's forward: 32 MB in float32.
_HEAD_CHUNK_ELEMENTS = 2**23
_TRL_LOSS_HELP = ("TRL's loss option: unset by default; given, it is mapped onto the trustclip objective it "
                  "computes, or refused (trustclip.trainers.trl_options).")


@dataclass
class TrustClipGRPOConfig(GRPOConfig):
    r"""[`~trl.GRPOConfig`] plus the trustclip objective, which replaces TRL's loss. TRL's loss options
    (`loss_type`, `epsilon`, `epsilon_high`, `delta`, `sapo_temperature_*`, `vespo_*`, `scale_rewards`) are honoured
    where they are exactly a trustclip setting (`loss_type="dapo", epsilon_high=0.28` is `clip_higher` with
    `token_mean`; see `trustclip.trainers.trl_options`) and refused otherwise, also when they contradict an
    `objective`, `aggregation` or `advantage_estimator` given here. Never ignored.

    Parameters:
        objective (`str`, defaults to `"kl3"`):
            Objective name from `trustclip.list_objectives()` (e.g. `kl3` = ATR-GRPO, `clip`, `clip_higher`,
            `dual_clip`, `dcpo`, `sapo`, `clip_cov`, `gspo`, ...); unset, the one TRL's loss options spell, else
            `kl3`. `atr_adaptive` moves its delta once per
            generation batch and needs each optimizer step inside one generation batch (`steps_per_generation x
            num_iterations` a multiple of `gradient_accumulation_steps`; TRL's defaults are).
        objective_kwargs (`dict` or `str`, *optional*):
            Hyper-parameters of the objective (a dict, or a JSON string), e.g. `{"delta": 0.07}`.
        aggregation (`str`, defaults to `"dr_grpo"`):
            `dr_grpo` (sum / (B * L_max), Dr.GRPO), `token_mean` (DAPO), `seq_mean_token_mean` (GRPO) or
            `seq_mean_token_sum`; unset, the one of TRL's `loss_type` if given, else `dr_grpo`.
        advantage_estimator (`str`, defaults to `"dr_grpo"`):
            `dr_grpo` (R - group mean), `grpo` (group-standardised, TRL's `scale_rewards="group"`) or `rloo`
            (leave-one-out baseline); unset, the one of TRL's `scale_rewards` if given, else `dr_grpo`.
        max_len_normalizer (`int`, *optional*):
            L_max of the `dr_grpo` aggregation; defaults to `max_completion_length`.
        truncated_reward (`float`, *optional*):
            Reward of a completion that hit `max_completion_length` without an EOS (every reward function's
            score of it is replaced). `0.0` makes an unfinished answer a wrong one, so the policy cannot drift
            into never stopping after its answer; unlike `mask_truncated_completions` (DAPO's overlong
            filtering) such completions still get a (negative) gradient. Default: score them as they are.
        skip_zero_advantage (`bool`, defaults to `False`):
            Leave completions whose advantage is exactly 0 out of the policy update: with a binary reward, every
            group whose rewards all agree (the filter of DAPO's dynamic sampling, arXiv 2503.14476, Eq. 11,
            without its re-sampling). They carry no policy gradient, so the update direction is unchanged
            (beta = 0, no entropy bonus, an objective without batch statistics; Clip-Cov / KL-Cov select among
            the kept tokens) and each update is cheaper. Normalisers count the kept completions, as DAPO's filtered
            batch; the logged entropy, clip fractions and ratios describe them too. To keep more informative
            groups per update, raise the generation batch (prompts per step or `steps_per_generation`).
        full_kl_storage (`str`, defaults to `"hidden"`):
            What objectives that need the full-vocabulary KL(pi_old || pi) (`truly_ppo`) keep of pi_old per completion
            token, instead of its whole log-softmax (4 V bytes per token). `"hidden"`: the final hidden state (the LM
            head's input, 4 H bytes; plus one frozen copy of the head per generation batch when the head trains),
            from which pi_old's logits are recomputed chunk by chunk: the KL is exact. `"topk"`: the `full_kl_topk`
            largest log-probs plus the tail mass (8 k + 4 bytes), and the KL of the coarse-grained distributions: a
            lower bound, low by the tail mass times the KL within the tail (`trustclip.objectives.topk_kl`); the
            smaller when H is large and completions long.
        full_kl_topk (`int`, defaults to `256`):
            k of `full_kl_storage="topk"`; k >= V - 1 keeps the whole distribution (exact).
    """

    objective: str | None = field(default=None, metadata={"help": "trustclip objective name (see `trustclip "
                                                                "objectives`); default kl3, or the one TRL's loss "
                                                                "options spell."})
    objective_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Objective hyper-parameters (dict or JSON string), e.g. '{\"delta\": 0.07}'."}
    )
    aggregation: str | None = field(
        default=None, metadata={"help": f"Loss aggregation, one of {', '.join(AGGREGATIONS)} (default dr_grpo, or "
                                        "the one of TRL's loss_type)."}
    )
    advantage_estimator: str | None = field(
        default=None, metadata={"help": f"Advantage estimator, one of {', '.join(ADVANTAGE_ESTIMATORS)} (default "
                                        "dr_grpo, or the one of TRL's scale_rewards)."}
    )
    max_len_normalizer: int | None = field(
        default=None, metadata={"help": "L_max of the dr_grpo aggregation (default: max_completion_length)."}
    )
    truncated_reward: float | None = field(
        default=None, metadata={"help": "Reward of completions cut at max_completion_length (default: as scored)."}
    )
    skip_zero_advantage: bool = field(
        default=False, metadata={"help": "Leave completions with advantage 0 (groups whose rewards all agree) out of "
                                         "the policy update (DAPO's dynamic-sampling filter, without re-sampling)."}
    )
    full_kl_storage: str = field(
        default="hidden", metadata={"help": "truly_ppo: what is kept of pi_old per token for the full-vocabulary KL: "
                                            "'hidden' (final hidden state; exact KL) or 'topk' (top-k + tail mass)."}
    )
    full_kl_topk: int = field(
        default=DEFAULT_TOPK, metadata={"help": "k of full_kl_storage='topk' (old-policy tokens kept per position; "
                                                ">= V - 1 is exact)."}
    )
    # TRL's loss options, unset (None) unless given: given, each is mapped or refused (trustclip.trainers.trl_options)
    loss_type: str | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    epsilon: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    epsilon_high: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    delta: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    sapo_temperature_pos: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    sapo_temperature_neg: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    vespo_k_pos: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    vespo_lambda_pos: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    vespo_k_neg: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    vespo_lambda_neg: float | None = field(default=None, metadata={"help": _TRL_LOSS_HELP})
    scale_rewards: str | bool | None = field(default=None, metadata={"help": "TRL's reward scaling: unset, the one "
                                                                             "advantage_estimator needs; given, it "
                                                                             "chooses the advantage estimator."})

    def __post_init__(self) -> None:
        if self.bf16 is None and not self.fp16 and not torch.cuda.is_available():
            self.bf16 = False  # TRL defaults to bf16, which raises on a CPU-only machine
        self._resolve_trustclip_options()
        super().__post_init__()
        self._check_batches()

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig, objective: str | None = None) -> TrustClipGRPOConfig:
        """A TrustClipGRPOConfig with the settings of a built `GRPOConfig` and trustclip's own fields at their
        defaults. A TRL loss option left at TRL's default stands for nothing (the objective replaces TRL's loss); one
        changed from it is mapped or refused, as in TrustClipGRPOConfig."""
        import dataclasses

        new = cls.__new__(cls)
        new.__dict__.update(vars(args))  # GRPOConfig.__post_init__ has run: its derived values are kept
        trl_defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        for f in dataclasses.fields(cls):
            if f.name not in trl_defaults:
                setattr(new, f.name, f.default)
            elif f.name in TRL_OPTIONS and getattr(args, f.name) == trl_defaults[f.name]:
                setattr(new, f.name, None)
        new.objective = objective
        new._resolve_trustclip_options()
        new._check_batches()
        return new

    def _resolve_trustclip_options(self) -> None:
        """TRL's loss options mapped onto (or refused against) objective / aggregation / advantage_estimator, every
        trustclip field checked, and the TRL options the trainer honours checked where TRL does not."""
        if isinstance(self.objective_kwargs, str):
            try:
                self.objective_kwargs = json.loads(self.objective_kwargs) if self.objective_kwargs.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"objective_kwargs={self.objective_kwargs!r} is not valid JSON: {err}") from None
        self.objective_kwargs = dict(self.objective_kwargs or {})
        self._apply_trl_loss_options()
        if not (self.objective == "general" and "constraint" not in self.objective_kwargs):
            # fail early on a bad name or value ("general" takes its Constraint object at the trainer)
            get_objective(self.objective, **self.objective_kwargs)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r} is invalid; valid: {', '.join(AGGREGATIONS)}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} is invalid; valid: {', '.join(ADVANTAGE_ESTIMATORS)}"
            )
        if self.truncated_reward is not None and not math.isfinite(self.truncated_reward):
            raise ValueError(f"truncated_reward={self.truncated_reward} must be a finite number (or None)")
        if self.full_kl_storage not in FULL_KL_STORAGES:
            raise ValueError(f"full_kl_storage={self.full_kl_storage!r} is invalid; valid: "
                             f"{', '.join(FULL_KL_STORAGES)}")
        if isinstance(self.full_kl_topk, bool) or not isinstance(self.full_kl_topk, int) or self.full_kl_topk < 1:
            raise ValueError(f"full_kl_topk={self.full_kl_topk!r} must be an integer >= 1")
        if self.max_len_normalizer is not None and self.max_len_normalizer < 1:
            raise ValueError(f"max_len_normalizer={self.max_len_normalizer} must be a positive integer")
        if self.importance_sampling_level != "token":
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r}: sequence-level ratios are an objective "
                "in trustclip; use objective='gspo' with importance_sampling_level='token'"
            )
        check_honoured_trl_options(self)
        self.scale_rewards = SCALE_REWARDS_OF[self.advantage_estimator]

    def _apply_trl_loss_options(self) -> None:
        """objective / objective_kwargs / aggregation / advantage_estimator from TRL's loss options where those are
        given (`translate`); a contradiction with a trustclip field given here is an error naming both."""
        given = {name: getattr(self, name) for name in TRL_OPTIONS if getattr(self, name) is not None}
        trl = translate_trl_options(given)
        loss = spelled({k: v for k, v in given.items() if k in TRL_LOSS_OPTIONS})
        if trl.objective is not None and self.objective is not None and (
                get_objective(self.objective).name != get_objective(trl.objective).name):
            raise ValueError(f"{loss}: TRL's loss options, which are objective {trl.objective!r} "
                             f"{trl.objective_kwargs} in trustclip, not objective={self.objective!r}; the objective "
                             "replaces TRL's loss: drop them and set objective_kwargs (or objective="
                             f"{trl.objective!r}, objective_kwargs={trl.objective_kwargs})")
        clash = {k: (v, self.objective_kwargs[k]) for k, v in trl.objective_kwargs.items()
                 if k in self.objective_kwargs and self.objective_kwargs[k] != v}
        if clash:
            raise ValueError(f"{loss} and objective_kwargs={self.objective_kwargs} set {', '.join(clash)} to two "
                             f"values {list(clash.values())}; give each once, in objective_kwargs")
        for name, option, value in (("aggregation", "loss_type", trl.aggregation),
                                    ("advantage_estimator", "scale_rewards", trl.advantage_estimator)):
            mine = getattr(self, name)
            if value is not None and mine is not None and mine != value:
                raise ValueError(f"{option}={getattr(self, option)!r} is {name}={value!r} in trustclip, but "
                                 f"{name}={mine!r} is given; drop {option} and keep {name}")
        self.objective = self.objective or trl.objective or "kl3"
        self.objective_kwargs = trl.objective_kwargs | self.objective_kwargs
        self.aggregation = self.aggregation or trl.aggregation or "dr_grpo"
        self.advantage_estimator = self.advantage_estimator or trl.advantage_estimator or "dr_grpo"

    def _check_batches(self) -> None:
        generate_every = self.steps_per_generation * self.num_iterations
        if self.skip_zero_advantage and generate_every % self.gradient_accumulation_steps:
            # processes then hold different numbers of rows, and only whole windows have exact counts
            raise ValueError(
                f"skip_zero_advantage needs each optimizer step inside one generation batch: steps_per_generation="
                f"{self.steps_per_generation} x num_iterations={self.num_iterations} must be a multiple of "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}"
            )
        if not (self.objective == "general" and "constraint" not in self.objective_kwargs):
            message = delta_control_error(self, get_objective(self.objective, **self.objective_kwargs).name)
            if message:
                raise ValueError(message)


def check_honoured_trl_options(args: GRPOConfig) -> None:
    """The TRL options the trainer honours whose values TRL does not check (an out-of-range one would silently turn
    its feature off or make it meaningless), and the optional packages TRL options need (TRL imports them only when
    training starts)."""
    import importlib.util

    quantile = args.top_entropy_quantile
    if not (_is_number(quantile) and 0.0 <= quantile <= 1.0):
        raise ValueError(f"top_entropy_quantile={quantile!r} is invalid: must be in [0, 1] (the fraction of tokens "
                         "kept by entropy; 1 keeps all)")
    threshold = args.off_policy_mask_threshold
    if threshold is not None and not (_is_number(threshold) and 0.0 <= threshold < math.inf):
        raise ValueError(f"off_policy_mask_threshold={threshold!r} is invalid: must be a finite number >= 0 (or None)")
    for name in ("beta", "entropy_coef", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                 "entropy_target"):
        value = getattr(args, name)
        if not (_is_number(value) and math.isfinite(value)):
            raise ValueError(f"{name}={value!r} is invalid: must be a finite number")
    for name in ("beta", "entropy_coef_delta"):
        if getattr(args, name) < 0:
            raise ValueError(f"{name}={getattr(args, name)!r} is invalid: must be >= 0")
    if args.entropy_coef_min > args.entropy_coef_max:
        raise ValueError(f"entropy_coef_min={args.entropy_coef_min!r} is above entropy_coef_max="
                         f"{args.entropy_coef_max!r}")
    for option, module, package in (("use_vllm", "vllm", "vllm"), ("use_liger_kernel", "liger_kernel",
                                                                    "liger-kernel")):
        if getattr(args, option, False) and importlib.util.find_spec(module) is None:
            raise ValueError(f"{option}=True needs the {module} package, which is not installed: pip install "
                             f"{package}, or set {option}=False")
    if args.use_vllm and args.vllm_mode == "colocate" and not torch.cuda.is_available():
        raise ValueError("use_vllm=True with vllm_mode='colocate' needs a CUDA GPU, and this machine has none; set "
                         "use_vllm=False (or vllm_mode='server' with a vLLM server)")
    try:
        from transformers import Trainer

        Trainer.get_optimizer_cls_and_kwargs(args)
    except ImportError as err:  # e.g. optim='adamw_bnb_8bit' without bitsandbytes
        raise ValueError(f"optim={args.optim!r}: {' '.join(str(err).split())}") from None
    except (ValueError, TypeError, AttributeError):
        pass  # optimizers that need the model are checked by transformers when training starts


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def delta_control_error(args: GRPOConfig, objective: str) -> str | None:
    """Why an adaptive objective cannot run with these batch settings, or None."""
    generate_every = args.steps_per_generation * args.num_iterations
    if objective not in ADAPTIVE_OBJECTIVES or generate_every % args.gradient_accumulation_steps == 0:
        return None
    return (f"objective {objective!r} moves delta once per generation batch and needs each optimizer step inside one "
            f"generation batch: steps_per_generation={args.steps_per_generation} x num_iterations="
            f"{args.num_iterations} must be a multiple of gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps}")


def on_policy_warning(args: GRPOConfig, objective: str) -> str | None:
    """The start-up warning when every update is on-policy (w == 1 identically), else None."""
    generate_every = args.steps_per_generation * args.num_iterations
    if args.gradient_accumulation_steps % generate_every != 0:
        return None
    return (
        f"num_iterations={args.num_iterations} and steps_per_generation={args.steps_per_generation} <= "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps}: each generation batch is used for exactly "
        f"one optimizer step, so the importance ratio w = pi/pi_old is identically 1 and the constraint of objective "
        f"{objective!r} NEVER binds (no token is clipped; the update is the plain policy gradient). For off-policy "
        "updates where the objective matters, set num_iterations >= 2 (reuse each batch for several updates) or "
        "steps_per_generation > gradient_accumulation_steps (split one batch over several optimizer steps)."
    )


class TrustClipGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` whose policy loss is a trustclip objective.

    Use it like TRL's trainer; pass a [`TrustClipGRPOConfig`] (or a plain `GRPOConfig` plus `objective=`: trustclip's
    own fields at their defaults, TRL loss options changed from TRL's defaults mapped or refused, as
    `TrustClipGRPOConfig.from_grpo_config` does):

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
        spec = objective if objective is not None else args.objective
        hparams = args.objective_kwargs if objective is None or isinstance(objective, str) else {}
        self.aggregation, self.advantage_estimator = args.aggregation, args.advantage_estimator
        max_len = args.max_len_normalizer
        self.objective = spec if isinstance(spec, Objective) and not hparams else get_objective(spec, **hparams)
        message = delta_control_error(args, self.objective.name)
        if message:
            raise ValueError(message)
        self.delta_controller = controller_for(self.objective)  # atr_adaptive's state; None for other objectives
        self._delta_window = (0.0, 0.0)  # (statistic x tokens, tokens) of this generation batch's off-policy updates
        self._defer_old_logps = False  # set while TRL scores a generation batch whose old log-probs can wait
        self._old_heads: dict[str, Any] = {}  # truly_ppo with hidden-state storage: pi_old's LM head per mode
        super().__init__(model, reward_funcs, args, **kwargs)
        check_trl_surface(self)  # every private TRL name used below still exists (trl_surface.py lists them)
        self.max_len_normalizer = max_len or self.max_completion_length
        # Exact per-step token counts need each accumulation window inside one generation batch.
        self._exact_window = (args.steps_per_generation * args.num_iterations) % args.gradient_accumulation_steps == 0
        self._slice_counts: list[tuple[float, float]] | None = None  # (valid tokens, sequences) per buffered slice
        self._buffer_seen = None
        self.skip_zero_advantage = bool(getattr(args, "skip_zero_advantage", False))
        message = on_policy_warning(args, self.objective.name)
        if message:
            bar = "!" * 100
            logger.warning("\n%s\ntrustclip WARNING: %s\n%s", bar, message, bar)
            warnings.warn(message, UserWarning, stacklevel=2)

    # ------------------------------------------------------------------ generation side
    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        skip = self.skip_zero_advantage and self.model.training
        full_kl = "full_kl" in self.objective.requires
        # With the skip, the old log-probs are needed for the kept rows only: TRL's forward over the whole generation
        # batch is deferred until after the drop. truly_ppo's old pass (below) yields them too. Only when it is the
        # sole scoring forward (no reference model, no vLLM importance-sampling correction, which uses them before
        # the rewards).
        deferred = (skip or full_kl) and self.beta == 0.0 and not (
            self.use_vllm and self.vllm_importance_sampling_correction)
        self._defer_old_logps = deferred
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._defer_old_logps = False
        if self.advantage_estimator == "rloo" and self.num_generations > 1:
            # R_i - mean_{j != i} R_j = G / (G - 1) (R_i - mean_g R); TRL produced the latter (scale_rewards=none)
            output["advantages"] = output["advantages"] * (self.num_generations / (self.num_generations - 1))
        if skip:
            output = self.drop_zero_advantage(output)
        if full_kl and "old_per_token_logps" in output:
            # pi_old's log-probs and what the KL needs of it, from the code path that scores the current policy
            # (ratio 1 exactly before the first update)
            output["old_per_token_logps"], stored = self._old_policy(output)
            output |= stored
        elif deferred and "old_per_token_logps" in output:
            output["old_per_token_logps"] = self._old_logps(output)
        return output

    def _old_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """Log-probs of the completions under the model that sampled them (no update since): TRL's scoring forward.

        The kept rows are a multiple of steps_per_generation, so every process runs steps_per_generation forwards
        (sharded engines such as ZeRO-3 need the same count everywhere), each of at most a micro-batch."""
        chunk = max(1, output["completion_ids"].size(0) // self.args.steps_per_generation)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            return self._completion_logps(self.model, output, batch_size=chunk)[0]

    def drop_zero_advantage(self, output: dict[str, Any]) -> dict[str, Any]:
        """This process's generation batch without its zero-advantage completions (`skip_zero_advantage`).

        The batch is later split into `steps_per_generation` equal slices, so the kept count is rounded up to a
        multiple of it with zero-advantage rows (at most steps_per_generation - 1; they add nothing to the
        gradient). `num_items_in_batch` becomes the kept valid tokens of all processes.
        """
        if any(key in output for key in _MULTIMODAL_KEYS):
            raise ValueError("skip_zero_advantage does not support multimodal inputs (their image tensors are not "
                             "split per completion); turn it off")
        advantages = output["advantages"]
        informative = advantages.ne(0) if advantages.dim() == 1 else advantages.ne(0).any(dim=1)
        rows = informative.nonzero().flatten()
        spg, size = self.args.steps_per_generation, advantages.size(0)
        wanted = min(size, max(spg, math.ceil(rows.numel() / spg) * spg))
        if wanted > rows.numel():
            fillers = (~informative).nonzero().flatten()[: wanted - rows.numel()]
            rows = torch.cat([rows, fillers]).sort().values
        kept = {}
        for key, value in output.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == size:
                kept[key] = value[rows]
            elif isinstance(value, list) and len(value) == size:
                kept[key] = [value[i] for i in rows.tolist()]
            else:
                kept[key] = value
        sizes = torch.tensor([rows.numel(), size], dtype=torch.float, device=advantages.device)
        counts = torch.cat([_loss_mask(kept).sum().float().reshape(1), sizes])  # on device: one sync, after reduce
        tokens, n_kept, n_all = self.accelerator.reduce(counts, reduction="sum").tolist()
        kept["num_items_in_batch"] = torch.tensor(tokens, device=advantages.device)
        self._metrics["train"][names.KEPT_FRACTION].append(n_kept / max(n_all, 1.0))
        return kept

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.args.truncated_reward is not None:
            finished = {*self.eos_token_ids, self._tokenizer.pad_token_id}
            truncated = torch.tensor([len(ids) > 0 and ids[-1] not in finished for ids in completion_ids_list],
                                     device=rewards.device)
            rewards[self.accelerator.gather(truncated)] = self.args.truncated_reward  # TRL returns all processes'
        # Reward functions with a `metrics()` method (trustclip.rewards.CorrectnessReward) report cumulative
        # verifier counters; log their totals over processes (the first such function: they share a verifier).
        counters = next((f.metrics() for f in self.reward_funcs if callable(getattr(f, "metrics", None))), None)
        if counters:
            mode = "train" if self.model.training else "eval"
            keys = [k for k in (names.REWARD_TIMEOUTS, names.REWARD_ERRORS) if k in counters]
            local = torch.tensor([counters[k] for k in keys], dtype=torch.float32, device=self.accelerator.device)
            for key, total in zip(keys, self.accelerator.reduce(local, reduction="sum").tolist(), strict=True):
                self._metrics[mode][key].append(total)
        return rewards

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._buffered_inputs is not self._buffer_seen:
            self._buffer_seen = self._buffered_inputs
            self.count_slices(self._buffered_inputs)
        return inputs

    def count_slices(self, slices: list[dict[str, Any]]) -> None:
        """Record the valid tokens and the sequences of each slice of a new generation batch, summed over processes
        (one collective per generation); an optimizer step divides by the counts of its slices (`token_mean`:
        tokens; the sequence aggregations: sequences, which differ between processes with `skip_zero_advantage`)."""
        tokens = torch.stack([_loss_mask(b).sum() for b in slices]).float()  # stays on device: one sync, below
        sequences = torch.tensor([float(b["completion_ids"].size(0)) for b in slices], device=tokens.device)
        totals = self.accelerator.reduce(torch.stack([tokens, sequences], dim=1), reduction="sum")
        self._slice_counts = [tuple(c) for c in totals.tolist()]

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        # Defined here (not inherited) so that libraries patching GRPOTrainer.compute_loss (e.g. Unsloth, whose
        # version never calls _compute_loss) cannot silently bypass the objective.
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        return self._compute_loss(model, inputs)

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        mask = _loss_mask(inputs)
        logps, entropies, aux_loss, extras = self._policy_forward(model, inputs)
        has_tokens = bool(mask.any())
        # A micro-batch with no valid token (e.g. all completions truncated and masked) still runs the same
        # code and collectives, with one dummy token of weight 0, so the loss and gradient are exactly zero.
        safe_mask = mask if has_tokens else _one_token_mask(mask)
        weights, entropy_mask = self._token_weights(inputs, logps, entropies, mask)
        if not has_tokens:
            weights = torch.zeros_like(logps)
        out, batch = compute_token_loss(
            self.objective, logp=logps, old_logp=inputs.get("old_per_token_logps"), advantages=inputs["advantages"],
            mask=safe_mask, token_weights=weights, **extras,
        )
        per_token_loss = out.loss
        per_token_kl = None
        if self.beta != 0.0:
            per_token_kl = self._reference_kl(inputs, logps, batch)
            per_token_loss = per_token_loss + self.beta * per_token_kl * batch.mask * (1.0 if has_tokens else 0.0)
        loss = aggregate(per_token_loss, batch.mask, self.aggregation, max_len=self.max_len_normalizer,
                         **self._denominators(inputs, mode))
        # Per-micro-batch policy loss before the accumulation / process split (TRL's `policy_loss`).
        policy_loss = loss.detach() * self.accelerator.num_processes * self._accumulation(mode)
        values, tokens = self._log_objective_metrics(mode, out, batch, mask.to(logps.dtype), entropies, per_token_kl,
                                                     policy_loss)
        if self.delta_controller is not None and mode == "train":
            self._control_delta(values, tokens)
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
        input_ids, attention_mask = _prompt_and_completion(inputs)
        return self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, inputs["completion_ids"].size(1),
            **{k: inputs.get(k) for k in _MULTIMODAL_KEYS}, **kwargs,
        )

    def _policy_forward(self, model: Any, inputs: dict[str, Any]):
        """(logps, entropies, aux_loss, extras) of the current policy on the completions."""
        extras: dict[str, torch.Tensor] = {}
        if "full_kl" in self.objective.requires:
            old = {key: inputs[key] for key in self._old_keys()} if self._old_keys()[0] in inputs else None
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

    # ------------------------------------------------------------------ truly_ppo: the full-vocabulary KL
    def _old_keys(self) -> tuple[str, ...]:
        """Keys of what the generation batch keeps of pi_old per completion token (split per micro-batch by TRL)."""
        return _OLD_TOPK_KEYS if getattr(self.args, "full_kl_storage", "hidden") == "topk" else _OLD_HIDDEN_KEYS

    def _old_policy(self, output: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pi_old's log-probs of the completions and what the loss needs of its full distribution per position (no
        gradient; `full_kl_storage`), in the same micro-batch forwards as `_old_logps`. With the hidden states, pi_old's
        LM head is kept too: the live one when it is frozen (LoRA), else a frozen copy."""
        chunk = max(1, output["completion_ids"].size(0) // self.args.steps_per_generation)
        logps, stored = [], []
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for rows in _row_slices(output, chunk):
                logp, _, kept = self._full_vocab_forward(self.model, rows, keep=True)
                logps.append(logp)
                stored.append(kept)
        if self._old_keys() == _OLD_HIDDEN_KEYS:
            head = self._output_head(self.model)
            trains = any(p.requires_grad for p in head.parameters())
            self._old_heads["train" if self.model.training else "eval"] = (
                copy.deepcopy(head).requires_grad_(False) if trains else head)
        return torch.cat(logps), {key: torch.cat([s[key] for s in stored]) for key in self._old_keys()}

    def _full_vocab_forward(self, model: Any, inputs: dict[str, Any], *, old: dict[str, torch.Tensor] | None = None,
                            keep: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Per completion token, at the sampling temperature: log-prob, entropy, and a third item: with `old` (what
        `_old_policy` kept) KL(pi_old || pi) per token; with `keep` what to keep of this policy (a dict); else None.
        The LM head runs on chunks of positions under activation checkpointing, so no (B, T, V) tensor exists in the
        forward or the backward; pi_old's logits are recomputed per chunk from its hidden states (exact), or its
        top-k summary gives KL_k (`trustclip.objectives.topk_kl`)."""
        hidden, head = self._completion_hidden_states(model, inputs)
        batch, length = hidden.shape[:2]
        topk = self._old_keys() == _OLD_TOPK_KEYS
        k = getattr(self.args, "full_kl_topk", DEFAULT_TOPK)
        old_head = self._old_heads.get("train" if self.model.training else "eval")

        def score(h: torch.Tensor, target: torch.Tensor, *old_chunk: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logprobs = torch.log_softmax(head(h).float() / self.temperature, dim=-1)  # (chunk, V)
            logp = logprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)
            if not old_chunk:
                return (logp, entropy, *topk_logprobs(logprobs.detach(), k)) if keep and topk else (logp, entropy)
            if topk:  # KL_k from pi_old's top-k log-probs and tail mass
                indices, top, tail = old_chunk
                return logp, entropy, topk_kl(TopKLogProbs(indices.long(), top, tail), logprobs)
            with torch.no_grad():  # pi_old's logits from its final hidden states, through its LM head: the exact KL
                old_logprobs = torch.log_softmax(old_head(old_chunk[0]).float() / self.temperature, dim=-1)
            return logp, entropy, exact_kl(old_logprobs, logprobs)

        flat = [hidden, inputs["completion_ids"], *(old[key] for key in self._old_keys())] if old else [
            hidden, inputs["completion_ids"]]
        flat = [x.reshape(batch * length, *x.shape[2:]) for x in flat]
        chunk = max(1, _HEAD_CHUNK_ELEMENTS // head.weight.size(0))
        outputs = []
        for start in range(0, batch * length, chunk):
            args = [x[start:start + chunk] for x in flat]
            if torch.is_grad_enabled():  # recompute the chunk's logits in the backward instead of keeping them
                outputs.append(torch.utils.checkpoint.checkpoint(score, *args, use_reentrant=False))
            else:
                outputs.append(score(*args))
        logps, entropies, *rest = [torch.cat(c).reshape(batch, length, *c[0].shape[1:])
                                   for c in zip(*outputs, strict=True)]
        if keep and topk:
            return logps, entropies, dict(zip(_OLD_TOPK_KEYS, [rest[0].to(torch.int32), *rest[1:]], strict=True))
        if keep:
            return logps, entropies, {_OLD_HIDDEN_KEYS[0]: hidden.detach()}
        return logps, entropies, rest[0] if rest else None

    def _causal_lm(self, model: Any) -> Any:
        """The transformers model inside the accelerate / PEFT wrappers (PEFT injects its adapters in place)."""
        causal_lm = self.accelerator.unwrap_model(model)
        return causal_lm.get_base_model() if hasattr(causal_lm, "get_base_model") else causal_lm

    def _output_head(self, model: Any) -> Any:
        return self._causal_lm(model).get_output_embeddings()

    def _completion_hidden_states(self, model: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """The final hidden states that predict the completion tokens (B, T, H), and the LM head. The model is
        called as a whole (DDP / PEFT wrappers see their forward) with `logits_to_keep=1`; a hook on its backbone
        catches the hidden states."""
        causal_lm = self._causal_lm(model)
        config = causal_lm.config.get_text_config()
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
            raise ValueError("truly_ppo's chunked full-vocabulary KL supports plain LM heads (no logit softcapping or "
                             f"scaling); model {config.model_type!r} has them")
        captured: list[torch.Tensor] = []
        hook = causal_lm.base_model.register_forward_hook(lambda _module, _args, out: captured.append(out[0]))
        input_ids, attention_mask = _prompt_and_completion(inputs)
        try:
            with self.accelerator.autocast():
                model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False)
        finally:
            hook.remove()
        n = inputs["completion_ids"].size(1)
        return captured[-1][:, -n - 1:-1], causal_lm.get_output_embeddings()

    def _token_weights(self, inputs: dict[str, Any], logps: torch.Tensor, entropies: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Product of TRL's per-token gates (entropy mask, off-policy sequence mask, vLLM IS weights) or None,
        and the entropy mask alone (the entropy bonus acts on it, as in TRL)."""
        weights = entropy_mask = None

        def times(w: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
            x = x.to(logps.dtype).expand_as(logps)
            return x if w is None else w * x

        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile).to(mask.dtype)
            weights = times(weights, entropy_mask)
        if self.off_policy_mask_threshold is not None:
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            advantages = inputs["advantages"]
            opsm = self.get_off_policy_mask(
                advantages=advantages.unsqueeze(1) if advantages.dim() == 1 else advantages,
                per_token_logps=logps, sampling_per_token_logps=inputs.get("sampling_per_token_logps", old),
                mask=mask, off_policy_threshold=self.off_policy_mask_threshold,
            )
            weights = times(weights, opsm)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights = times(weights, inputs["importance_sampling_ratio"])
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

    def _denominators(self, inputs: dict[str, Any], mode: str) -> dict[str, float]:
        """Global denominators of this micro-batch's optimizer step, per process (DDP averages over processes)."""
        processes = self.accelerator.num_processes
        window = self._window_counts(mode)
        if window is None:  # eval (the whole batch), or a window spanning two generation batches: TRL's estimate
            share = self._accumulation(mode) / self.args.steps_per_generation if mode == "train" else 1.0
            window = (float(inputs["num_items_in_batch"]) * share,
                      inputs["completion_ids"].size(0) * self._accumulation(mode) * processes)  # equal micro-batches
        tokens, sequences = window
        if self.aggregation == "token_mean":
            return {"num_tokens": max(tokens, 1.0) / processes}
        return {"num_sequences": max(sequences, 1.0) / processes}

    def _window_counts(self, mode: str) -> tuple[float, float] | None:
        """(valid tokens, sequences) of the whole optimizer step, all processes, when the step's accumulation window
        lies inside one generation batch; else None."""
        ga, spg = self.current_gradient_accumulation_steps, self.args.steps_per_generation
        if (mode != "train" or not self._exact_window or self._slice_counts is None
                or ga != self.args.gradient_accumulation_steps):
            return None
        start = (self._step // ga) * ga
        window = [self._slice_counts[s % spg] for s in range(start, start + ga)]
        return sum(t for t, _ in window), sum(n for _, n in window)

    def _entropy_bonus(self, entropies: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor | float:
        """-coef * mean entropy over the tokens the loss acts on, with TRL's adaptive controller."""
        if not self._entropy_bonus_enabled:
            return 0.0
        mask = mask.to(entropies.dtype)
        entropy = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / self._accumulation(mode)
        if self.use_adaptive_entropy:
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
            if mode == "train":
                self._update_adaptive_entropy(entropies, mask)
        else:
            coef = self.entropy_coef
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return -coef * entropy

    def _update_adaptive_entropy(self, entropies: torch.Tensor, mask: torch.Tensor) -> None:
        stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
        self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
        if not self.accelerator.sync_gradients:
            return
        totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world = (totals[0] / totals[1].clamp(min=1.0)).item()
        step = self.args.entropy_coef_delta
        if world <= self.args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
        self._last_world_entropy = world
        self._entropy_window_stats = None

    # ------------------------------------------------------------------ adaptive delta
    def _control_delta(self, values: dict[str, float], tokens: float) -> None:
        """Feed the DeltaController this micro-batch's global statistic; at the last micro-batch of a generation
        batch, move delta from the token-weighted mean over the batch's off-policy micro-batches. Every process
        sees the same global values, so every process moves delta alike."""
        ga = self.args.gradient_accumulation_steps
        generate_every = self.args.steps_per_generation * self.num_iterations
        position = self._step % generate_every  # micro-batch index within this generation batch (TRL's counter)
        key = self.delta_controller.target
        self._metrics["train"][names.objective_name("delta")].append(self.delta_controller.delta)  # this update's
        if position >= ga:  # an optimizer step has passed since the batch was generated: the ratio measures it
            total, count = self._delta_window
            self._delta_window = (total + values[key] * tokens, count + tokens)
        if position == generate_every - 1:
            total, count = self._delta_window
            self._delta_window = (0.0, 0.0)
            if count > 0:
                self.delta_controller.update({key: total / count})
                self.objective = self.delta_controller.objective
                self._metrics["train"][names.objective_name(f"controller_{key}")].append(total / count)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Written with the optimizer, i.e. before trainer_state.json: a checkpoint complete enough to resume has it.
        super()._save_optimizer_and_scheduler(output_dir)
        if self.delta_controller is not None and self.args.should_save:
            write_json_atomic(Path(output_dir) / DELTA_CONTROLLER_FILE, self.delta_controller.state_dict())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.delta_controller is None or checkpoint is None:
            return
        path = Path(checkpoint) / DELTA_CONTROLLER_FILE
        if not path.is_file():
            raise ValueError(f"cannot resume {self.objective.name} from {checkpoint}: it has no "
                             f"{DELTA_CONTROLLER_FILE} (not written by an atr_adaptive run), so its delta is unknown")
        self.delta_controller.load_state_dict(json.loads(path.read_text()))
        self.objective = self.delta_controller.objective

    # ------------------------------------------------------------------ metrics
    def _log_objective_metrics(self, mode: str, out: TokenLoss, batch: PolicyBatch, mask: torch.Tensor,
                               entropies: torch.Tensor, per_token_kl: torch.Tensor | None,
                               policy_loss: torch.Tensor) -> tuple[dict[str, float], float]:
        """Token-weighted global means (two collectives): clip fractions, ratio, KL3, entropy, objective stats,
        and the policy loss (mean over processes). Returns them with the global number of valid tokens."""
        ratio = batch.ratio.detach()
        series = {
            "clip_frac_low": out.clipped_low,
            "clip_frac_high": out.clipped_high,
            "clip_frac": out.clipped_low | out.clipped_high,
            "offpolicy_frac": offpolicy_tokens(ratio),
            "ratio_mean": ratio,
            "kl3_mean": ratio - 1 - batch.log_ratio.detach(),
            names.ENTROPY: entropies.detach(),
        }
        if per_token_kl is not None:
            series[names.KL_REF] = per_token_kl.detach()
        scalars = {names.POLICY_LOSS: policy_loss}
        for key, value in out.stats.items():
            (series if value.dim() == 2 else scalars)[key] = value
        n_proc = self.accelerator.num_processes
        local = [(x.to(mask.dtype) * mask).sum() for x in series.values()]
        local += [s.detach().to(mask.dtype).reshape(()) / n_proc for s in scalars.values()] + [mask.sum()]
        totals = self.accelerator.reduce(torch.stack(local), reduction="sum").tolist()
        count = max(totals[-1], 1.0)
        valid = mask > 0
        extremes = torch.stack([
            torch.where(valid, ratio, torch.full_like(ratio, -float("inf"))).max(),
            -torch.where(valid, ratio, torch.full_like(ratio, float("inf"))).min(),
        ])
        ratio_max, neg_min = self.accelerator.gather(extremes).view(-1, 2).max(dim=0).values.tolist()
        values = {key: totals[i] / count for i, key in enumerate(series)}
        values |= {key: totals[len(series) + i] for i, key in enumerate(scalars)}
        values |= {"ratio_max": ratio_max, "ratio_min": -neg_min}
        for key, value in values.items():
            if key in (names.ENTROPY, names.KL_REF, names.POLICY_LOSS):
                self._metrics[mode][key].append(value)
                continue
            for name in names.logged_names(key):
                self._metrics[mode][name].append(value)
        return values, totals[-1]


def _prompt_and_completion(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of prompt and completion side by side, as the policy reads them."""
    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1))


_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


def _row_slices(inputs: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """`inputs` cut into consecutive slices of `size` completions (the tensors the forward reads)."""
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    total = inputs["completion_ids"].size(0)
    return [{key: inputs[key][start:start + size] for key in keys} for start in range(0, total, size)]


def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def _one_token_mask(mask: torch.Tensor) -> torch.Tensor:
    dummy = torch.zeros_like(mask)
    dummy[0, 0] = 1
    return dummy
