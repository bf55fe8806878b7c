"""Data loading, prompt templates, the synthetic task, and the tiny offline model/tokenizer."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from trustclip.data import loaders
from trustclip.data.loaders import DataFormatError, load_benchmark_specs, load_prompts
from trustclip.data.synthetic import LEVELS, ArithmeticLevel, make_problem, make_synthetic_splits, sft_examples
from trustclip.data.templates import MATH_TEMPLATE, build_prompt_rows, format_prompt, resolve_template

ROWS = [
    {"id": "a", "problem": "What is 1+1?", "answer": "2"},
    {"id": "b", "problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}"},
]
DAPO_WRAPPED = loaders.DAPO_PREFIX + "What is the greatest power of 2 dividing 96?" + loaders.DAPO_SUFFIX
DAPO_ROWS = [
    {
        "data_source": "DAPO-17k",
        "prompt": [{"role": "user", "content": DAPO_WRAPPED}],
        "reward_model": {"ground_truth": "32", "style": "rule"},
        "extra_info": {"index": 7},
    },
    {
        "data_source": "DAPO-17k",
        "prompt": [{"role": "user", "content": "Find x if 2x = 10."}],
        "reward_model": {"ground_truth": "5", "style": "rule"},
        "extra_info": {"index": 8},
    },
]


def write_jsonl(path: Path, records: list, raw_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in records]
    for idx, text in (raw_lines or {}).items():
        lines.insert(idx, text)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, records: list) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


# --------------------------------------------------------------------------- loading each format


def test_load_jsonl_json_and_parquet_agree(tmp_path):
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    array = tmp_path / "p.json"
    array.write_text(json.dumps(ROWS, indent=2), encoding="utf-8")
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": ROWS}), encoding="utf-8")
    parquet = write_parquet(tmp_path / "p.parquet", ROWS)
    expected = [{"id": r["id"], "problem": r["problem"], "answer": r["answer"]} for r in ROWS]
    for path in (jsonl, array, wrapped, parquet):
        assert load_prompts(path) == expected, path


def test_jsonl_content_with_json_suffix_loads(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", ROWS)
    assert [r["answer"] for r in load_prompts(path)] == ["2", "\\frac{1}{2}"]


def test_custom_field_names_numeric_answers_and_default_ids(tmp_path):
    path = write_jsonl(
        tmp_path / "amc.jsonl",
        [{"question": "Q1", "solution_value": 142.0, "url": "u"}, {"question": "Q2", "solution_value": 7}],
    )
    rows = load_prompts(path, problem_key="question", answer_key="solution_value")
    assert [r["answer"] for r in rows] == ["142", "7"]  # 142.0 (AMC sources) becomes "142"
    assert [r["id"] for r in rows] == ["amc-0", "amc-1"]
    assert rows[0]["url"] == "u"  # scalar extra fields are kept
    assert load_prompts(path, problem_key="question", answer_key="solution_value", limit=1) == rows[:1]


def test_dapo_hub_layout_in_jsonl_and_parquet(tmp_path):
    for path in (write_jsonl(tmp_path / "dapo.jsonl", DAPO_ROWS), write_parquet(tmp_path / "dapo.parquet", DAPO_ROWS)):
        rows = load_prompts(path)
        # The DAPO "Answer:" instruction wrapper is stripped: our template asks for \boxed{} instead.
        assert rows[0]["problem"] == "What is the greatest power of 2 dividing 96?"
        assert rows[1]["problem"] == "Find x if 2x = 10."
        assert [r["answer"] for r in rows] == ["32", "5"]
        assert [r["id"] for r in rows] == ["7", "8"]
        assert "prompt" not in rows[0] and "reward_model" not in rows[0]
        assert rows[0]["data_source"] == "DAPO-17k"


def test_hub_id_goes_through_datasets_load_dataset(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(name, subset=None, split=None):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list(DAPO_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    rows = load_prompts("BytedTsinghua-SIA/DAPO-Math-17k", split="train")
    assert calls == [("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")]
    assert [(r["problem"], r["answer"]) for r in rows] == [
        ("What is the greatest power of 2 dividing 96?", "32"),
        ("Find x if 2x = 10.", "5"),
    ]


def test_hub_failure_is_reported_with_the_dataset_name(monkeypatch):
    import datasets

    def broken(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", broken)
    with pytest.raises(DataFormatError, match=r"'org/missing'.*HF_HUB_OFFLINE"):
        load_prompts("org/missing")


def test_shared_benchmark_files_load_as_they_are(shared_data_dir):
    expected = {
        "aime2024": 30,
        "aime2025": 30,
        "amc2023": 83,
        "amc2023_40": 40,
        "math500": 500,
        "gsm8k_test": 1319,
        "dapo_math_17k": 17917,
    }
    for stem, n_rows in expected.items():
        rows = load_prompts(shared_data_dir / f"{stem}.jsonl")
        assert len(rows) == n_rows, stem
        assert all(r["problem"] and r["answer"] for r in rows), stem
    assert load_prompts(shared_data_dir / "aime2024.jsonl")[0]["answer"] == "204"


# --------------------------------------------------------------------------- malformed files


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("bad.jsonl", '{"problem": "p", "answer": "1"}\n{"problem": "p2", "answer": \n', r"bad\.jsonl:2: invalid JSON"),
        (
            "missing.jsonl",
            '{"problem": "p", "answer": "1"}\n\n{"problem": "p3"}\n',
            r"missing\.jsonl:3: missing field 'answer'",
        ),
        ("noprob.jsonl", '{"question": "p", "answer": "1"}\n', r"noprob\.jsonl:1: missing field 'problem'"),
        ("empty.jsonl", "", r"empty\.jsonl: empty file"),
        ("blank.jsonl", "\n  \n\n", r"blank\.jsonl: empty file"),
        ("empty.json", "  ", r"empty\.json: empty file"),
        ("emptyarr.json", "[]", r"emptyarr\.json: empty file"),
        (
            "arr.json",
            '[\n  {"problem": "p", "answer": "1"},\n  {"problem": "q"}\n]',
            r"arr\.json:3: missing field 'answer'",
        ),
        ("badarr.json", '[\n  {"problem": "p", "answer": "1"},\n  {"problem": \n]', r"badarr\.json:4: invalid JSON"),
        ("notobj.jsonl", '["p", "1"]\n', r"notobj\.jsonl:1: expected a JSON object"),
        ("emptyans.jsonl", '{"problem": "p", "answer": "  "}\n', r"emptyans\.jsonl:1: field 'answer' must be"),
        ("nullprob.jsonl", '{"problem": null, "answer": "1"}\n', r"nullprob\.jsonl:1: field 'problem' is null"),
        ("data.csv", "problem,answer\n", r"data\.csv: unsupported file type"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, name, content, pattern):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataFormatError, match=pattern):
        load_prompts(path)


def test_malformed_parquet_names_the_row(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"problem": "p", "answer": "1"}, {"problem": "q", "answer": None}])
    with pytest.raises(DataFormatError, match=r"p\.parquet: row 1: field 'answer' is null"):
        load_prompts(path)
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"not a parquet file")
    with pytest.raises(DataFormatError, match=r"corrupt\.parquet: cannot read parquet"):
        load_prompts(corrupt)


def test_missing_file_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")


def test_benchmark_specs(tmp_path):
    path = write_jsonl(tmp_path / "mini.jsonl", ROWS)
    specs = load_benchmark_specs([f"first={path}", str(path).replace("mini", "mini"), "builtin"], limit=3)
    assert list(specs) == ["first", "mini", "amc_like", "aime24_like", "aime25_like"]
    assert len(specs["first"]) == 2 and len(specs["aime24_like"]) == 3
    with pytest.raises(ValueError, match="given twice"):
        load_benchmark_specs([f"x={path}", f"x={path}"])
    with pytest.raises(ValueError, match="NAME=FILE"):
        load_benchmark_specs([f"={path}"])
    with pytest.raises(ValueError, match="unknown builtin split"):
        load_prompts("builtin:nope")


@pytest.mark.parametrize(("stored", "written"), [
    (0.00001, "0.00001"), (1e-7, "0.0000001"), (2.5e-07, "0.00000025"), (-3e-6, "-0.000003"), (0.125, "0.125"),
])
def test_small_decimal_answers_keep_the_form_people_write(tmp_path, stored, written):
    """A JSON number answer is kept as positional decimal text (not '1e-05'), so a correct boxed answer scores 1."""
    from trustclip.rewards import score_completions

    path = tmp_path / "small.jsonl"
    path.write_text(json.dumps({"problem": "x?", "answer": stored}) + "\n")
    row = load_prompts(path)[0]
    assert row["answer"] == written
    assert score_completions([f"so \\boxed{{{written}}}"], [row["answer"]], timeout=20.0) == [1.0]


def _leveled(tmp_path: Path) -> Path:
    rows = [{"problem": f"p{i}", "answer": str(i), "level": [1, 2, 1.0, 3][i % 4],
             "subject": ["Algebra", "Geometry"][i % 2], "flag": i % 3 == 0, "tag": ["1", "a & b"][i % 2]}
            for i in range(12)]
    return write_jsonl(tmp_path / "leveled.jsonl", rows)


def test_benchmark_filters_compare_json_values_over_several_fields(tmp_path):
    path = _leveled(tmp_path)
    one = load_benchmark_specs([f"x={path}?level=1"])["x"]
    assert len(one) == 6 and {r["level"] for r in one} == {1}  # the 1.0 rows are level 1 too
    both = load_benchmark_specs([f"x={path}?level=1,2&subject=Algebra"])["x"]
    assert both and all(r["level"] in (1, 2) and r["subject"] == "Algebra" for r in both)
    assert len(both) == sum(1 for i in range(12) if i % 4 in (0, 2) and i % 2 == 0)
    assert {r["flag"] for r in load_benchmark_specs([f"x={path}?flag=true"])["x"]} == {True}
    assert {r["tag"] for r in load_benchmark_specs([f'x={path}?tag="1"'])["x"]} == {"1"}  # the string "1"
    assert {r["tag"] for r in load_benchmark_specs([f"x={path}?tag=a %26 b"])["x"]} == {"a & b"}
    assert [r["answer"] for r in load_benchmark_specs([f"x={path}?answer=3,5"])["x"]] == ["3", "5"]  # loaded as text


@pytest.mark.parametrize(("query", "message"), [
    ("level=1,7", r"no row has level in \[7\]"),
    ("level=1,2&subject=Algebra&topic=x", r"no row has a field 'topic'"),
    ("level=1&level=2", r"field 'level' is given twice"),
    ("subject=Algebra&", r"expected NAME=SOURCE\?FIELD=VALUE"),
    ("tag=1", r"no row has tag in \[1\]"),  # the number 1 is not the string "1"
    ("level=3&subject=Algebra", "no row matches every filter at once"),
])
def test_a_filter_value_that_matches_nothing_is_an_error(tmp_path, query, message):
    path = _leveled(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_benchmark_specs([f"x={path}?{query}"])


# --------------------------------------------------------------------------- synthetic task


def _evaluate_expression(problem: str) -> int:
    expr = re.fullmatch(r"Compute (.+)\.", problem).group(1)
    assert re.fullmatch(r"[\d+\-*() ]+", expr), expr
    return eval(expr)  # safe: only digits and + - * ( ) pass the check above


def test_synthetic_splits_are_deterministic_and_seed_dependent():
    a = make_synthetic_splits(seed=3, n_train=200, n_eval=20)
    assert a == make_synthetic_splits(seed=3, n_train=200, n_eval=20)
    b = make_synthetic_splits(seed=4, n_train=200, n_eval=20)
    assert [r["problem"] for r in a["train"]] != [r["problem"] for r in b["train"]]


def test_synthetic_held_out_splits_do_not_overlap_train_or_each_other():
    splits = make_synthetic_splits(seed=0, n_train=3000, n_eval=64)
    assert list(splits) == ["train", "amc_like", "aime24_like", "aime25_like"]
    problems = {name: [r["problem"] for r in rows] for name, rows in splits.items()}
    for name, ps in problems.items():
        assert len(ps) == len(set(ps)), f"duplicates inside {name}"
    names = list(problems)
    for i, x in enumerate(names):
        for y in names[i + 1 :]:
            assert not set(problems[x]) & set(problems[y]), (x, y)
    ids = [r["id"] for rows in splits.values() for r in rows]
    assert len(ids) == len(set(ids))


def test_synthetic_rows_are_correct_and_in_the_math_format():
    splits = make_synthetic_splits(seed=1, n_train=400, n_eval=40)
    for rows in splits.values():
        for row in rows:
            assert set(row) == {"id", "problem", "answer", "solution", "level"}
            assert row["answer"] == str(_evaluate_expression(row["problem"]))
            assert row["solution"].endswith(f"\\boxed{{{row['answer']}}}")
            # Each step of the worked solution is true arithmetic.
            for lhs, rhs in re.findall(r"(-?\d+[+\-*]\d+)=(-?\d+)\.", row["solution"]):
                assert eval(lhs) == int(rhs), row
            assert len(row["problem"]) <= 25 and len(row["solution"]) <= 40, row


def test_synthetic_difficulty_increases_across_held_out_splits():
    splits = make_synthetic_splits(seed=0, n_train=100, n_eval=30)
    levels = {name: {r["level"] for r in rows} for name, rows in splits.items()}
    assert levels["amc_like"] == {1, 2} and levels["aime24_like"] == {3} and levels["aime25_like"] == {4}
    assert levels["train"] == {1, 2, 3, 4}
    steps = {name: max(r["solution"].count("=") for r in rows) for name, rows in splits.items()}
    assert steps["amc_like"] < steps["aime24_like"] <= steps["aime25_like"]
    assert all("*" in r["problem"] for r in splits["aime25_like"])
    assert not any("*" in r["problem"] for r in splits["aime24_like"])


def test_synthetic_bad_arguments_and_exhaustion(monkeypatch):
    with pytest.raises(ValueError, match="'train': unknown level 9"):
        make_synthetic_splits(train_levels=(9,))
    with pytest.raises(ValueError, match="split 'x' has no levels"):
        make_synthetic_splits(eval_splits={"x": ()})
    easy = ArithmeticLevel(2, "+", lo=0, hi=9)
    custom = make_synthetic_splits(n_train=20, n_eval=5, train_levels=(easy,), eval_splits={"easy": (easy,)})
    assert all(_evaluate_expression(r["problem"]) <= 18 for rows in custom.values() for r in rows)
    with pytest.raises(ValueError, match="n_operands must be >= 2"):
        ArithmeticLevel(1, "+")
    monkeypatch.setitem(LEVELS, 99, ArithmeticLevel(2, "+", lo=0, hi=1))  # only 4 distinct problems
    with pytest.raises(ValueError, match="could only draw 4 distinct problems for split 'small'"):
        make_synthetic_splits(n_train=0, n_eval=5, eval_splits={"small": (99,)})
    import random

    assert make_problem(LEVELS[1], random.Random(0))["level"] == 1
    assert make_problem(dataclasses.replace(LEVELS[3], hi=9), random.Random(0))["level"] == 3  # keeps its number
    assert make_problem(easy, random.Random(0))["level"] == repr(easy)  # custom: recorded by its repr


def test_synthetic_level_that_runs_out_drops_out_and_the_others_fill_in():
    # Two-operand sums of 0..9 give only 100 distinct problems; the three-operand level fills the rest.
    small, big = ArithmeticLevel(2, "+", lo=0, hi=9), ArithmeticLevel(3, "+-", lo=0, hi=9)
    rows = make_synthetic_splits(n_train=400, n_eval=10, train_levels=(small, big),
                                 eval_splits={"held": (small,)})["train"]
    counts = {lv: sum(r["level"] == repr(lv) for r in rows) for lv in (small, big)}
    assert counts[small] == 90 and counts[big] == 310  # every small problem not held out, then only big ones
    assert len({r["problem"] for r in rows}) == 400
    # Before a level runs out the round robin is exact.
    assert [r["level"] for r in rows[:6]] == [repr(small), repr(big)] * 3


def test_sft_examples_use_the_tiny_template(tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    rows = make_synthetic_splits(seed=0, n_train=5, n_eval=1)["train"]
    examples = sft_examples(rows, tokenizer)
    assert examples[0]["prompt"] == f"{rows[0]['problem']}\n"
    assert [e["completion"] for e in examples] == [r["solution"] for r in rows]
    for e in examples:  # every character is in the tiny vocabulary (no <unk>)
        ids = tokenizer(e["prompt"] + e["completion"])["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert 12 <= len(e["prompt"]) <= 25
    with pytest.raises(ValueError, match="no 'solution'"):
        sft_examples(ROWS)


# --------------------------------------------------------------------------- templates


def test_math_template_is_the_paper_style():
    text = format_prompt("What is 1+1?")
    assert text == MATH_TEMPLATE.replace("{problem}", "What is 1+1?")
    assert "step by step" in text and "\\boxed{}" in text


def test_template_goes_through_the_chat_template(tiny_model_path):
    from trustclip.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    text = format_prompt("2+2?", tokenizer, style="math", system_prompt="Be brief.")
    assert text == (
        "<system>Be brief.</system><user>2+2?\nPlease reason step by step, and put your final answer "
        "within \\boxed{}.</user><assistant>"
    )
    # The tiny tokenizer is marked for the short prompt; "auto" picks it.
    assert resolve_template("auto", tokenizer) == resolve_template("tiny")
    assert resolve_template("auto", None) == MATH_TEMPLATE


def test_custom_and_bad_templates():
    assert format_prompt("x{y}", style="Q: {problem}\nA: \\boxed{}") == "Q: x{y}\nA: \\boxed{}"
    with pytest.raises(ValueError, match="unknown prompt style 'fancy'"):
        format_prompt("x", style="fancy")
    rows = build_prompt_rows(ROWS, style="raw")
    assert rows[0]["prompt"] == "What is 1+1?" and rows[0]["answer"] == "2"
    conv = build_prompt_rows(ROWS, style="raw", conversational=True)
    assert conv[1]["prompt"] == [{"role": "user", "content": ROWS[1]["problem"]}]


# --------------------------------------------------------------------------- tiny model


def test_tiny_model_round_trip_offline(tiny_model_path, tiny_model_and_tokenizer):
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    model, tokenizer = tiny_model_and_tokenizer
    assert model.config.model_type == "qwen3"
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    reloaded = AutoTokenizer.from_pretrained(tiny_model_path)
    assert reloaded.padding_side == "left"  # saved because it was passed to the constructor
    text = "Compute (12+35)*7. Answer in \\boxed{}.\n12+35=47. 47*7=329. \\boxed{329}"
    ids = reloaded(text)["input_ids"]
    assert len(ids) == len(text) and reloaded.decode(ids) == text
    assert reloaded.unk_token_id not in ids
    gen = AutoModelForCausalLM.from_pretrained(tiny_model_path).generation_config
    assert (gen.pad_token_id, gen.eos_token_id) == (tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_tiny_model_cache_is_reused_and_keyed_by_config(tmp_path):
    from trustclip.models import build_tiny_model

    first = build_tiny_model(cache_dir=tmp_path, hidden_size=64, num_layers=1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(cache_dir=tmp_path, hidden_size=64, num_layers=1) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = build_tiny_model(cache_dir=tmp_path, hidden_size=64, num_layers=1, seed=1)
    assert other != first and first.name.startswith("tiny-qwen3-")
