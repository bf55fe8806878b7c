"""Verified reward: answer extraction, the math-verify verdict table, hard timeouts, TRL signature."""

from __future__ import annotations

import json
import threading
import time

import pytest

import trustclip
from trustclip.rewards import (
    CorrectnessReward,
    MathVerifier,
    extract_answer,
    fast_verdict,
    format_reward,
    last_boxed,
    score_completions,
    verify_answer,
)

HANG = "Simplifying, the answer is \\boxed{9^{9^{9^{9}}}}"  # sympy tries to evaluate the power tower
HUGE_FACTORIAL = "\\boxed{" + "1" * 5000 + "!}"  # sympify raises (integer string conversion limit)

# (source file, row id, reference answer exactly as in the benchmark, completion, expected verdict)
REAL_FORMAT_TABLE = [
    ("aime2024", "2024-I-1", "204", "So $m+n=204$, and the answer is \\boxed{204}.", 1.0),
    ("aime2024", "2024-I-1", "204", "\\boxed{205}", 0.0),
    ("aime2024", "2024-I-2", "25", "AIME answers have three digits: \\boxed{025}", 1.0),  # leading zero
    ("aime2024", "2024-I-2", "25", "\\boxed{250}", 0.0),
    ("amc2023", "2022-12A-1", "142", "\\boxed{142.0}", 1.0),
    ("gsm8k_test", "gsm8k-test-146", "2,125", "\\boxed{2125}", 1.0),  # thousands comma in the answer
    ("gsm8k_test", "gsm8k-test-146", "2,125", "\\boxed{2,125}", 1.0),
    ("gsm8k_test", "gsm8k-test-146", "2,125", "\\boxed{2.125}", 0.0),
    ("gsm8k_test", "gsm8k-test-201", "114,200", "He pays $114,200 in total.", 1.0),  # no box: last number
    ("math500", "test/prealgebra/1655.json", "\\dfrac{17}{50}", "\\boxed{\\frac{17}{50}}", 1.0),
    ("math500", "test/prealgebra/1655.json", "\\dfrac{17}{50}", "\\boxed{0.34}", 1.0),
    ("math500", "test/prealgebra/1655.json", "\\dfrac{17}{50}", "\\boxed{17/50}", 1.0),
    ("math500", "test/prealgebra/1655.json", "\\dfrac{17}{50}", "\\boxed{\\dfrac{17}{51}}", 0.0),
    ("math500", "test/algebra/2584.json", "\\frac{14}{3}", "\\boxed{\\tfrac{14}{3}}", 1.0),
    ("math500", "test/algebra/2036.json", "3\\sqrt{13}", "\\boxed{\\sqrt{117}}", 1.0),  # math-verify path
    ("math500", "test/algebra/2036.json", "3\\sqrt{13}", "\\boxed{13\\sqrt{3}}", 0.0),
    ("math500", "test/prealgebra/1302.json", "11\\sqrt2", "\\boxed{11\\sqrt{2}}", 1.0),
    ("math500", "test/precalculus/1199.json", "\\pi", "\\boxed{\\pi}", 1.0),
    ("math500", "test/precalculus/1199.json", "\\pi", "\\boxed{3.14}", 0.0),
    ("math500", "test/precalculus/1105.json", "-\\frac{\\pi}{6}", "\\boxed{-\\dfrac{\\pi}{6}}", 1.0),
    ("math500", "test/precalculus/1105.json", "-\\frac{\\pi}{6}", "\\boxed{\\frac{\\pi}{6}}", 0.0),
    (
        "math500",
        "test/precalculus/807.json",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
        "\\boxed{(3, \\frac{\\pi}{2})}",
        1.0,
    ),
    ("math500", "test/precalculus/807.json", "\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi)}", 0.0),
    ("math500", "test/precalculus/927.json", "90^\\circ", "\\boxed{90^\\circ}", 1.0),
    ("math500", "test/algebra/1349.json", "\\text{Evelyn}", "\\boxed{\\text{Evelyn}}", 1.0),
    ("dapo_math_17k", "dapo-2", "-3", "\\boxed{-3}", 1.0),
    ("dapo_math_17k", "dapo-2", "-3", "\\boxed{3}", 0.0),
    # Several boxed answers: the last one counts.
    ("aime2024", "2024-I-1", "204", "First \\boxed{12}; on reflection \\boxed{204}", 1.0),
    ("aime2024", "2024-I-1", "204", "First \\boxed{204}; on reflection \\boxed{12}", 0.0),
    # No boxed answer: the "Answer:" line, then the last number.
    ("dapo_math_17k", "dapo-0", "34", "Reasoning...\nAnswer: 34", 1.0),
    ("dapo_math_17k", "dapo-0", "34", "Reasoning...\nAnswer: 34\nCheck: 2*17", 1.0),
    ("dapo_math_17k", "dapo-0", "34", "I cannot solve this.", 0.0),
    ("dapo_math_17k", "dapo-0", "34", "", 0.0),  # empty completion
]


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(num_workers=1)
    # Warm up so timing assertions below measure verification, not interpreter start-up.
    assert v.equal_many([("3\\sqrt{2}", "\\sqrt{18}")], timeout=60.0) == [True]
    yield v
    v.close()


# --------------------------------------------------------------------------- extraction and fast path


def test_last_boxed_extraction():
    assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} and \\boxed{ {a}+{b} }") == "{a}+{b}"
    assert last_boxed("so \\boxed 5.") == "5"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{3} then \\boxed{4") == "3"  # an unclosed last box is skipped
    assert last_boxed("no box here 12") is None
    assert extract_answer("no box here 12", fallback=False) is None
    assert extract_answer("final answer: $-7$.") == "-7"
    assert extract_answer("Answer: 1\nThe answer is obviously 2") == "1"  # Answer: line beats last number
    assert extract_answer("   ") is None
    assert extract_answer("\\boxed{}") is None


@pytest.mark.parametrize(
    ("pred", "gold", "verdict"),
    [
        ("025", "25", 1.0),
        ("1,450,000", "1450000", 1.0),
        ("$12$", "12", 1.0),
        ("12", "13", 0.0),
        ("0.5", "\\frac12", 1.0),
        ("\\dfrac{3}{4}", "0.75", 1.0),
        ("-\\frac{1}{2}", "-0.5", 1.0),
        ("0.333333", "\\frac{1}{3}", None),  # not decidable by plain comparison: goes to math-verify
        ("1,2", "12", None),  # a tuple, not a thousands separator
        ("x+1", "1+x", None),
    ],
)
def test_fast_verdict(pred, gold, verdict):
    assert fast_verdict(pred, gold) == verdict


# --------------------------------------------------------------------------- verdict table


@pytest.mark.parametrize(("source", "row_id", "answer", "completion", "expected"), REAL_FORMAT_TABLE)
def test_real_answer_formats(verifier, source, row_id, answer, completion, expected):
    assert score_completions([completion], [answer], verifier=verifier, timeout=30.0) == [expected]


def test_public_verify_answer_matches_the_table():
    assert trustclip.verify_answer is verify_answer
    assert verify_answer("\\boxed{\\sqrt{117}}", "3\\sqrt{13}") == 1.0
    assert verify_answer("\\boxed{13\\sqrt{3}}", "3\\sqrt{13}") == 0.0
    assert verify_answer("", "1") == 0.0


def test_table_answers_are_the_real_benchmark_answers(shared_data_dir):
    wanted = {(s, i): a for s, i, a, _, _ in REAL_FORMAT_TABLE}
    for (source, row_id), answer in wanted.items():
        with (shared_data_dir / f"{source}.jsonl").open(encoding="utf-8") as fh:
            rows = {r["id"]: r["answer"] for r in map(json.loads, fh)}
        assert rows[row_id] == answer, (source, row_id)


# --------------------------------------------------------------------------- never stall, never crash


def test_hanging_verification_is_cut_scored_zero_and_counted(verifier):
    before = verifier.stats.timeouts
    t0 = time.monotonic()
    assert score_completions([HANG], ["1"], timeout=1.0, verifier=verifier) == [0.0]
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 6.0, elapsed
    assert verifier.stats.timeouts == before + 1
    # The hung worker was replaced: the next call that needs math-verify works.
    assert score_completions(["\\boxed{\\sqrt{117}}"], ["3\\sqrt{13}"], timeout=60.0, verifier=verifier) == [1.0]


def test_trl_reward_keeps_going_around_a_hanging_completion(verifier):
    reward = CorrectnessReward(timeout=1.0, verifier=verifier)
    before = reward.metrics()
    completions = [
        HANG,
        "\\boxed{\\sqrt{117}}",
        [{"role": "assistant", "content": "12+35=47. \\boxed{47}"}],
        "\\boxed{48}",
    ]
    scores = reward(completions, answer=["1", "3\\sqrt{13}", "47", "47"], prompts=["p"] * 4, id=list("abcd"))
    assert scores == [0.0, 1.0, 1.0, 0.0]
    after = reward.metrics()
    assert after["reward/timeouts"] == before["reward/timeouts"] + 1
    assert after["reward/calls"] == before["reward/calls"] + 4
    # A later training step is scored normally.
    assert reward(["\\boxed{\\frac{1}{2}}"], answer=["0.5"]) == [1.0]


def test_verification_exception_scores_zero_and_is_counted(verifier):
    before = verifier.stats.errors
    assert score_completions([HUGE_FACTORIAL], ["1"], timeout=30.0, verifier=verifier) == [0.0]
    assert verifier.stats.errors == before + 1


def test_worker_that_died_while_idle_is_replaced(verifier):
    verifier._workers[0].proc.kill()
    verifier._workers[0].proc.wait()
    errors = verifier.stats.errors
    assert score_completions(["\\boxed{\\sqrt{117}}"], ["3\\sqrt{13}"], timeout=60.0, verifier=verifier) == [1.0]
    assert verifier.stats.errors == errors


def test_verification_works_from_a_non_main_thread(verifier):
    out = []
    thread = threading.Thread(
        target=lambda: out.append(score_completions(["\\boxed{\\sqrt{18}}"], ["3\\sqrt2"], verifier=verifier))
    )
    thread.start()
    thread.join(timeout=120)
    assert out == [[1.0]]


# --------------------------------------------------------------------------- TRL signature and format reward


def test_trl_reward_answer_column_is_configurable_and_required(verifier):
    reward = CorrectnessReward(answer_key="solution_value", verifier=verifier)
    assert reward.__name__ == "correctness"
    assert reward(["\\boxed{7}", "\\boxed{8}"], solution_value=["7", "7"]) == [1.0, 0.0]
    with pytest.raises(KeyError, match="solution_value"):
        reward(["\\boxed{7}"], answer=["7"])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        score_completions(["a", "b"], ["1"], verifier=verifier)


def test_format_reward():
    completions = ["x \\boxed{3}", "x = 3", "\\boxed{}", [{"role": "assistant", "content": "\\boxed{a}"}]]
    assert format_reward(completions, answer=["3"] * 4) == [1.0, 0.0, 0.0, 1.0]


def test_worker_startup_failure_is_a_clear_error_and_recoverable(monkeypatch):
    import sys

    verifier = MathVerifier(num_workers=1, startup_timeout=30.0)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the worker interpreter cannot start
    with pytest.raises(RuntimeError, match=r"exited during startup \(exit code 1\)"):
        verifier.equal_many([("3\\sqrt{2}", "\\sqrt{18}")])
    monkeypatch.undo()
    assert verifier.equal_many([("3\\sqrt{2}", "\\sqrt{18}")], timeout=60.0) == [True]
    verifier.close()


def test_two_workers_share_the_pairs_and_a_hang_stalls_neither():
    verifier = MathVerifier(num_workers=2)
    pairs = [("1", HANG.split("is ")[-1]), *[("3\\sqrt{13}", "\\sqrt{117}")] * 3, ("3\\sqrt{13}", "13\\sqrt{3}")]
    assert verifier.equal_many(pairs, timeout=2.0)[1:] == [True, True, True, False]
    assert verifier.stats.timeouts == 1 and verifier.stats.errors == 0
    assert verifier.equal_many(pairs[1:3] * 2, timeout=60.0) == [True] * 4
    assert len(verifier._workers) == 2 and all(w.alive for w in verifier._workers)  # the hung one was replaced
    verifier.close()
    assert verifier._workers == []


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_a_non_positive_timeout_is_refused_before_any_answer_is_scored(timeout):
    from trustclip.rewards import CorrectnessReward, score_completions

    with pytest.raises(ValueError, match="timeout must be > 0 seconds"):
        score_completions(["\\boxed{1}"], ["1"], timeout=timeout)  # the fast path alone would score it 1.0
    with pytest.raises(ValueError, match="timeout must be > 0 seconds"):
        CorrectnessReward(timeout=timeout)


def test_a_killed_worker_reads_as_dead_before_it_is_reaped():
    from trustclip.rewards.verifier import _Worker

    worker = _Worker(memory_mb=2048, startup_timeout=60.0)
    worker.proc.stdin.close()  # what kill() leaves when the process has not exited yet
    assert not worker.alive
    worker.kill()
