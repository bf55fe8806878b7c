"""The SmolLM2 recipes and the data they read: the GSM8K train layout (question / "... #### N"), benchmark specs that
keep some rows (`?level=1,2`), and the recipes' settings. Fast: no model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trustclip.data import load_benchmark_specs, load_prompts
from trustclip.settings import load_config

ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_train_layout_gives_problem_answer_and_a_boxed_solution(tmp_path):
    rows = [{"question": "Natalia sold clips to 48 friends in April and half as many in May. How many in all?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 in all.\n"
                       "#### 72"},
            {"question": "A big sum?", "answer": "It is 1000 + 72 = <<1000+72=1072>>1072.\n#### 1,072"},
            {"question": "Kept?", "answer": "Two.\n#### 2", "solution": "my own worked solution"}]
    loaded = load_prompts(write_jsonl(tmp_path / "train.jsonl", rows))
    assert [r["problem"] for r in loaded] == [r["question"] for r in rows]
    assert [r["answer"] for r in loaded] == ["72", "1,072", "2"]
    assert loaded[0]["solution"] == ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 in all.\n"
                                     "The final answer is \\boxed{72}.")
    assert loaded[2]["solution"] == "my own worked solution"  # a record's own solution is kept
    assert "question" not in loaded[0]
    plain = load_prompts(write_jsonl(tmp_path / "plain.jsonl", [{"problem": "1+1?", "answer": "2"}]))
    assert "solution" not in plain[0]  # only the "#### N" layout gets one


def test_benchmark_spec_keeps_the_rows_of_some_levels(tmp_path):
    rows = [{"problem": f"p{i}", "answer": str(i), "level": 1 + i % 5} for i in range(20)]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    specs = load_benchmark_specs([f"easy={path}?level=1,2", f"all={path}"], limit=5)
    assert [r["level"] for r in specs["easy"]] == [1, 2, 1, 2, 1]  # the limit applies after the selection
    assert len(specs["all"]) == 5
    with pytest.raises(ValueError, match=r"no row has a field 'difficulty'"):
        load_benchmark_specs([f"x={path}?difficulty=1"])
    with pytest.raises(ValueError, match=r"no row has level in \[7\]"):
        load_benchmark_specs([f"x={path}?level=7"])
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        load_benchmark_specs([f"x={path}?level"])


def test_math500_levels_one_and_two(shared_data_dir):
    rows = load_benchmark_specs([f"m={shared_data_dir / 'math500.jsonl'}?level=1,2"])["m"]
    assert len(rows) == 133 and {r["level"] for r in rows} == {1, 2}


@pytest.mark.parametrize("name", ["smollm2_arith", "smollm2_gsm8k"])
def test_smollm2_recipes_load_with_lora_and_off_policy_updates(name):
    from trustclip import get_objective
    from trustclip.models import SMOLLM2_MODEL_NAME

    config = load_config(ROOT / "recipes" / f"{name}.yaml")
    get_objective(config.rl.objective, **config.rl.objective_kwargs)
    m, r = config.model, config.rl
    assert (m.name_or_path, m.lora, m.lora_r, m.lora_alpha) == (SMOLLM2_MODEL_NAME, True, 32, 64)
    assert r.objective == "kl3"
    # off-policy updates (the constraint acts): several updates per generation batch, or several optimizer steps
    generate_every = (r.steps_per_generation or r.gradient_accumulation_steps) * r.num_iterations
    assert generate_every > r.gradient_accumulation_steps
    assert config.data.prompt_style == "math" and config.stages == ["sft", "rl", "eval"]


def test_gsm8k_recipe_reads_no_eval_set_for_training_and_its_benchmarks_load(shared_data_dir):
    from trustclip.run_data import load_benchmarks

    config = load_config(ROOT / "recipes" / "smollm2_gsm8k.yaml")
    assert config.data.train == "openai/gsm8k" and config.data.train_split == "train"
    assert config.sft.data is None  # SFT on the first rows of the same training split
    config.data.eval = [spec.replace("../shared/data", str(shared_data_dir)) for spec in config.data.eval]
    benchmarks = load_benchmarks(config)
    assert {name: len(rows) for name, rows in benchmarks.items()} == {"gsm8k": 1319, "math500_l12": 133, "amc23": 83}


def test_offpolicy_recipe_is_the_arith_recipe_with_stale_updates_and_room_for_length():
    """recipes/smollm2_offpolicy.yaml (make smollm2-compare) changes only what makes the constraint act and leaves
    the entropy and length free: 4 optimizer steps per generation batch instead of 2, T = 1.0, a lighter SFT and a
    96-token budget (training and evaluation alike); model, data, precision and the evaluation protocol are the
    arith recipe's."""
    arith = load_config(ROOT / "recipes" / "smollm2_arith.yaml")
    off = load_config(ROOT / "recipes" / "smollm2_offpolicy.yaml")

    def updates_per_batch(r):
        return (r.steps_per_generation or r.gradient_accumulation_steps) // r.gradient_accumulation_steps \
            * r.num_iterations

    assert (updates_per_batch(arith.rl), updates_per_batch(off.rl)) == (2, 4)
    assert (off.rl.objective, off.rl.objective_kwargs, off.rl.temperature) == ("clip", {"epsilon": 0.2}, 1.0)
    assert off.rl.max_completion_length == off.eval.max_new_tokens == 2 * arith.rl.max_completion_length
    assert off.sft.max_steps < arith.sft.max_steps
    assert (off.model, off.data, off.bf16) == (arith.model, arith.data, arith.bf16)
    assert (off.eval.k, off.eval.temperature, off.rl.learning_rate) == (arith.eval.k, arith.eval.temperature,
                                                                         arith.rl.learning_rate)
