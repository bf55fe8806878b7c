"""`TrustclipPolicyLossConfig`: verl's `PolicyLossConfig` plus the hyper-parameters of a trustclip loss, selected with
Hydra's `_target_` (verl instantiates it in every actor worker; docs/verl.md):

    actor_rollout_ref.actor.policy_loss._target_=trustclip.integrations.verl.config.TrustclipPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=trustclip_kl3
    +actor_rollout_ref.actor.policy_loss.objective_kwargs={delta:0.07}

verl's own knobs (`actor.clip_ratio*`, `policy_loss.clip_cov_*`, ...) keep serving verl's losses only. Importing this
module (Hydra does) registers the trustclip losses, so a broken install fails here, loudly, rather than later as
"Unsupported loss mode".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trustclip.integrations.verl.plugin import NO_VERL, PREFIX, build_objective, normalize_kwargs, verl_installed
from trustclip.objectives.fused import DEFAULT_FUSED, fused_backend

if not verl_installed():  # (importing the plugin already raises this; kept so the order cannot be "fixed")
    raise ImportError(NO_VERL)

from verl.workers.config import PolicyLossConfig  # noqa: E402


@dataclass
class TrustclipPolicyLossConfig(PolicyLossConfig):
    """verl `PolicyLossConfig` with `objective_kwargs`, the hyper-parameters of a `trustclip_*` loss mode.

    Args:
        objective_kwargs (dict): hyper-parameters of the objective behind `loss_mode` under trustclip's names (or a
            JSON object string), e.g. `{"delta": 0.07}` for `trustclip_kl3`; omitted ones take trustclip's defaults.
            Checked when the config is built; only `trustclip_*` loss modes read it, so it must be empty otherwise.
        fused (bool): compute the per-token loss as one torch.compile'd graph (`trustclip.objectives.fused`): fewer
            kernel launches, the same loss and gradient to float rounding; each worker compiles it on its first call.
            An objective without a fused path (clip_cov, kl_cov), or a loss mode that is not trustclip's, is refused
            when the config is built.
    """

    objective_kwargs: dict[str, Any] = field(default_factory=dict)
    fused: bool = DEFAULT_FUSED

    def __post_init__(self) -> None:
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:  # none in verl 0.9.1; keep any later verl validation
            parent_post_init()
        kwargs = normalize_kwargs(self.objective_kwargs)
        object.__setattr__(self, "objective_kwargs", kwargs)  # BaseConfig fields are frozen once set
        if self.loss_mode.startswith(PREFIX):
            objective = build_objective(self.loss_mode, kwargs)  # ValueError naming the bad key / value / mode
            fused_backend(self.fused, objective, "policy_loss.fused")
        elif kwargs or self.fused != DEFAULT_FUSED:
            name, value = ("objective_kwargs", kwargs) if kwargs else ("fused", self.fused)
            bypass = (" (verl switches loss_mode to bypass_mode when algorithm.rollout_correction.bypass_mode="
                      "true, replacing the configured loss)") if self.loss_mode == "bypass_mode" else ""
            raise ValueError(
                f"policy_loss.{name}={value} is only read by trustclip_* loss modes, but "
                f"loss_mode={self.loss_mode!r}{bypass}; set loss_mode=trustclip_<objective> or drop {name}"
            )
