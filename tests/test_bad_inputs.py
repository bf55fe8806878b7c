"""Bad input to the library gets a clear error naming it (or the right result), never a silent wrong answer:
issue 18's list, at the level of the objectives, the reward and the data loaders."""

from __future__ import annotations

import math

import pytest
import torch

import trustclip as tc
from trustclip.data.loaders import DataFormatError, load_prompts
from trustclip.rewards import MathVerifier, score_completions

HUGE = "1" * 5000  # more digits than Python converts to an int (sys.get_int_max_str_digits() = 4300)


def _batch(b: int = 2, t: int = 24):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(b, t, generator=g) - 0.1
    old = (logp + 0.3 * torch.randn(b, t, generator=g)).clamp(max=0.0)
    return dict(logp=logp, old_logp=old, advantages=torch.tensor([1.0, -0.5]), mask=torch.ones(b, t))


# ------------------------------------------------------------------ objectives
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_tokens": 1, "aggregation": "token_mean"}, "num_tokens=1 is smaller than this batch's 48 valid tokens"),
    ({"num_tokens": 47.0, "aggregation": "token_mean"}, "num_tokens=47.0 is smaller"),
    ({"num_sequences": 1, "max_len": 24}, "num_sequences=1 is smaller than this batch's 2 sequences"),
])
def test_a_global_count_below_the_batch_is_an_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tc.compute_policy_loss("clip", **_batch(), **kwargs)
    exact, _ = tc.compute_policy_loss("clip", **_batch(), aggregation="token_mean", num_tokens=48)
    local, _ = tc.compute_policy_loss("clip", **_batch(), aggregation="token_mean")
    assert exact == local  # the count equal to the batch's is the batch alone


@pytest.mark.parametrize("aggregation", ["token_mean", "dr_grpo", "seq_mean_token_mean"])
def test_global_counts_with_processes_give_the_big_batch_loss(aggregation):
    """Two processes with unequal halves (DDP averages their losses): global counts + num_processes = 2."""
    batch = _batch(b=2)
    batch["mask"] = torch.ones(2, 24)
    batch["mask"][1, 5:] = 0  # 24 + 5 valid tokens: one half holds most of them
    max_len = {"max_len": 24} if aggregation == "dr_grpo" else {}
    whole, _ = tc.compute_policy_loss("clip", **batch, aggregation=aggregation, **max_len)
    halves = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    counts = {"num_tokens": 29} if aggregation == "token_mean" else {"num_sequences": 2}
    shares = [tc.compute_policy_loss("clip", **h, aggregation=aggregation, **max_len, num_processes=2, **counts)[0]
              for h in halves]
    torch.testing.assert_close((shares[0] + shares[1]) / 2, whole)
    with pytest.raises(ValueError, match="num_processes must be an integer >= 1"):
        tc.compute_policy_loss("clip", **batch, aggregation="token_mean", num_processes=0)
    plain_sum, _ = tc.compute_policy_loss("clip", **batch, aggregation="seq_mean_token_sum", num_sequences=1)
    per_sequence, _ = tc.compute_policy_loss("clip", **batch, aggregation="seq_mean_token_sum")
    torch.testing.assert_close(plain_sum, 2 * per_sequence)  # num_sequences=1: the plain token sum (verl's)


@pytest.mark.parametrize("name", ["token_weights", "full_kl", "entropy"])
def test_negative_weights_and_divergences_are_errors(name):
    objective = {"full_kl": "truly_ppo", "entropy": "aspo"}.get(name, "clip")
    kwargs = {"entropy_split": True} if name == "entropy" else {}
    values = torch.full((2, 24), 0.5)
    values[1, 3] = -0.2
    with pytest.raises(ValueError, match=rf"{name} must be >= 0 on every valid token; found 1 negative value\(s\) "
                                         r"\(first at index \(1, 3\)"):
        tc.compute_policy_loss(tc.get_objective(objective, **kwargs), **_batch(), aggregation="token_mean",
                               **{name: values})
    values[1, 3] = -1e-6  # float32 round-off of an exact 0 (a KL of identical distributions) passes
    tc.compute_policy_loss(tc.get_objective(objective, **kwargs), **_batch(), aggregation="token_mean",
                           **{name: values})


def test_a_nan_divergence_is_an_error():
    with pytest.raises(ValueError, match=r"D\(1\) = nan"):
        tc.custom_divergence(lambda w: w * float("nan"), 0.1)
    nan_above_3 = lambda w: torch.where(w > 3, torch.full_like(w, float("nan")), (w - 1) ** 2)  # noqa: E731
    with pytest.raises(ValueError, match="divergence is nan at w = 3"):
        tc.custom_divergence(nan_above_3, 0.1)
    low, high = tc.custom_divergence(lambda w: (w - 1) ** 2, 0.01).bounds  # a sound one still works
    assert (low, high) == pytest.approx((0.9, 1.1))


@pytest.mark.parametrize("divergence,message", [
    # back below delta far from 1 (D -> 0 as |log w| grows): the set is not an interval, though D(2) = 0.30 > delta
    (lambda w: w.log() ** 2 * torch.exp(-w.log() ** 2), r"not an interval, .* leaves it at \[0.7158, 1.397\]"),
    (lambda w: torch.sin(3 * (w - 1)) ** 2, r"not an interval, .* leaves it at \[0.8927, 1.107\]"),
    (lambda w: -((w - 1) ** 2), r"divergence is negative at w = 1e-12 \(D = -1\)"),
])
def test_a_divergence_without_an_interval_gets_no_bounds(divergence, message):
    with pytest.raises(ValueError, match=message):
        tc.custom_divergence(divergence, 0.1)


def test_a_certified_divergence_bounds_exactly_its_feasible_set():
    constraint = tc.custom_divergence(lambda w: (w.sqrt() - 1) ** 2, 0.05)
    low, high = constraint.bounds
    w = torch.tensor([low * 0.999, low * 1.001, 1.0, high * 0.999, high * 1.001], dtype=torch.float64)
    assert ((w.sqrt() - 1) ** 2 <= 0.05).tolist() == [False, True, True, True, False]


@pytest.mark.parametrize(("name", "q"), [
    ("dcpo", 1.5), ("trgppo", -0.5), ("dcpo", float("nan")), ("trgppo", 0.0), ("dcpo", [0.5, 2.0]),
    ("trgppo", torch.tensor([0.3, float("inf")])),
])
def test_q_must_be_a_probability(name, q):
    with pytest.raises(ValueError, match=r"q must be a probability in \(0, 1\]"):
        tc.ratio_bounds(name, q=q)


@pytest.mark.parametrize("q", [[], torch.tensor([])], ids=["list", "tensor"])
def test_q_must_not_be_empty(q):
    """An empty tensor was let through (its `size` is a method, so `size == 0` was never true)."""
    with pytest.raises(ValueError, match="q is empty"):
        tc.ratio_bounds("dcpo", q=q)


def test_q_does_not_apply_to_constant_bounds():
    with pytest.raises(ValueError, match="objective 'kl3' has constant bounds; q does not apply"):
        tc.ratio_bounds("atr", q=0.5)


@pytest.mark.parametrize("delta", [0.07, 1.0, 30.0, 700.0, 1000.0, 1e5])
def test_atr_bounds_are_the_roots_for_any_delta(delta):
    low, high = tc.ratio_bounds("atr", delta=delta)
    assert math.isfinite(high) and high > 1 > low >= 0
    kl3 = lambda w: w - 1 - math.log(w)  # noqa: E731
    assert kl3(high) == pytest.approx(delta, rel=1e-9)
    if low > 0:
        assert kl3(low) == pytest.approx(delta, rel=1e-9)
    if delta == 1000.0:
        assert high == pytest.approx(1007.9156, abs=1e-3)  # 1001 + log(u): not inf


# ------------------------------------------------------------------ reward
def test_a_huge_number_scores_zero_and_is_counted():
    verifier = MathVerifier(num_workers=1)
    try:
        completions = [f"\\boxed{{{HUGE}}}", "\\boxed{2}", f"\\boxed{{{HUGE}}}", "\\boxed{7}"]
        scores = score_completions(completions, ["2", HUGE, HUGE, "7"], verifier=verifier, timeout=10.0)
        assert scores == [0.0, 0.0, 1.0, 1.0]  # equal digit strings still match
        assert verifier.stats.errors + verifier.stats.timeouts >= 1  # the undecidable pairs are counted
    finally:
        verifier.close()


# ------------------------------------------------------------------ data files
def test_a_null_field_is_reported_as_null(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": null}\n')
    with pytest.raises(DataFormatError, match=r"rows\.jsonl:2: field 'answer' is null"):
        load_prompts(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_non_utf8_file_names_file_and_line(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    path.write_bytes('{"problem": "1+1", "answer": "2"}\n{"problem": "caf\xe9", "answer": "3"}\n'.encode("latin-1"))
    with pytest.raises(DataFormatError, match=rf"latin1\{suffix}:2: not UTF-8 text \(byte 0xe9"):
        load_prompts(path)


def test_a_huge_number_in_a_data_file_names_file_and_line(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "x", "answer": ' + HUGE + "}\n")
    with pytest.raises(DataFormatError, match=r"big\.jsonl:2: invalid JSON value \(Exceeds the limit"):
        load_prompts(path)


@pytest.mark.parametrize("bad", [{"jobs": -1}, {"jobs": 0}, {"threads": 0}])
def test_compare_execute_refuses_a_pool_that_could_never_run(bad, tmp_path):
    """A library caller of `execute` (CompareSettings checks the CLI's flags): jobs <= 0 would wait forever."""
    from trustclip.compare.runner import execute

    with pytest.raises(ValueError, match="must be > 0"):
        execute([], tmp_path, **bad)
    assert not any(tmp_path.iterdir())


def test_load_benchmarks_refuses_a_name_given_twice():
    """A library caller that skipped check_run: the second benchmark must not silently replace the first."""
    from trustclip.run_data import load_benchmarks
    from trustclip.settings import TrainConfig, from_dict

    with pytest.raises(ValueError, match="benchmark name 'amc_like' given twice"):
        load_benchmarks(from_dict(TrainConfig, {"data": {"eval": ["builtin", "amc_like=builtin:amc_like"]}}))


def test_a_huge_number_in_a_json_array_names_its_line(tmp_path):
    path = tmp_path / "big.json"
    path.write_text('[\n {"problem": "1+1", "answer": "2"},\n {"problem": "x", "answer": ' + HUGE + "}\n]\n")
    with pytest.raises(DataFormatError, match=r"big\.json:3: invalid JSON value \(Exceeds the limit"):
        load_prompts(path)


def test_text_after_a_json_array_is_named_at_its_line(tmp_path):
    """A multi-line array and then more is no JSON Lines file: the error names where the extra text starts."""
    path = tmp_path / "trailing.json"
    path.write_text('[\n {"problem": "1+1", "answer": "2"}\n]\n{"problem": "x", "answer": "3"}\n')
    with pytest.raises(DataFormatError, match=r"trailing\.json:4: invalid JSON \(Extra data at column 1\)"):
        load_prompts(path)


def test_a_data_file_under_home_loads_as_check_source_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "b.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n')
    assert [row["answer"] for row in load_prompts("~/b.jsonl")] == ["2"]
