"""verl 0.9.1's own actor update with a trustclip loss, on CPU: one rank, and two FSDP2 ranks over gloo.

Each run is real verl (`actor_update_rank.py`, one process per rank): `ActorRolloutRefWorker.init_model` ->
`compute_log_prob` -> `update_actor` -> FSDP2 engine `train_batch` -> `workers/utils/losses.py:ppo_loss` ->
`get_policy_loss_fn("trustclip_kl3")`, on a tiny Qwen3 built here. The CPU shims are test fixtures
(`verl_cpu.py`). What verl logs and the step it takes are compared with trustclip computed here, independently:
the loss and metrics with `compute_policy_loss` on the same batch and old log-probs, the step with the gradient of
that loss through a plain transformers forward of each sequence.

All three runs (1 rank with delta 0.07 and 0.3, 2 ranks with delta 0.07) start at once; ~25 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM
from verl_testkit import PLUGIN_ENV

from trustclip import compute_policy_loss, get_objective
from trustclip.models import build_tiny_model

RANK_SCRIPT = Path(__file__).with_name("actor_update_rank.py")
MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16,
         "intermediate_size": 64}
BATCH, PROMPT, RESPONSE, MICRO = 8, 4, 8, 2
LR = 1.0
COMMON = [
    "actor_rollout_ref.rollout.n=1",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",  # one optimizer step on the whole batch ...
    f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",  # ... accumulated over micro-batches of 2
    f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO}",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.entropy_coeff=0",
    # fp32 throughout, so that verl's numbers meet trustclip's to float tolerance (verl's default computes in bf16)
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
    # plain SGD without clipping: the change of every parameter is -LR times the gradient verl applied
    "actor_rollout_ref.actor.optim.optimizer=SGD",
    f"actor_rollout_ref.actor.optim.lr={LR}",
    "actor_rollout_ref.actor.optim.weight_decay=0",
    "actor_rollout_ref.actor.optim.clip_grad=1e9",
    "actor_rollout_ref.actor.policy_loss._target_=trustclip.integrations.verl.config.TrustclipPolicyLossConfig",
    "actor_rollout_ref.actor.policy_loss.loss_mode=trustclip_kl3",
]


def kl3(delta: float) -> list[str]:
    return [*COMMON, f"+actor_rollout_ref.actor.policy_loss.objective_kwargs={{delta:{delta}}}"]


DELTAS = {"delta_0.07": 0.07, "delta_0.3": 0.3}
RUNS = {"one_rank": (1, {"delta_0.07": kl3(0.07), "delta_0.3": kl3(0.3)}),
        "two_ranks": (2, {"delta_0.07": kl3(0.07)})}
CASES = [(run, case) for run, (_, cases) in RUNS.items() for case in cases]


def make_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A rollout batch as verl's trainer holds it: left-padded prompts, right-padded responses of random lengths,
    one advantage per sequence, and the offsets of the old log-probs from the current policy's (~N(0, 0.4^2))."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, PROMPT + 1, (BATCH,), generator=gen)
    response_lens = torch.randint(1, RESPONSE + 1, (BATCH,), generator=gen)
    response_lens[0] = RESPONSE
    prompt_mask = torch.arange(PROMPT) >= PROMPT - prompt_lens[:, None]
    response_mask = torch.arange(RESPONSE) < response_lens[:, None]
    prompts = torch.randint(1, vocab_size, (BATCH, PROMPT), generator=gen) * prompt_mask
    responses = torch.randint(1, vocab_size, (BATCH, RESPONSE), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1).long()
    return {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": response_mask.long(),
        "advantages": torch.randn(BATCH, 1, generator=gen) * response_mask,
        "old_offsets": 0.4 * torch.randn(BATCH, RESPONSE, generator=gen) * response_mask,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_ranks(world_size: int, spec: Path, out: Path) -> list[tuple[subprocess.Popen, Path]]:
    """One process per rank with the environment torchrun would give it; output to a log file per rank."""
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               RAY_USAGE_STATS_ENABLED="0")
    procs = []
    for rank in range(world_size):
        log = out / f"rank{rank}.log"
        with log.open("w") as handle:
            procs.append((subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(spec)], cwd=out, stdout=handle,
                                           stderr=subprocess.STDOUT,
                                           env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)}), log))
    return procs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("actor_update")
    model = build_tiny_model(root / "model", **MODEL)
    batch = make_batch(AutoConfig.from_pretrained(model).vocab_size)
    torch.save(batch, root / "batch.pt")
    started = {}
    for name, (world_size, cases) in RUNS.items():
        out = root / name
        out.mkdir()
        spec = {"model": str(model), "batch": str(root / "batch.pt"), "out": str(out), "cases": cases}
        (out / "spec.json").write_text(json.dumps(spec))
        started[name] = start_ranks(world_size, out / "spec.json", out)
    try:
        for procs in started.values():
            for proc, log in procs:
                assert proc.wait(timeout=400) == 0, f"{log}:\n{log.read_text()[-4000:]}"
    finally:
        for procs in started.values():
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    results = {name: [torch.load(root / name / f"rank{rank}.pt") for rank in range(world_size)]
               for name, (world_size, _) in RUNS.items()}
    return {"model": model, "batch": batch, **results}


# --------------------------------------------------------------------------- trustclip, computed here
def whole_batch(ranks: list[dict], case: str, key: str) -> torch.Tensor:
    """`key` of every rank's rows, in batch order."""
    return torch.cat([rank[case][key] for rank in sorted(ranks, key=lambda r: r[case]["rows"])])


def trustclip_loss(delta: float, logp: torch.Tensor, old_logp: torch.Tensor, batch: dict, rows=slice(None)):
    """trustclip's kl3 loss with verl's `token-mean` over `rows` (the global mean over the whole batch)."""
    return compute_policy_loss(get_objective("kl3", delta=delta), logp=logp[rows], old_logp=old_logp[rows],
                               advantages=batch["advantages"][rows], mask=batch["response_mask"][rows].bool(),
                               aggregation="token_mean")


def expected_metrics(delta: float, logp: torch.Tensor, old_logp: torch.Tensor, batch: dict) -> dict[str, float]:
    """What verl logs for a trustclip loss: each metric averaged over the micro-batches (on every rank)."""
    per_micro = []
    for start in range(0, BATCH, MICRO):
        rows = slice(start, start + MICRO)
        _, metrics = trustclip_loss(delta, logp, old_logp, batch, rows)
        mask = batch["response_mask"][rows].bool()
        ppo_kl = float((old_logp[rows] - logp[rows])[mask].mean())
        per_micro.append({"actor/pg_clipfrac": metrics["clip_frac"], "actor/pg_clipfrac_lower": 0.0,
                          "actor/ppo_kl": ppo_kl} | {f"actor/objective/{k}": v for k, v in metrics.items()})
    return {key: float(np.mean([m[key] for m in per_micro])) for key in per_micro[0]}


def sequence_log_probs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """(B, RESPONSE) log-probs of the responses, each sequence through the model alone (no padding, no packing)."""
    rows = []
    for i in range(BATCH):
        prompt = batch["prompts"][i][batch["attention_mask"][i, :PROMPT].bool()]
        response = batch["responses"][i][batch["response_mask"][i].bool()]
        ids = torch.cat([prompt, response])
        logits = model(input_ids=ids[None]).logits[0, -len(response) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, response[:, None])[:, 0]
        rows.append(F.pad(logp, (0, RESPONSE - len(response))))
    return torch.stack(rows)


def reference_step(model_path: Path, batch: dict, old_logp: torch.Tensor, delta: float):
    """Log-probs and the gradient of trustclip's loss, with transformers and torch only."""
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa", dtype=torch.float32)
    logp = sequence_log_probs(model, batch)
    loss, _ = trustclip_loss(delta, logp, old_logp, batch)
    loss.backward()
    return logp.detach(), {name: p.grad for name, p in model.named_parameters()}


def logged(result: dict) -> dict[str, float]:
    """verl's metrics of the update (one mini-batch: one value each)."""
    assert all(len(values) == 1 for values in result["metrics"].values())
    return {key: values[0] for key, values in result["metrics"].items()}


def applied_gradient(result: dict) -> dict[str, torch.Tensor]:
    return {name: (result["before"][name] - result["after"][name]) / LR for name in result["before"]}


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("run, case", CASES)
def test_verl_logs_trustclips_loss_and_metrics(runs, run: str, case: str) -> None:
    """verl's `actor/pg_loss`, `loss`, `actor/pg_clipfrac`, `actor/ppo_kl` and every `actor/objective/*` equal
    trustclip's `compute_policy_loss` on verl's log-probs and the old log-probs verl was given."""
    ranks, batch = runs[run], runs["batch"]
    logp, old_logp = whole_batch(ranks, case, "log_probs"), whole_batch(ranks, case, "old_log_probs")
    loss, _ = trustclip_loss(DELTAS[case], logp.double(), old_logp.double(), batch)
    expected = {"actor/pg_loss": loss.item(), "loss": loss.item()}
    expected |= expected_metrics(DELTAS[case], logp.double(), old_logp.double(), batch)
    metrics = logged(ranks[0][case])
    assert set(expected) <= set(metrics)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert 0 < metrics["actor/pg_clipfrac"] < 1


@pytest.mark.parametrize("run", list(RUNS))
def test_verl_steps_along_the_gradient_of_trustclips_loss(runs, run: str) -> None:
    """The parameters move by -lr x the gradient of trustclip's loss, computed here through transformers; verl's
    log-probs (packed sequences, FSDP2) equal those of each sequence alone."""
    ranks, batch = runs[run], runs["batch"]
    logp, grads = reference_step(runs["model"], batch, whole_batch(ranks, "delta_0.07", "old_log_probs"), 0.07)
    torch.testing.assert_close(whole_batch(ranks, "delta_0.07", "log_probs"), logp, rtol=1e-5, atol=1e-5)
    applied = applied_gradient(ranks[0]["delta_0.07"])
    assert applied.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(applied[name], grad, rtol=1e-3, atol=2e-6, msg=name)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert logged(ranks[0]["delta_0.07"])["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    assert norm > 1e-2  # the step is not trivially zero


def test_objective_kwargs_reach_the_loss(runs) -> None:
    """The same batch and model with delta 0.07 and 0.3: the wider region clips fewer tokens, and the steps differ."""
    narrow, wide = runs["one_rank"][0]["delta_0.07"], runs["one_rank"][0]["delta_0.3"]
    torch.testing.assert_close(narrow["log_probs"], wide["log_probs"], rtol=0, atol=0)
    assert logged(wide)["actor/pg_clipfrac"] < logged(narrow)["actor/pg_clipfrac"]
    assert logged(wide)["actor/objective/kl3_mean"] == logged(narrow)["actor/objective/kl3_mean"]  # same ratios
    assert any(not torch.allclose(narrow["after"][k], wide["after"][k], rtol=1e-4, atol=1e-6) for k in narrow["after"])


def test_two_ranks_each_holding_half_the_batch_equal_one_rank_holding_all(runs) -> None:
    one, two = runs["one_rank"], runs["two_ranks"]
    assert [r["delta_0.07"]["rows"] for r in two] == [(0, BATCH // 2), (BATCH // 2, BATCH)]
    assert one[0]["delta_0.07"]["rows"] == (0, BATCH)
    torch.testing.assert_close(whole_batch(two, "delta_0.07", "log_probs"), one[0]["delta_0.07"]["log_probs"],
                               rtol=1e-5, atol=1e-6)
    one_metrics, two_metrics = logged(one[0]["delta_0.07"]), logged(two[0]["delta_0.07"])
    for key in ("loss", "actor/pg_loss", "actor/pg_clipfrac", "grad_norm", "actor/objective/kl3_mean"):
        assert two_metrics[key] == pytest.approx(one_metrics[key], rel=1e-5, abs=1e-7), key
    for name, grad in applied_gradient(one[0]["delta_0.07"]).items():
        for rank in two:  # both ranks hold the same (gathered) parameters after the step
            torch.testing.assert_close(applied_gradient(rank["delta_0.07"])[name], grad, rtol=1e-4, atol=1e-6,
                                       msg=name)
