"""The fused path (trustclip.objectives.fused): `compute_policy_loss(..., fused=...)` and `compute_token_loss` give the
eager path's loss, gradient and metrics to float rounding, as one compiled graph that a new length does not recompile.

Compiling is slow on a CPU (inductor: seconds per graph, a C++ compiler each time), so each fusable objective is
compiled once with inductor, on a small float32 batch (then reused at a second length), and two in float64 as well;
the tests of the aggregations, counts and shapes use the aot_eager backend (dynamo's graph capture and AOTAutograd,
where fusing can fail, without code generation).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters  # dynamo's own count of the graphs it compiled

import trustclip as tc
from trustclip.objectives import REGISTRY, compute_token_loss, get_objective
from trustclip.objectives.constraints import DivergenceConstraint
from trustclip.objectives.fused import UNFUSABLE, clear_compiled

CAPTURE = "aot_eager"  # the graph without generated code: fast, and where fusing can fail
# Non-default settings that change what the graph holds: a dual clip on dcpo, a constraint that is not an interval,
# the entropy split (a quantile per response), truly_ppo's other mode, kl1's two sides.
VARIANTS = {
    "general": {"constraint": DivergenceConstraint("w*kl3", lambda w: w * (w - 1 - w.log()), 0.05)},
    "dcpo+dual": {"clip_ratio_c": 10.0},
    "is_kl3+w_times_kl3": {"form": "w_times_kl3", "delta": 0.05},
    "aspo+entropy_split": {"entropy_split": True},
    "truly_ppo+stop_gradient": {"mode": "stop_gradient"},
    "kl1+two_sided": {"two_sided": True},
}
FUSABLE = sorted({*REGISTRY, *VARIANTS} - set(UNFUSABLE))


def objective_of(case: str):
    name = case.split("+")[0]
    return get_objective(name, **VARIANTS.get(case, {}))


def random_inputs(seed: int, dtype: torch.dtype, batch: int = 4, length: int = 11, nan_padding: bool = False):
    """A batch with padding (one response of length 1, one full), off-policy ratios both sides of any clip range,
    and the extras some objectives need; `nan_padding` puts NaN on the padding (the token-by-token path)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g, dtype=dtype) * 3
    logp = (old + 0.4 * torch.randn(batch, length, generator=g, dtype=dtype)).clamp(max=0)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0], lengths[-1] = 1, length
    mask = torch.arange(length)[None] < lengths[:, None]
    if nan_padding:
        logp = logp.masked_fill(~mask, math.nan)
    return {"logp": logp, "old_logp": old, "advantages": torch.randn(batch, generator=g, dtype=dtype), "mask": mask,
            "entropy": torch.rand(batch, length, generator=g, dtype=dtype) * 2,
            "full_kl": torch.rand(batch, length, generator=g, dtype=dtype) * 0.1}


def run(objective, inputs: dict, fused, **options):
    """(loss, d loss / d logp, d loss / d full_kl, metrics) of `compute_policy_loss` (token_mean unless given:
    dr_grpo needs its max_len)."""
    options = {"aggregation": "token_mean", **options}
    logp = inputs["logp"].clone().requires_grad_(True)
    full_kl = inputs["full_kl"].clone().requires_grad_(True)
    extras = {"entropy": inputs["entropy"], "full_kl": full_kl}
    loss, metrics = tc.compute_policy_loss(
        objective, logp=logp, old_logp=inputs["old_logp"], advantages=inputs["advantages"], mask=inputs["mask"],
        fused=fused, **{k: extras[k] for k in objective.requires}, **options)
    loss.backward()
    grad_kl = full_kl.grad if full_kl.grad is not None else torch.zeros_like(full_kl)
    return loss.detach(), logp.grad, grad_kl, dict(metrics)


def assert_same(eager, fused, dtype: torch.dtype) -> None:
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-11, "atol": 1e-12}
    for a, b in zip(eager[:3], fused[:3], strict=True):
        torch.testing.assert_close(b, a, **tol, equal_nan=False)
    assert list(fused[3]) == list(eager[3])  # the same metrics, in the same order
    for key, value in eager[3].items():
        assert math.isclose(fused[3][key], value, rel_tol=tol["rtol"], abs_tol=tol["atol"]), (key, fused[3][key], value)


def check_fused_equals_eager(case: str, backend: str, dtype: torch.dtype, **options) -> None:
    objective = objective_of(case)
    for seed, length in ((0, 11), (1, 17)):  # two lengths: the second reuses the graph (dynamic sizes)
        inputs = random_inputs(seed, dtype, length=length)
        assert_same(run(objective, inputs, False, **options), run(objective, inputs, backend, **options), dtype)


@pytest.mark.parametrize("case", FUSABLE)
def test_every_fusable_objective_compiles_to_one_graph_equal_to_eager(case):
    clear_compiled()  # compile here, whatever other tests compiled
    counters.clear()
    check_fused_equals_eager(case, True, torch.float32, aggregation="token_mean")
    assert counters["stats"]["unique_graphs"] == 1, f"{case}: {counters['stats']['unique_graphs']} graphs"
    assert not counters["graph_break"], f"{case} breaks the graph: {dict(counters['graph_break'])}"


@pytest.mark.parametrize("case", ["kl3", "gspo"])  # an interval from a Lambert-W solve; a sequence ratio
def test_inductor_fused_loss_equals_eager_in_float64(case):
    check_fused_equals_eager(case, True, torch.float64, aggregation="token_mean")


@pytest.mark.parametrize("aggregation,options", [
    ("dr_grpo", {"max_len": 40}),
    ("dr_grpo", {"max_len": 40, "num_sequences": 12}),
    ("token_mean", {"num_tokens": 500.0}),
    ("seq_mean_token_mean", {"num_sequences": 8, "num_processes": 2}),
    ("seq_mean_token_sum", {"num_sequences": 1}),
])
def test_every_aggregation_fused_equals_eager(aggregation, options):
    check_fused_equals_eager("kl3", CAPTURE, torch.float64, aggregation=aggregation, **options)


def test_dr_grpo_max_len_shorter_than_a_response_is_still_an_error():
    with pytest.raises(ValueError, match="max_len=5 is shorter than the longest response"):
        run(objective_of("kl3"), random_inputs(0, torch.float32), CAPTURE, aggregation="dr_grpo", max_len=5)


def test_nan_on_padding_is_neutralised_on_the_fused_path():
    inputs = random_inputs(2, torch.float32, nan_padding=True)
    eager, fused = (run(objective_of("clip_higher"), inputs, fused) for fused in (False, CAPTURE))
    assert torch.isfinite(fused[0]) and torch.all(fused[1][~inputs["mask"]] == 0)
    assert_same(eager, fused, torch.float32)


def test_fused_token_loss_equals_eager_with_token_weights():
    inputs = random_inputs(3, torch.float64)
    weights = torch.rand(inputs["logp"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results = []
    for fused in (False, CAPTURE):
        logp = inputs["logp"].clone().requires_grad_(True)
        out, batch = compute_token_loss("sapo", logp=logp, old_logp=inputs["old_logp"],
                                        advantages=inputs["advantages"], mask=inputs["mask"], token_weights=weights,
                                        fused=fused)
        out.loss.sum().backward()
        results.append((out, logp.grad))
    (eager, eager_grad), (fused, fused_grad) = results
    torch.testing.assert_close(fused.loss.detach(), eager.loss.detach(), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(fused_grad, eager_grad, rtol=1e-11, atol=1e-12)
    assert torch.equal(fused.clipped_low, eager.clipped_low) and torch.equal(fused.clipped_high, eager.clipped_high)
    assert fused.stats.keys() == eager.stats.keys()
    torch.testing.assert_close(fused.stats["gate_weight_mean"], eager.stats["gate_weight_mean"], rtol=1e-11, atol=0)


def test_new_lengths_and_batch_sizes_reuse_the_compiled_graph():
    objective = get_objective("clip_higher", epsilon_high=0.3)
    clear_compiled()
    counters.clear()
    for seed, (batch, length) in enumerate([(4, 9), (4, 23), (6, 57), (3, 130)]):
        inputs = random_inputs(seed, torch.float32, batch=batch, length=length)
        eager, fused = (run(objective, inputs, f, aggregation="token_mean") for f in (False, CAPTURE))
        assert_same(eager, fused, torch.float32)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_changing_global_counts_recompile_at_most_once():
    objective = get_objective("kl2", delta=0.02)
    clear_compiled()
    counters.clear()
    for seed, count in enumerate([100.0, 140.0, 77.5, 310.0]):
        inputs = random_inputs(seed, torch.float64, length=9 + seed)
        for aggregation, options in (("token_mean", {"num_tokens": count}), ("dr_grpo", {"max_len": 20 + seed})):
            fused = run(objective, inputs, CAPTURE, aggregation=aggregation, **options)
            assert_same(run(objective, inputs, False, aggregation=aggregation, **options), fused, torch.float64)
    assert counters["stats"]["unique_graphs"] <= 4 and not counters["graph_break"]  # each aggregation: 2 at most


@pytest.mark.parametrize("name", sorted(UNFUSABLE))
def test_an_objective_that_cannot_be_fused_is_a_value_error_naming_it(name):
    inputs = random_inputs(0, torch.float32)
    with pytest.raises(ValueError, match=f"objective '{name}' cannot be fused.*fused=False"):
        tc.compute_policy_loss(name, **{k: inputs[k] for k in ("logp", "old_logp", "advantages", "mask")}, fused=True,
                               aggregation="token_mean")
    with pytest.raises(ValueError, match=f"objective '{name}' cannot be fused"):  # before validating the inputs
        tc.compute_policy_loss(name, logp=torch.zeros(3), old_logp=None, advantages=None, mask=None, fused=True,
                               aggregation="token_mean")


@pytest.mark.parametrize("fused", [1, "", None, 0.5])
def test_a_fused_value_that_is_neither_a_bool_nor_a_backend_is_a_value_error(fused):
    inputs = random_inputs(0, torch.float32)
    with pytest.raises(ValueError, match=r"fused must be True, False or the name of a torch.compile backend, got"):
        tc.compute_policy_loss("kl3", **{k: inputs[k] for k in ("logp", "old_logp", "advantages", "mask")},
                               fused=fused, aggregation="token_mean")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 6), length=st.integers(1, 40),
       scale=st.floats(0.01, 30.0), name=st.sampled_from(["clip", "kl3", "aspo", "gspo", "cispo"]))
def test_fused_equals_eager_on_random_batches(seed, batch, length, scale, name):
    inputs = random_inputs(seed, torch.float64, batch=batch, length=length)
    inputs["advantages"] = inputs["advantages"] * scale
    objective = get_objective(name)
    assert_same(run(objective, inputs, False), run(objective, inputs, CAPTURE), torch.float64)

