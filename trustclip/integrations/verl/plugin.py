"""trustclip objectives as verl policy losses (tested with verl 0.9.1; usage in docs/verl.md).

Importing this module registers every trustclip objective (and alias) in verl's policy-loss registry as
`trustclip_<name>` (e.g. `trustclip_kl3`). verl imports it in every process at `import verl` through the
`verl.plugins` entry point of the installed package (fallback: `VERL_USE_EXTERNAL_MODULES=<this module>`). Each loss
follows verl's contract: the signature of `compute_policy_loss_vanilla`, the per-token loss times
`rollout_is_weights`, verl's own `agg_loss(..., **config.global_batch_info)`, metrics as plain floats
(`verl_metrics`).

verl swallows plugin import errors at DEBUG level (a broken plugin shows up only as "Unsupported loss mode"), so any
failure here is logged at ERROR level before it is re-raised. `python -m trustclip.integrations.verl.plugin` prints
how many losses are registered and whether `import verl` found the plugin.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

_log = logging.getLogger(__name__)
_FAILED = ("trustclip verl plugin: %s failed (%s: %s); verl will report the trustclip_* losses as "
           "'Unsupported loss mode'.")

try:  # verl logs plugin import errors only at DEBUG: make them visible first
    import torch

    from trustclip.metric_names import VERL_NAMES, objective_name
    from trustclip.objectives import REGISTRY, Objective, PolicyBatch, TokenLoss, compute_token_loss, get_objective
    from trustclip.objectives.adaptive import carries_controller
    from trustclip.objectives.fused import DEFAULT_FUSED
    from trustclip.objectives.registry import ALIASES
    from trustclip.objectives.statistics import reduce_statistics, token_statistics
except Exception as _err:
    _log.error(_FAILED, "importing its dependencies", type(_err).__name__, _err, exc_info=True)
    raise

PREFIX = "trustclip_"
TESTED_VERL_VERSION = "0.9.1"
NO_VERL = (
    "trustclip's verl plugin needs verl, which is not installed in this environment. verl 0.9.1 pins "
    "transformers<5.11, so install it in its own virtual environment: "
    "python -m venv .venv-verl && .venv-verl/bin/pip install -e '.[verl]' (from a trustclip checkout; see docs/verl.md)"
)
# verl's actor / policy_loss knobs that trustclip losses do not read, with verl 0.9.1's defaults.
VERL_KNOBS = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
              "tau_pos": 1.0, "tau_neg": 1.05}
VERL_POLICY_LOSS_KNOBS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0,
                          "kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}
SEQUENCE_LEVEL = ("gspo", "atr_seq", "sapo")  # their papers (and verl's sapo) aggregate seq-mean-token-mean

_warned: set[str] = set()


class VerlPluginError(RuntimeError):
    """The plugin cannot register or run a trustclip loss in verl."""


def verl_installed() -> bool:
    """Whether the real verl package is importable (a namespace directory named `verl` does not count)."""
    spec = importlib.util.find_spec("verl")
    return spec is not None and spec.origin not in (None, "namespace")


def verl_loss_names() -> dict[str, str]:
    """verl loss name -> trustclip objective name, for every objective and alias (`trustclip_<name>`)."""
    names = {PREFIX + name: name for name in REGISTRY} | {PREFIX + alias: name for alias, name in ALIASES.items()}
    return dict(sorted(names.items()))


def _get(config: Any, key: str, default: Any = None) -> Any:
    """`config.key` for verl dataclass configs, OmegaConf DictConfigs and plain dicts alike (None: `default`)."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def normalize_kwargs(value: Any) -> dict[str, Any]:
    """`objective_kwargs` as a plain dict: a dict / DictConfig, a JSON object string, or None (-> {})."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"policy_loss.objective_kwargs={value!r} is not a JSON object: {err}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"policy_loss.objective_kwargs must be a mapping, got {type(value).__name__}")
    from omegaconf import DictConfig, OmegaConf  # ships with verl

    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    return {str(k): v for k, v in value.items()}


def build_objective(loss_mode: str, objective_kwargs: Any = None) -> Objective:
    """The trustclip objective of a verl loss mode with `objective_kwargs` over trustclip's defaults; ValueError when
    verl's policy-loss interface cannot feed it."""
    names = verl_loss_names()
    if loss_mode not in names:
        raise ValueError(f"{loss_mode!r} is not a trustclip loss mode; valid: {', '.join(names)}")
    try:
        objective = get_objective(names[loss_mode], **normalize_kwargs(objective_kwargs))
    except ValueError as err:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.objective_kwargs for {loss_mode}: {err}") from None
    if objective.requires:
        raise ValueError(
            f"{loss_mode} needs the per-token input(s) {list(objective.requires)}, which verl's policy-loss "
            "interface does not provide (verl passes only log-probs, advantages, the response mask and rollout "
            "IS weights). Use it through trustclip's TRL trainer, or pick another objective."
        )
    if carries_controller(objective):
        raise ValueError(f"{loss_mode} adapts delta between updates with a controller that needs the statistics of "
                         "whole updates, one value shared by every worker, and a place in the checkpoints; verl calls "
                         "a policy loss per micro-batch on each worker, with no step boundary and no checkpoint hook. "
                         "Use it through trustclip's TRL trainer, or trustclip_kl3 with a fixed delta.")
    return objective


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _log.warning(message)


def check_settings(objective: Objective, loss_mode: str, loss_agg_mode: str, config: Any) -> list[str]:
    """Warnings (empty if none) about verl settings: trustclip's defaults used for want of objective_kwargs, verl knobs
    a trustclip loss ignores, and settings that change its meaning."""
    notes = []
    policy_loss = _get(config, "policy_loss")
    if config is not None and _get(policy_loss, "objective_kwargs") is None:
        notes.append(
            f"{loss_mode}: actor.policy_loss is not a TrustclipPolicyLossConfig, so trustclip's default "
            f"hyper-parameters are used. Set actor_rollout_ref.actor.policy_loss._target_="
            "trustclip.integrations.verl.config.TrustclipPolicyLossConfig and "
            "+actor_rollout_ref.actor.policy_loss.objective_kwargs={...} to choose them."
        )
    ignored = [k for k, v in VERL_KNOBS.items() if _get(config, k, v) != v]
    ignored += [f"policy_loss.{k}" for k, v in VERL_POLICY_LOSS_KNOBS.items() if _get(policy_loss, k, v) != v]
    if ignored:
        notes.append(
            f"{loss_mode} ignores actor.{', actor.'.join(ignored)} (verl's own knobs); trustclip hyper-parameters "
            "come only from actor_rollout_ref.actor.policy_loss.objective_kwargs"
        )
    if objective.name in SEQUENCE_LEVEL and loss_agg_mode != "seq-mean-token-mean":
        notes.append(
            f"{loss_mode} aggregates with actor.loss_agg_mode={loss_agg_mode} as configured; its paper (and verl's "
            "own sapo, which forces it) uses seq-mean-token-mean"
        )
    if loss_agg_mode == "seq-mean-token-sum-norm" and _global_batch_info(config).get("loss_scale_factor") is None:
        notes.append(
            f"{loss_mode}: loss_agg_mode=seq-mean-token-sum-norm without actor.loss_scale_factor divides by the "
            "padded length of each micro-batch, which is not a constant; set "
            "actor_rollout_ref.actor.loss_scale_factor=<data.max_response_length> for Dr.GRPO's constant L_max"
        )
    return notes


def verl_metrics(out: TokenLoss, batch: PolicyBatch) -> dict[str, float]:
    """verl's three policy metrics with verl's meaning, then trustclip's as `actor/objective/<key>`.

    `actor/pg_clipfrac`: tokens whose gradient the ratio clip removed (either side); `actor/ppo_kl`: mean
    of -log w (k1 of KL(pi_old || pi)); `actor/pg_clipfrac_lower`: tokens hit by the dual clip (A < 0,
    w > c), 0 for objectives without one, as in verl's losses.
    """
    stats = token_statistics(out, batch)
    stats.means["actor/ppo_kl"] = -batch.log_ratio.detach()  # verl's own, not an objective metric
    metrics, _ = reduce_statistics(stats, batch.mask)  # this micro-batch's means: verl averages the micro-batches
    ppo_kl = metrics.pop("actor/ppo_kl")
    verl = {name: metrics.get(key, 0.0) for key, name in VERL_NAMES.items()} | {"actor/ppo_kl": ppo_kl}
    return verl | {"actor/" + objective_name(key): value for key, value in metrics.items()}


def _global_batch_info(config: Any) -> dict[str, Any]:
    return dict(_get(config, "global_batch_info", None) or {})


def compute_trustclip_loss(loss_mode: str, old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                           rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """verl policy loss of the trustclip objective behind `loss_mode` (see the module docstring)."""
    policy_loss = _get(config, "policy_loss")
    objective = build_objective(loss_mode, _get(policy_loss, "objective_kwargs"))
    for note in check_settings(objective, loss_mode, loss_agg_mode, config):
        _warn_once(note)
    from verl.trainer.ppo.core_algos import agg_loss  # (importing this module checked that verl is installed)

    mask = response_mask.bool()
    if not mask.any():  # e.g. every response of the micro-batch rejected by rollout correction
        return (log_prob * 0.0).sum(), {"actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/pg_clipfrac_lower": 0.0}
    out, batch = compute_token_loss(
        objective, logp=log_prob, old_logp=old_log_prob, advantages=advantages, mask=mask,
        token_weights=rollout_is_weights, fused=_get(policy_loss, "fused", DEFAULT_FUSED),
    )
    loss = agg_loss(loss_mat=out.loss, loss_mask=mask, loss_agg_mode=loss_agg_mode, **_global_batch_info(config))
    return loss, verl_metrics(out, batch)


def register_verl_losses() -> list[str]:
    """Register every trustclip objective (and alias) in verl's registry, warning once on an untested verl version;
    returns the names. Idempotent: call it again after `trustclip.register_objective` to add new objectives. Raises
    VerlPluginError rather than overwrite a loss of the same name that is not trustclip's."""
    import verl
    from verl.trainer.ppo import core_algos

    if (version := getattr(verl, "__version__", "unknown")) != TESTED_VERL_VERSION:
        _warn_once(f"trustclip's verl plugin was tested with verl {TESTED_VERL_VERSION}; this is verl {version}")
    registry = core_algos.POLICY_LOSS_REGISTRY
    names = verl_loss_names()
    for loss_mode, objective in names.items():
        existing = registry.get(loss_mode)
        if existing is not None and not hasattr(existing, "trustclip_objective"):
            raise VerlPluginError(
                f"verl already has a policy loss named {loss_mode!r} ({existing.__module__}."
                f"{existing.__qualname__}); trustclip will not overwrite it"
            )
        policy_loss = functools.partial(compute_trustclip_loss, loss_mode)  # verl passes the rest by keyword
        policy_loss.trustclip_objective = objective  # type: ignore[attr-defined]
        core_algos.register_policy_loss(loss_mode)(policy_loss)
    return list(names)


if not verl_installed():
    raise ImportError(NO_VERL)
try:  # registered at import; verl logs plugin errors only at DEBUG: make them visible first
    register_verl_losses()
except Exception as _err:
    _log.error(_FAILED, "registering the losses", type(_err).__name__, _err, exc_info=True)
    raise


def main() -> int:
    """Print how many trustclip losses verl has, and whether `import verl` loaded this plugin (its entry point)."""
    from verl.trainer.ppo import core_algos

    names = verl_loss_names()
    registered = sum(name in core_algos.POLICY_LOSS_REGISTRY for name in names)
    discovered = "trustclip.integrations.verl.plugin" in sys.modules  # imported by `import verl`, not as __main__
    verdict = "loaded the plugin" if discovered else (
        "did NOT load the plugin: check VERL_USE_EXTERNAL_PLUGINS, VERL_USE_EXTERNAL_MODULES and the install")
    print(f"{registered} of {len(names)} trustclip losses registered; `import verl` {verdict}")
    return 0 if registered == len(names) and discovered else 1


if __name__ == "__main__":
    raise SystemExit(main())
