"""Shared inputs and configs for the verl plugin tests (imported only where verl is installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from verl.workers.config import ActorConfig, PolicyLossConfig

from trustclip.integrations.verl.config import TrustclipPolicyLossConfig

PLUGIN_ENV = ("VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# Local aggregation (no global info, as in a single-process unit test) and verl's trainer path on 2 DP ranks.
BATCH_INFOS = {
    "local": {},
    "global": {"dp_size": 2, "batch_num_tokens": 97, "global_batch_size": 14, "loss_scale_factor": 16},
}


@dataclass
class Inputs:
    """verl policy-loss inputs, (B, T) float64; `log_prob` is a leaf that requires grad."""

    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    rollout_is_weights: torch.Tensor | None

    def args(self) -> dict[str, Any]:
        return {"old_log_prob": self.old_log_prob, "log_prob": self.log_prob, "advantages": self.advantages,
                "response_mask": self.response_mask, "rollout_is_weights": self.rollout_is_weights}


def make_inputs(seed: int = 0, batch: int = 7, length: int = 12, weights: bool = False) -> Inputs:
    """Right-padded responses of random lengths (>= 1), log-ratios ~ N(0, 0.6^2) plus planted extremes:
    a low-side and a high-side ratio clip, and a dual-clip token (A < 0, w = 4.5 > c = 3)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    mask = torch.arange(length) < lengths[:, None]
    old = -3 * torch.rand(batch, length, generator=gen, dtype=torch.float64)
    log_ratio = 0.6 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = 1.5 * torch.randn(batch, 1, generator=gen, dtype=torch.float64)
    adv[0], adv[1], adv[2] = -1.3, 1.0, -0.7
    log_ratio[0, 0], log_ratio[1, 0], log_ratio[2, 0] = 1.5, 0.9, -0.9
    old = torch.where(mask, old - log_ratio.clamp(min=0), torch.zeros_like(old))  # keep log_prob <= 0
    log_prob = torch.where(mask, old + log_ratio, torch.zeros_like(old)).requires_grad_()
    advantages = (adv * mask).expand(batch, length).clone()
    is_weights = None
    if weights:
        is_weights = torch.where(mask, 0.5 + torch.rand(batch, length, generator=gen, dtype=torch.float64),
                                 torch.zeros_like(old))
    return Inputs(old, log_prob, advantages, mask, is_weights)


def actor_config(policy_loss: PolicyLossConfig, info: dict | None = None, **actor: Any) -> ActorConfig:
    """A minimal `ActorConfig` as verl's own CPU tests build it, with `global_batch_info` filled in."""
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss,
                       global_batch_info=dict(info or {}), **actor)


def trustclip_config(loss_mode: str, info: dict | None = None, **objective_kwargs: Any) -> ActorConfig:
    return actor_config(TrustclipPolicyLossConfig(loss_mode=loss_mode, objective_kwargs=objective_kwargs), info)


def reference_aggregation(loss_agg_mode: str, info: dict, length: int) -> dict[str, Any]:
    """trustclip `compute_policy_loss` aggregation arguments equal to verl's `agg_loss` with `info`.

    verl scales every mode by dp_size (FSDP then averages the ranks), i.e. divides by the per-rank share
    of the global count: the global count with num_processes = dp_size; token-sum is a sum of sequence sums
    (num_sequences 1); seq-mean-token-sum-norm is Dr.GRPO with L_max = loss_scale_factor (default: the padded
    width).
    """
    dp = info.get("dp_size", 1)
    seqs = info.get("global_batch_size")
    if loss_agg_mode == "token-mean":
        return {"aggregation": "token_mean", "num_tokens": info.get("batch_num_tokens"), "num_processes": dp}
    if loss_agg_mode == "token-sum":
        return {"aggregation": "seq_mean_token_sum", "num_sequences": 1, "num_processes": dp}
    if loss_agg_mode == "seq-mean-token-sum-norm":
        max_len = info.get("loss_scale_factor") or length
        return {"aggregation": "dr_grpo", "max_len": max_len, "num_sequences": seqs, "num_processes": dp}
    return {"aggregation": loss_agg_mode.replace("-", "_"), "num_sequences": seqs, "num_processes": dp}


def grad(loss: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, inputs.log_prob)
    return g


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12)


def run_fresh(scripts: dict[str, tuple[str, dict[str, str]]], cwd: Path, timeout: float = 300) -> dict:
    """Run each `(code, env)` in a fresh interpreter of this environment, all at once (verl's import takes
    ~10 s of CPU each); returns name -> CompletedProcess. They run outside the repository, so the installed
    trustclip and its entry point are what verl sees; `env` overrides the plugin variables, unset otherwise."""
    base = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
    base.update(RAY_USAGE_STATS_ENABLED="0", PYTHONWARNINGS="ignore")
    procs = {name: subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env={**base, **env}, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (code, env) in scripts.items()}
    results = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=timeout)
            results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results
