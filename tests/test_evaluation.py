"""Pass@k / Mean@k metrics, the evaluator, reports, and `trustclip eval` end to end."""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import trustclip
from trustclip.evaluation.config import EvalConfig
from trustclip.evaluation.evaluator import EvalResult, evaluate
from trustclip.evaluation.metrics import benchmark_metrics, mean_at_k, metric_curves, pass_at_k
from trustclip.evaluation.report import format_table, write_report

# --------------------------------------------------------------------------- metrics


def enumerate_pass_at_k(n: int, c: int, k: int) -> float:
    """Exact pass@k: the fraction of size-k subsets of the n samples that hold a correct one."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_exact_enumeration():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(enumerate_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_special_values_and_stability():
    assert trustclip.pass_at_k is pass_at_k
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    # Large n: the product form stays exact where comb() ratios would overflow floats.
    assert pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    assert pass_at_k(2000, 10, 1000) == pytest.approx(1 - math.comb(1990, 1000) / math.comb(2000, 1000))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_monotone_and_bounded(nck):
    n, c, k = nck
    p = pass_at_k(n, c, k)
    assert 0.0 <= p <= 1.0
    assert p == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-9)
    if k < n:
        assert pass_at_k(n, c, k + 1) >= p - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= p - 1e-12


@pytest.mark.parametrize(
    ("n", "c", "k", "error", "pattern"),
    [
        (4, 1, 5, ValueError, r"1 <= k <= n, got k=5, n=4"),
        (4, 1, 0, ValueError, r"1 <= k <= n, got k=0"),
        (4, 5, 2, ValueError, r"0 <= c <= n, got c=5, n=4"),
        (4, -1, 2, ValueError, r"0 <= c <= n, got c=-1"),
        (0, 0, 1, ValueError, r"n >= 1"),
        (4.0, 1, 1, TypeError, r"n must be an integer, got 4.0"),
        (4, True, 1, TypeError, r"c must be an integer, got True"),
    ],
)
def test_pass_at_k_validates_arguments(n, c, k, error, pattern):
    with pytest.raises(error, match=pattern):
        pass_at_k(n, c, k)


def test_mean_and_pass_at_k_on_a_crafted_sample_set():
    correct = [
        [1, 0, 1, 0],  # 2 of 4
        [1, 1, 1, 1],  # 4 of 4
        [0, 0, 0, 0],  # 0 of 4
        [0, 0, 0, 1],  # 1 of 4
    ]
    scores = benchmark_metrics(correct, [1, 2, 4])
    assert scores["mean@4"] == pytest.approx((0.5 + 1 + 0 + 0.25) / 4)
    assert scores["pass@4"] == pytest.approx(3 / 4)
    assert scores["pass@1"] == pytest.approx(scores["mean@4"])  # pass@1 is the mean accuracy
    # pass@2 by hand: 1 - C(n-c,2)/C(4,2) = 1-1/6, 1, 0, 1-3/6.
    assert scores["pass@2"] == pytest.approx((5 / 6 + 1 + 0 + 0.5) / 4)
    assert mean_at_k(4, 1, 2) == 0.25
    curves = metric_curves(correct)
    assert curves["k"] == [1.0, 2.0, 3.0, 4.0]
    assert curves["mean"] == pytest.approx([scores["mean@4"]] * 4)
    assert curves["pass"][0] == pytest.approx(scores["pass@1"]) and curves["pass"][-1] == pytest.approx(0.75)
    with pytest.raises(ValueError, match="problem 1: scores must be 0/1"):
        benchmark_metrics([[1, 0], [0.5, 1]], [1])
    with pytest.raises(ValueError, match="problem 0 has no samples"):
        benchmark_metrics([[]], [1])


# --------------------------------------------------------------------------- evaluator


BENCH = {
    "easy": [
        {"id": "e0", "problem": "Compute 1+1.", "answer": "2"},
        {"id": "e1", "problem": "Compute 2+2.", "answer": "4"},
    ],
    "hard": [{"id": "h0", "problem": "Compute 1/2 as a fraction.", "answer": "\\frac{1}{2}"}],
}


def scripted_generate(table: dict[str, list[str]]):
    """A generate_fn that answers each prompt from a table keyed by the problem text."""

    def generate(prompts):
        return [next(v for k, v in table.items() if k in p) for p in prompts]

    return generate


def test_evaluate_scores_scripted_completions_exactly():
    table = {
        "1+1": ["\\boxed{2}", "\\boxed{3}", "2", "\\boxed{2}"],  # 3 of 4 ("2": last-number fallback)
        "2+2": ["\\boxed{5}"] * 4,  # 0 of 4
        "1/2": ["\\boxed{0.5}", "\\boxed{\\dfrac{1}{2}}", "", "\\boxed{1/3}"],  # 2 of 4
    }
    cfg = EvalConfig(k=4, show_progress=False, answer_fallback=True)
    result = evaluate(None, None, BENCH, cfg, model_name="scripted", generate_fn=scripted_generate(table))
    assert result.metrics["easy"]["mean@4"] == pytest.approx(3 / 8)
    assert result.metrics["easy"]["pass@4"] == pytest.approx(1 / 2)
    assert result.metrics["hard"] == pytest.approx({"mean@4": 0.5, "pass@4": 1.0})
    assert result.metrics["average"]["mean@4"] == pytest.approx((3 / 8 + 0.5) / 2)
    assert result.samples["hard"][0]["scores"] == [1.0, 1.0, 0.0, 0.0]
    assert result.flat_metrics()["eval/easy/pass@4"] == pytest.approx(0.5)
    assert result.curves["easy"]["pass"][0] == pytest.approx(3 / 8)
    # per-problem solve counts, kept in the evaluation's file (problems solved by neither / every sample)
    assert result.solved == {"easy": [3, 0], "hard": [2]}
    assert result.to_dict()["solved"] == result.solved


def test_evaluate_without_answer_fallback_requires_a_boxed_answer():
    # what an RL policy that learned to drop the box would write: correct last number, no \\boxed{}
    table = {"1+1": ["1+1=2. \\box}", "\\boxed{2}", "2", "1+1=2."], "2+2": ["2+2=4."] * 4, "1/2": ["1/2"] * 4}
    lenient = evaluate(None, None, BENCH, EvalConfig(k=4, show_progress=False, answer_fallback=True), model_name="s",
                       generate_fn=scripted_generate(table))
    strict = evaluate(None, None, BENCH, EvalConfig(k=4, show_progress=False), model_name="s",  # the default
                      generate_fn=scripted_generate(table))
    assert lenient.samples["easy"][0]["scores"] == [1.0, 1.0, 1.0, 1.0]
    assert strict.samples["easy"][0]["scores"] == [0.0, 1.0, 0.0, 0.0]
    assert strict.metrics["hard"]["mean@4"] == 0.0 < lenient.metrics["hard"]["mean@4"]


def test_evaluate_in_memory_model_is_seeded_and_restores_state(tiny_model_and_tokenizer):
    import torch

    model, tokenizer = tiny_model_and_tokenizer
    bench = {"b": BENCH["easy"]}
    cfg = EvalConfig(k=3, max_new_tokens=6, temperature=1.0, batch_size=4, seed=11, show_progress=False)
    model.train()
    tokenizer.padding_side = "right"
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = evaluate(model, tokenizer, bench, cfg, step=5)
    assert torch.equal(torch.rand(1), expected_next)  # the caller's RNG stream is untouched
    assert model.training and tokenizer.padding_side == "right"
    again = evaluate(model, tokenizer, bench, cfg)
    assert [s["completions"] for s in first.samples["b"]] == [s["completions"] for s in again.samples["b"]]
    assert all(len(s["completions"]) == 3 for s in first.samples["b"])
    other = evaluate(model, tokenizer, bench, dataclasses.replace(cfg, seed=12))
    assert [s["completions"] for s in first.samples["b"]] != [s["completions"] for s in other.samples["b"]]
    assert first.step == 5 and first.to_dict()["seed"] == 11
    tokenizer.padding_side = "left"
    model.eval()


def test_completion_mask_ends_at_the_first_end_of_sequence_token():
    import torch

    from trustclip.evaluation.generation import completion_mask

    tokens = torch.tensor([[5, 6, 2, 2, 2], [5, 2, 7, 2, 0], [5, 6, 7, 8, 9], [3, 6, 7, 8, 9]])
    mask = completion_mask(tokens, [2, 3])
    assert mask.sum(1).tolist() == [3, 2, 5, 1]  # the end token counts (as TRL counts a completion's length)
    assert mask.tolist()[1] == [True, True, False, False, False]


def test_held_out_length_and_entropy_match_a_forward_over_the_completions(tiny_model_and_tokenizer):
    """Greedy samples, so the test can regenerate the same tokens: each sample's length is its token count up to the
    first end token, its entropy the mean over those tokens of the entropy of softmax(logits) from a plain forward
    pass (float64); the benchmark's entropy is token-weighted, and `average` is the mean over benchmarks."""
    import torch

    from trustclip.evaluation.generation import completion_mask, generate_hf

    model, tokenizer = tiny_model_and_tokenizer
    model.eval()
    cfg = EvalConfig(k=1, max_new_tokens=12, temperature=0.0, batch_size=1, show_progress=False)  # no padding
    prompts = ["What is 1+2?", "Compute 7*8 please."]
    samples = generate_hf(model, tokenizer, prompts, cfg)
    eos_ids = [model.generation_config.eos_token_id, tokenizer.eos_token_id]
    for prompt, (sample,) in zip(prompts, samples, strict=True):
        enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            logits = model(out).logits[0, enc["input_ids"].shape[1] - 1 : -1].double()
        generated = out[:, enc["input_ids"].shape[1]:]
        n = int(completion_mask(generated, [e for e in eos_ids if e is not None]).sum())
        logp = torch.log_softmax(logits[:n], dim=-1)
        expected = float(-(logp.exp() * logp).sum(-1).mean())
        assert sample.tokens == n and sample.text == tokenizer.decode(generated[0], skip_special_tokens=True)
        assert sample.entropy == pytest.approx(expected, rel=1e-4)
    # Sampled at T = 0.3 (one prompt, so the seeded draw can be repeated): the entropy is still the raw logits'.
    hot = dataclasses.replace(cfg, temperature=0.3, seed=5)
    (sample,), = generate_hf(model, tokenizer, prompts[:1], hot)
    enc = tokenizer(prompts[0], return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(hot.seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=True, temperature=0.3, top_p=hot.top_p, top_k=0,
                             pad_token_id=tokenizer.pad_token_id)
        logits = model(out).logits[0, enc["input_ids"].shape[1] - 1 : -1].double()
    n = int(completion_mask(out[:, enc["input_ids"].shape[1]:], [e for e in eos_ids if e is not None]).sum())
    raw, tempered = (torch.log_softmax(logits[:n] / t, dim=-1) for t in (1.0, 0.3))
    assert sample.tokens == n
    assert sample.entropy == pytest.approx(float(-(raw.exp() * raw).sum(-1).mean()), rel=1e-4)
    assert sample.entropy != pytest.approx(float(-(tempered.exp() * tempered).sum(-1).mean()), rel=1e-2)
    result = evaluate(model, tokenizer, {"a": BENCH["easy"], "b": BENCH["hard"]}, cfg)
    stats = result.completion_stats
    assert set(stats) == {"a", "b", "average"} and set(stats["a"]) == {"length", "entropy"}
    assert stats["average"]["length"] == pytest.approx((stats["a"]["length"] + stats["b"]["length"]) / 2)
    assert result.to_dict()["completion_stats"] == stats
    assert [len(s["tokens"]) for s in result.samples["a"]] == [1, 1]


def test_text_only_generators_get_lengths_from_the_tokenizer_and_no_entropy(tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    texts = {"easy": ["\\boxed{4} ok", "\\boxed{9}"]}

    def text_only(prompts):
        return [[texts["easy"][i % 2]] for i, _ in enumerate(prompts)]

    result = evaluate(None, tokenizer, {"easy": BENCH["easy"][:2]}, EvalConfig(k=1, show_progress=False),
                      generate_fn=text_only)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts["easy"]]
    assert result.completion_stats["easy"] == {"length": pytest.approx(sum(lengths) / 2)}
    assert "entropy" not in result.completion_stats["average"]


def fake_result(name: str, values: dict[str, tuple[float, float]]) -> EvalResult:
    metrics = {b: {"mean@8": m, "pass@8": p} for b, (m, p) in values.items()}
    return EvalResult(name, EvalConfig(show_progress=False), metrics, {}, {b: [] for b in values}, "hf", 1.0)


def test_final_best_table_and_report_files(tmp_path):
    results = [
        fake_result("ckpt-100", {"amc": (0.30, 0.60), "average": (0.20, 0.50)}),
        fake_result("ckpt-200", {"amc": (0.40, 0.55), "average": (0.25, 0.45)}),
        fake_result("final", {"amc": (0.35, 0.58), "average": (0.22, 0.40)}),
    ]
    table = format_table(results)
    assert "| amc | 35.00 (40.00) | 58.00 (60.00) |" in table
    assert "| **Average** | 22.00 (25.00) | 40.00 (50.00) |" in table
    assert "35.00 |" in format_table(results[-1:]) and "(" not in format_table(results[-1:]).split("\n", 2)[2]
    paths = write_report(results, tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert data["final"]["amc"] == {"mean@8": 0.35, "pass@8": 0.58}
    assert data["best"]["amc"] == {"mean@8": 0.40, "pass@8": 0.60}
    assert data["seed"] == 0 and [c["model"] for c in data["checkpoints"]] == ["ckpt-100", "ckpt-200", "final"]
    rows = list(csv.DictReader(paths["csv"].open()))
    best_amc = next(r for r in rows if r["checkpoint"] == "best" and r["benchmark"] == "amc")
    assert float(best_amc["pass@8"]) == 0.60
    assert "final (best)" in paths["md"].read_text()


# --------------------------------------------------------------------------- CLI end to end


SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_benchmark(path: Path, shared_dir: Path, n: int = 3) -> list[dict]:
    """A few rows in the shared benchmark format (real AIME rows when the shared data is present)."""
    source = shared_dir / "aime2024.jsonl"
    if source.is_file():
        rows = [json.loads(line) for line in source.read_text().splitlines()[:n]]
    else:
        rows = [{"id": f"r{i}", "problem": f"Compute {i}+{i}.", "answer": str(2 * i)} for i in range(n)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return rows


@pytest.mark.slow
def test_trustclip_eval_end_to_end(tmp_path, capsys):
    from trustclip.cli import main
    from trustclip.models import build_tiny_model

    bench = tmp_path / "aime_mini.jsonl"
    write_benchmark(bench, SHARED_DATA)
    # real AIME prompts are longer than the default 256 positions: checkpoints with room for them
    first = build_tiny_model(tmp_path / "tiny", max_position_embeddings=2048)
    second = build_tiny_model(tmp_path / "tiny-seed1", seed=1, max_position_embeddings=2048)  # a later checkpoint
    out = tmp_path / "report"
    argv = ["eval", "--model", str(first), "--model", str(second), "--benchmark", f"aime={bench}"]
    argv += ["--benchmark", "builtin", "--limit", "3", "--k", "2", "--temperature", "0.3", "--top-p", "0.95"]
    argv += ["--max-new-tokens", "8", "--batch-size", "16", "--seed", "5", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| Benchmark | Mean@2 (%) | Pass@2 (%) |" in printed
    for name in ("aime", "amc_like", "aime24_like", "aime25_like", "**Average**"):
        assert f"| {name} | " in printed, name

    data = json.loads((out / "results.json").read_text())
    assert data["seed"] == 5 and data["config"]["temperature"] == 0.3
    assert data["meta"]["data_seed"] == 0 and data["meta"]["benchmarks"] == [f"aime={bench}", "builtin"]
    assert [c["model"] for c in data["checkpoints"]] == [str(first), str(second)]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 4 * 3 and all(len(s["completions"]) == 2 for s in samples)
    # The reported Mean@2 / Pass@2 are exactly what the stored samples and scores give.
    for idx, ckpt in enumerate(data["checkpoints"]):
        for bench_name in ("aime", "amc_like", "aime24_like", "aime25_like"):
            scores = [s["scores"] for s in samples if s["index"] == idx and s["benchmark"] == bench_name]
            assert ckpt["metrics"][bench_name]["mean@2"] == pytest.approx(sum(map(sum, scores)) / 6)
            assert ckpt["metrics"][bench_name]["pass@2"] == pytest.approx(sum(max(s) for s in scores) / 3)
    md = (out / "results.md").read_text()
    assert "final (best)" in md and "seed = 5" in md
    assert sum(1 for _ in csv.DictReader((out / "results.csv").open())) == (2 + 2) * 5


def test_trustclip_eval_rejects_a_malformed_benchmark(tmp_path, capsys):
    from trustclip.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "p", "answer": "1"}\n{"problem": "q"}\n')
    assert main(["eval", "--model", "builtin:tiny", "--benchmark", f"x={bad}"]) == 2
    assert f"{bad}:2: missing field 'answer'" in capsys.readouterr().err


def test_eval_config_validation():
    with pytest.raises(ValueError, match="n_samples"):
        EvalConfig(k=8, n_samples=4)
    with pytest.raises(ValueError, match="backend"):
        EvalConfig(backend="tgi")
    assert EvalConfig(k=4, n_samples=16).n == 16


def _short_eval(model, bench, out, *extra):
    return ["eval", "--model", str(model), "--benchmark", f"b={bench}", "--k", "1", "--max-new-tokens", "2",
            "--output", str(out), "--no-progress", *extra]


def _write_rows(path, problems):
    path.write_text("".join(json.dumps({"id": f"r{i}", "problem": p, "answer": "2"}) + "\n"
                            for i, p in enumerate(problems)))
    return path


def test_trustclip_eval_keeps_an_earlier_evaluation_in_its_output_folder(tiny_model_path, tmp_path, capsys):
    from trustclip.cli import main

    bench = _write_rows(tmp_path / "b.jsonl", ["1+1?"])
    out = tmp_path / "report"
    out.mkdir()
    (out / "samples.jsonl").write_text("earlier\n")
    assert main(_short_eval(tiny_model_path, bench, out)) == 2
    assert f"--output {out} already holds an evaluation (samples.jsonl)" in capsys.readouterr().err
    assert (out / "samples.jsonl").read_text() == "earlier\n" and not (out / "results.json").exists()


def test_trustclip_eval_warns_about_a_benchmark_with_duplicated_problems(tiny_model_path, tmp_path, capsys):
    from trustclip.cli import main

    bench = _write_rows(tmp_path / "b.jsonl", ["1+1?", "2+2?", "1+1?", " 1+1? ", "2+2?"])
    assert main(_short_eval(tiny_model_path, bench, tmp_path / "report")) == 0
    err = capsys.readouterr().err
    assert "warning: benchmark 'b' holds 2 problem(s) more than once (3 extra row(s) of 5)" in err


def test_trustclip_eval_of_an_adapter_whose_base_model_is_gone_names_it(tmp_path, capsys):
    from trustclip.cli import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    gone = tmp_path / "sft" / "final"
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(gone)}))
    bench = _write_rows(tmp_path / "b.jsonl", ["1+1?"])
    assert main(_short_eval(adapter, bench, tmp_path / "report")) == 2
    err = capsys.readouterr().err
    assert f"is a LoRA adapter, and this adapter's base model {gone} is missing" in err and "Traceback" not in err


@pytest.mark.parametrize("model", ["builtin:tiny", "folder"])
def test_trustclip_eval_refuses_prompts_that_do_not_fit_the_model(tiny_model_path, tmp_path, capsys, model):
    """256 positions (the tiny model, built-in or as a checkpoint folder): a 250-character prompt leaves no room for 8
    new tokens; refused before generating, with the largest --max-new-tokens that fits."""
    from trustclip.cli import main

    bench = _write_rows(tmp_path / "b.jsonl", ["1+1?", "x" * 245 + " 1+1?"])
    name = "builtin:tiny" if model == "builtin:tiny" else str(tiny_model_path)
    out = tmp_path / "report"
    assert main(_short_eval(name, bench, out, "--max-new-tokens", "8")) == 2
    err = capsys.readouterr().err
    assert "benchmark 'b': prompt 1 (id 'r1') has" in err and f"exceed the 256 positions of model {name}" in err
    assert "lower --max-new-tokens to" in err and not out.exists()
