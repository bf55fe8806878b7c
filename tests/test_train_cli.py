"""`trustclip train`: configuration and recipes, the paper recipe's wiring end to end on a tiny model with
DAPO-format rows, SIGKILL + --resume, and a 2-process gloo run (accelerate launch --cpu)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trustclip.settings import TrainConfig, load_config, option_table

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
PAPER_RECIPES = sorted((ROOT / "recipes").glob("qwen3_1.7b_*.yaml"))


# ------------------------------------------------------------------ configuration
def test_defaults_are_the_embedded_cpu_run():
    config = load_config()
    assert config.model.name_or_path == "builtin:tiny"
    assert (config.rl.objective, config.rl.objective_kwargs) == ("kl3", {"delta": 0.07})
    assert config.stages == ["sft", "rl", "eval"]
    assert config.rl.num_iterations >= 2  # off-policy updates, so the constraint acts


def test_builtin_rows_follow_the_data_options():
    from trustclip.run_data import load_benchmarks, load_rows

    config = load_config(None, ["data.builtin_n_train=50", "data.builtin_train_levels=[3,4]"])
    train = load_rows("builtin:train", config, split="train")
    assert len(train) == 50 and {r["level"] for r in train} == {3, 4}  # level numbers, also with max_operand set
    numbers = [int(n) for r in train for n in re.findall(r"\d+", r["problem"])]
    assert max(numbers) == 9  # data.builtin_max_operand (multipliers are one digit anyway)
    held_out = load_benchmarks(config)
    assert {name: {r["level"] for r in rows} for name, rows in held_out.items()} == {
        "amc_like": {1, 2}, "aime24_like": {3}, "aime25_like": {4}}
    assert not {r["problem"] for r in train} & {r["problem"] for rows in held_out.values() for r in rows}


def test_sft_takes_the_first_rows_of_the_rl_pool():
    from trustclip.run_data import load_rows
    from trustclip.train.stages import sft_rows

    default = load_config()
    assert default.sft.limit < default.data.builtin_n_train  # SFT for format on a part, RL on the whole pool
    config = load_config(None, ["data.builtin_n_train=60", "sft.limit=12"])
    pool = load_rows("builtin:train", config, split="train")
    assert len(pool) == 60
    assert [r["problem"] for r in sft_rows(config)] == [r["problem"] for r in pool[:12]]
    config = load_config(None, ["data.builtin_n_train=60", "sft.limit=null"])
    assert len(sft_rows(config)) == 60


def test_reward_and_eval_share_the_answer_format():
    from trustclip.train.stages import eval_config, reward_function

    unboxed = ["1+1=2. \\box}"]  # right last number, format dropped
    config = load_config()
    assert eval_config(config).answer_fallback is False  # boxed answer required by default
    assert reward_function(config)(unboxed, answer=["2"]) == [0.0]
    config = load_config(None, ["data.answer_fallback=true"])
    assert eval_config(config).answer_fallback is True
    assert reward_function(config)(unboxed, answer=["2"]) == [1.0]


def test_overrides_and_clear_errors(tmp_path):
    config = load_config(None, ["rl.learning_rate=1e-5", "rl.objective_kwargs={delta: 0.1}", "data.eval=[a=x.jsonl]",
                                "stages=rl,eval"])
    assert config.rl.learning_rate == 1e-5 and config.rl.objective_kwargs == {"delta": 0.1}
    assert config.data.eval == ["a=x.jsonl"] and config.stages == ["rl", "eval"]
    with pytest.raises(ValueError, match="rl.learning_rat"):
        load_config(None, ["rl.learning_rat=1e-5"])
    with pytest.raises(ValueError, match="rl.max_steps='many' is invalid: input should be a valid integer"):
        load_config(None, ["rl.max_steps=many"])
    with pytest.raises(ValueError, match="rl.temperature=0.0 is invalid"):
        load_config(None, ["rl.temperature=0"])
    with pytest.raises(ValueError, match="stages="):
        load_config(None, ["stages=[sft, train]"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl: [1, 2\n")
    with pytest.raises(ValueError, match="invalid YAML"):
        load_config(bad)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads_and_its_objective_is_valid(recipe, tmp_path):
    from trustclip.train.stages import grpo_config

    grpo_config(load_config(recipe), tmp_path)  # TrustClipGRPOConfig checks the objective and its hyper-parameters


@pytest.mark.parametrize("recipe", PAPER_RECIPES, ids=[p.stem for p in PAPER_RECIPES])
def test_recipes_load_with_the_papers_settings(recipe):
    from trustclip import get_objective

    config = load_config(recipe)
    get_objective(config.rl.objective, **config.rl.objective_kwargs)
    r, m = config.rl, config.model
    assert (m.name_or_path, m.lora, m.lora_r, m.lora_alpha) == ("Qwen/Qwen3-1.7B", True, 32, 64)
    assert (r.learning_rate, r.weight_decay, r.per_device_train_batch_size, r.gradient_accumulation_steps) == (
        5e-6, 1e-3, 8, 4)
    assert (r.num_generations, r.temperature, r.top_p, r.beta) == (8, 1.0, 1.0, 0.0)
    assert (r.max_steps, r.eval_every) == (1000, 50)
    assert (r.aggregation, r.advantage_estimator, r.skip_zero_advantage) == ("dr_grpo", "dr_grpo", False)
    assert (config.eval.k, config.eval.temperature, config.eval.top_p) == (8, 0.3, 0.95)
    assert len(config.data.eval) == 3


def test_help_documents_every_option(capsys):
    from trustclip.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for name, _, _ in option_table():
        assert name in text, name
    for flag in ("--config", "--objective", "--set", "--output-dir", "--resume", "--stages", "--skip"):
        assert flag in text


def test_objective_flag_resets_hyperparameters():
    import argparse

    from trustclip.commands.train import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build_config(parser.parse_args(["--objective", "clip_higher", "--skip", "sft"]))
    assert (config.rl.objective, config.rl.objective_kwargs, config.stages) == ("clip_higher", {}, ["rl", "eval"])


# ------------------------------------------------------------------ end to end
def tiny_overrides(model_path: Path, out: Path, **extra: object) -> list[str]:
    values = {
        "output_dir": str(out), "model.name_or_path": str(model_path), "report_to": "[]",
        "data.eval_limit": 4, "eval.k": 2, "eval.max_new_tokens": 12, "eval.batch_size": 64,
        "rl.max_steps": 2, "rl.per_device_train_batch_size": 8, "rl.num_generations": 4,
        "rl.max_completion_length": 12, "rl.save_steps": 1, "rl.learning_rate": 1e-4, "sft.max_steps": 2,
        "sft.per_device_train_batch_size": 8, "sft.limit": 32, "data.train_limit": 64, "plots": True,
    } | extra
    return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_paper_recipe_wiring_with_dapo_rows(tiny_model_path, tmp_path):
    """The Qwen3-1.7B recipe end to end (LoRA, SFT, Dr.GRPO + kl3, eval, tensorboard) on a tiny model and rows in
    the verl / DAPO-Math-17k layout; only sizes are overridden."""
    from trustclip.train.pipeline import run_pipeline

    dapo = [{"data_source": "DAPO-17k", "prompt": [{"role": "user", "content": f"What is {a} plus {a + 1}?"}],
             "reward_model": {"ground_truth": str(2 * a + 1), "style": "rule"}, "extra_info": {"index": a}}
            for a in range(12)]
    train = write_jsonl(tmp_path / "dapo.jsonl", dapo)
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"problem": f"{a}+{a}?", "generated_solution": f"\\boxed{{{2 * a}}}",
                                               "expected_answer": str(2 * a)} for a in range(16)])
    bench = write_jsonl(tmp_path / "amc.jsonl",
                        [{"id": i, "problem": f"{i}+1?", "answer": str(i + 1)} for i in range(4)])
    out = tmp_path / "run"
    config = load_config(ROOT / "recipes" / "qwen3_1.7b_atr.yaml", tiny_overrides(
        tiny_model_path, out, **{"data.train": str(train), "sft.data": str(sft), "data.eval": f"[amc23={bench}]",
                                 "model.dtype": "float32", "sft.max_length": 128, "sft.gradient_accumulation_steps": 1,
                                 "rl.gradient_accumulation_steps": 2, "rl.eval_every": 2, "eval.max_new_tokens": 8,
                                 "report_to": "[tensorboard]", "data.prompt_style": "tiny"}))
    assert config.model.lora and config.rl.objective == "kl3" and config.sft.solution_key == "generated_solution"
    summary = run_pipeline(config, printer=lambda _: None)

    assert set(summary["accuracy_before"]) == set(summary["accuracy_after"]) == {"amc23", "average"}
    for value in [*summary["accuracy_before"].values(), *summary["accuracy_after"].values()]:
        assert 0.0 <= value <= 1.0
    assert {"sft", "eval_before", "rl", "eval_after", "total"} <= set(summary["seconds"])
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "rl" / "final" / "adapter_config.json").is_file()  # LoRA adapter, as in the paper
    assert (out / "sft" / "final" / "config.json").is_file()  # SFT adapter merged into full weights
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in lines if r["stage"] == "rl" and "loss" in r]
    assert [r["step"] for r in rl] == [1, 2]
    for key in ("reward", "entropy", "clip_ratio/low_mean", "objective/clip_frac_high", "objective/kl3_mean",
                "objective/ratio_max", "completions/mean_length", "frac_reward_zero_std", "reward/timeouts"):
        assert key in rl[0], key
    assert "eval/amc23/mean@2" in rl[1]  # periodic evaluation every 2 steps
    assert any(r["stage"] == "sft" for r in lines)
    for name in ("reward", "entropy", "completion_length", "clip_fractions", "training_curves"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000
    assert list((out / "rl").rglob("events.out.tfevents*")), "tensorboard (report_to) wrote nothing"


def cli_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_bad_data_file_is_reported(tiny_model_path, tmp_path):
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": oops}\n')
    args = [sys.executable, "-m", "trustclip.cli", "train", "--skip", "sft,eval", "--set", f"data.train={bad}",
            *[a for o in tiny_overrides(tiny_model_path, tmp_path / "run") for a in ("--set", o)]]
    proc = subprocess.run(args, capture_output=True, text=True, env=cli_env(tmp_path), timeout=300)
    assert proc.returncode == 1
    assert f"{bad}:2: invalid JSON" in proc.stderr


def kill_at_checkpoint(args: list[str], env: dict[str, str], checkpoint: Path) -> None:
    """Start `trustclip` with `args` and SIGKILL it as soon as `checkpoint` is complete."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = checkpoint / "trainer_state.json"
    deadline = time.time() + 240
    while not marker.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.is_file(), f"no checkpoint appeared; output:\n{proc.communicate()[0][-3000:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_then_resume_completes(tiny_model_path, tmp_path):
    out = tmp_path / "run"
    sets = tiny_overrides(tiny_model_path, out, **{"rl.max_steps": 8, "rl.save_steps": 2, "rl.save_total_limit": 2})
    args = [sys.executable, "-m", "trustclip.cli", "train", "--skip", "sft", *[a for o in sets for a in ("--set", o)]]
    env = cli_env(tmp_path)
    kill_at_checkpoint(args, env, out / "rl" / "checkpoint-2")
    state = json.loads((out / "state.json").read_text())
    assert "rl" not in state and "eval_before" in state  # killed during RL

    resumed = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    state = json.loads((out / "state.json").read_text())
    assert state["rl"]["steps"] == 8 and state["eval_after"]["done"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["stage"] == "rl" and "loss" in json.loads(line)]
    assert steps == list(range(1, 9))  # each step logged once: lines after the checkpoint were dropped
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["accuracy_after"]) == {"amc_like", "aime24_like", "aime25_like", "average"}


TWO_PROCESS_SCRIPT = r'''
import json, sys, torch
from accelerate import PartialState
from datasets import Dataset
from trustclip import compute_policy_loss, get_objective
from trustclip.models import load_model_and_tokenizer
from trustclip.integrations.trl import TrustClipGRPOConfig, TrustClipGRPOTrainer
from trustclip.integrations.trl.compat import checkpointing_off
from trustclip.settings import load_config
from trustclip.train.pipeline import run_pipeline

model_path, out, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
state = PartialState(cpu=True)
rank, world = state.process_index, state.num_processes
assert world == 2, world
model, tok = load_model_and_tokenizer(model_path)
# skip: rank 0 keeps 3 rows of its 4, rank 1 keeps 1; the gradient is still that of the 4 kept rows in one batch
for aggregation, skip in [(a, False) for a in ("dr_grpo", "token_mean", "seq_mean_token_mean")] + [
        (a, True) for a in ("dr_grpo", "token_mean", "seq_mean_token_mean")]:
    args = TrustClipGRPOConfig(output_dir=out + "/grad", per_device_train_batch_size=4, num_generations=4,
                               max_completion_length=6, use_cpu=True, report_to="none", num_iterations=2,
                               objective="kl3", objective_kwargs={"delta": 0.02}, aggregation=aggregation,
                               **checkpointing_off(), skip_zero_advantage=skip)
    trainer = TrustClipGRPOTrainer(model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                                   processing_class=tok, train_dataset=Dataset.from_list([{"prompt": "a"}] * 8))
    g = torch.Generator().manual_seed(0)  # the same global batch of 8 on both ranks
    prompt = tok(["Compute 1+2.\n", "Compute 13+4.\n"] * 4, return_tensors="pt", padding=True, add_special_tokens=False)
    completion_ids = torch.randint(5, 60, (8, 6), generator=g)
    mask = (torch.arange(6)[None] < torch.tensor([6, 2, 5, 6, 1, 4, 6, 3])[:, None]).long()
    batch = {"prompt_ids": prompt["input_ids"], "prompt_mask": prompt["attention_mask"],
             "completion_ids": completion_ids, "completion_mask": mask, "advantages": torch.randn(8, generator=g),
             "num_items_in_batch": mask.sum()}
    ids, att = torch.cat([batch["prompt_ids"], completion_ids], 1), torch.cat([batch["prompt_mask"], mask], 1)
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, 6)
    batch["old_per_token_logps"] = (old + 0.3 * torch.randn(old.shape, generator=g)).clamp(max=0.0)
    keep = [0, 2, 3, 6] if skip else list(range(8))
    if skip:
        batch["advantages"][[1, 4, 5, 7]] = 0.0
    # reference: the whole batch (its kept rows) in one process, the pure objective
    model.zero_grad()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, 6)
    ref, _ = compute_policy_loss(get_objective("kl3", delta=0.02), logp=logps[keep],
                                 old_logp=batch["old_per_token_logps"][keep], advantages=batch["advantages"][keep],
                                 mask=mask[keep], aggregation=aggregation,
                                 **({"max_len": 6} if aggregation == "dr_grpo" else {}))
    ref.backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    # this rank's half through the trainer, gradients averaged over processes as DDP does
    half = {k: (v[rank * 4:(rank + 1) * 4] if v.dim() > 0 else v) for k, v in batch.items()}
    if skip:
        half = trainer.drop_zero_advantage(half)
        assert half["completion_ids"].size(0) == (3 if rank == 0 else 1)
    model.train(); model.zero_grad()
    trainer.current_gradient_accumulation_steps, trainer._step = 1, 0
    trainer.count_slices([half])
    trainer.compute_loss(model, half).backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.distributed.all_reduce(got)
    got /= world
    err = (got - expected).abs().max().item()
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-7), (aggregation, skip, err)
    if rank == 0:
        print(f"{'SKIP_' if skip else 'GRAD_'}MATCH {aggregation} {err:.2e}", flush=True)
summary = run_pipeline(load_config(None, overrides), printer=lambda s: None)
if rank == 0:
    print("PIPELINE_OK", summary["rl_steps"], flush=True)
'''


def test_two_processes_gloo(tiny_model_path, tmp_path):
    """Two CPU processes (gloo): the DDP-averaged gradient of two half batches equals the one-process gradient of
    the whole batch (also when skip_zero_advantage leaves the processes different numbers of rows), and the RL
    stage runs a few steps. accelerate 1.x spawns several CPU processes only through
    torchrun (`--multi_gpu`) or MPI (`--cpu --mpirun_hostfile`); `--cpu` alone starts one process."""
    pytest.importorskip("accelerate")
    script = tmp_path / "two_procs.py"
    script.write_text(TWO_PROCESS_SCRIPT)
    out = tmp_path / "run"
    overrides = tiny_overrides(tiny_model_path, out, **{"stages": "[rl]", "rl.per_device_train_batch_size": 4})
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script),
           str(tiny_model_path), str(out), json.dumps(overrides)]
    env = {**cli_env(tmp_path), "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for aggregation in ("dr_grpo", "token_mean", "seq_mean_token_mean"):
        assert f"GRAD_MATCH {aggregation}" in proc.stdout
        assert f"SKIP_MATCH {aggregation}" in proc.stdout
    assert "PIPELINE_OK 2" in proc.stdout
    state = json.loads((out / "state.json").read_text())
    assert state["rl"]["steps"] == 2


def test_train_config_round_trips_through_yaml(tmp_path):
    import yaml

    config = load_config(None, ["rl.objective=sapo", "rl.objective_kwargs={tau_pos: 2.0}"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert load_config(path) == config
    assert isinstance(config, TrainConfig)


def test_an_unknown_command_is_refused_naming_the_commands(capsys):
    from trustclip.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["theory"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unknown command 'theory'; choose from objectives, bounds, train" in err
