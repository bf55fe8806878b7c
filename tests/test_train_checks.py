"""The commands check the whole configuration before any work starts, a resumed run takes its settings from the
run, and evaluating a run's model reproduces its summary: issue 18's list at the level of `trustclip train`,
`trustclip eval`, `trustclip compare`, `bounds`, `theory` and the CLI itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trustclip.cli import main

ROOT = Path(__file__).resolve().parents[1]


def tiny(model_path: Path, **extra: object) -> list[str]:
    """--set arguments of a run of a few seconds on the tiny model."""
    values = {"model.name_or_path": str(model_path), "report_to": [], "plots": False, "data.eval_limit": 4,
              "eval.k": 2, "eval.max_new_tokens": 12, "rl.max_steps": 2, "rl.per_device_train_batch_size": 8,
              "rl.max_completion_length": 12, "rl.save_steps": 1, "sft.max_steps": 2,
              "sft.per_device_train_batch_size": 8, "sft.limit": 16, "data.train_limit": 32} | extra
    return [a for k, v in values.items() for a in ("--set", f"{k}={json.dumps(v)}")]


def fill(text: str, **values: object) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------ checked before any work
@pytest.fixture()
def a_file(tmp_path) -> Path:
    path = tmp_path / "a_file.txt"
    path.write_text("not a folder")
    return path


BAD_TRAIN = {  # id: (arguments, message)
    "objective name": (["--objective", "atr2"], "unknown objective 'atr2'"),
    "objective hyper-parameter": (["--set", "rl.objective_kwargs.delta=-1"], "delta=-1 is invalid"),
    "hyper-parameter of another objective": (["--objective", "clip", "--set", "rl.objective_kwargs.delta=0.1"],
                                             "unknown hyper-parameter"),
    "aggregation": (["--set", "rl.aggregation=mean"], "rl.aggregation='mean' is invalid"),
    "advantage estimator": (["--set", "rl.advantage_estimator=ppo"], "rl.advantage_estimator='ppo' is invalid"),
    "batch not divisible by G": (["--set", "rl.per_device_train_batch_size=6"], "divisible by num_generations"),
    "schedule": (["--set", "rl.lr_scheduler_type=cosin"], "cosin is not a valid SchedulerType"),
    "unknown trl_kwargs": (["--set", "rl.trl_kwargs={bogus: 1}"], "rl.trl_kwargs"),
    "prompt style": (["--set", "data.prompt_style=fancy"], "unknown prompt style 'fancy'"),
    "missing data file": (["--set", "data.train=missing.jsonl"], "data file not found"),
    "unknown built-in split": (["--set", "data.train=builtin:tests"], "unknown built-in split 'tests'"),
    "missing model folder": (["--set", "model.name_or_path=./no/such/model"], "no such folder"),
    "model path is a file": (["--set", "model.name_or_path={file}"], "is a file"),
    "output dir is a file": (["--output-dir", "{file}"], "output_dir='{file}' is a file"),
    "tiny shape": (["--set", "model.name_or_path=builtin:tiny", "--set", "model.tiny={hidden: 128}"],
                   "model.tiny: unknown key"),
    "logging integration": (["--report-to", "nonsense"], "unknown integration 'nonsense'"),
    "resume a missing run": (["--resume", "--output-dir", "{tmp}/never_ran"], "never_ran does not exist"),
    "bool for an int": (["--set", "rl.max_steps=true"], "rl.max_steps=True is invalid"),
}


@pytest.mark.parametrize("print_config", [False, True], ids=["train", "print-config"])
@pytest.mark.parametrize("case", list(BAD_TRAIN))
def test_train_rejects_bad_settings_before_any_work(case, print_config, tiny_model_path, tmp_path, a_file, capsys):
    args, message = BAD_TRAIN[case]
    args, message = [fill(a, file=a_file, tmp=tmp_path) for a in args], fill(message, file=a_file)
    out = tmp_path / "run"
    argv = ["train", *tiny(tiny_model_path), "--output-dir", str(out), *args] + (["--print-config"] * print_config)
    code, stdout, err = run_cli(argv, capsys)
    assert code == 2, stdout + err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()  # nothing was written: no work started


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


LATE_OR_SILENT_TRAIN_INPUTS = {  # id: (arguments, message); each refused by train and --print-config, in one line
    "loss_type bnpo": (["--set", "rl.trl_kwargs={loss_type: bnpo}"],
                             "rl.trl_kwargs: loss_type='bnpo' normalises by the tokens of each micro-batch"),
    "loss_type nonsense": (["--set", "rl.trl_kwargs={loss_type: nonsense}"],
                                 "loss_type='nonsense' is not a TRL loss type"),
    "epsilon": (["--set", "rl.trl_kwargs={epsilon: 0.9, epsilon_high: 5.0}"],
                      "set rl.objective='clip_higher', rl.objective_kwargs={'epsilon_low': 0.9, 'epsilon_high': 5.0} "
                      "instead"),
    "TRL's delta": (["--set", "rl.trl_kwargs={delta: 2.0}"], "rl.objective='dual_clip'"),
    "loss_type dapo": (["--set", "rl.trl_kwargs={loss_type: dapo}"],
                             "set rl.objective='clip', rl.objective_kwargs={'epsilon': 0.2}, "
                             "rl.aggregation='token_mean' instead"),
    "scale_rewards batch": (["--set", "rl.trl_kwargs={scale_rewards: batch}"],
                                  "scale_rewards='batch': trustclip has no advantage estimator"),
    "scale_rewards group": (["--set", "rl.trl_kwargs={scale_rewards: group}"],
                                  "set rl.advantage_estimator='grpo' instead"),
    "top_entropy_quantile": (["--set", "rl.trl_kwargs={top_entropy_quantile: 1.5}"],
                                   "top_entropy_quantile=1.5 is invalid: must be in [0, 1]"),
    "filter value": (["--set", "data.eval=['x={levels}?level=1,7']"], "no row has level in [7]"),
    "filter fields": (["--set", "data.eval=['x={levels}?level=1,2&subject=Algebra']"],
                            "no row has a field 'subject'"),
    "liger": (["--set", "rl.trl_kwargs={use_liger_kernel: true}"],
                    "use_liger_kernel=True needs the liger_kernel package"),
    "vllm": (["--set", "rl.trl_kwargs={use_vllm: true}"], "use_vllm=True needs the vllm package"),
    "deepspeed": (["--set", "rl.trl_kwargs={deepspeed: {zero_optimization: {stage: 2}}}"],
                        "rl.trl_kwargs: a package is missing"),
    "optimizer package": (["--set", "rl.trl_kwargs={optim: adamw_bnb_8bit}"], "optim='adamw_bnb_8bit'"),
    "reward_weights": (["--set", "rl.trl_kwargs={reward_weights: [1.0, 2.0]}"],
                             "rl.trl_kwargs.reward_weights=[1.0, 2.0]: trustclip train has one reward function"),
    "chat_template_kwargs": (["--set", "rl.trl_kwargs={chat_template_kwargs: {enable_thinking: false}}"],
                                   "the RL prompts are written before TRL sees them"),
    "TRL's eval loop": (["--set", "rl.trl_kwargs={eval_strategy: steps, eval_steps: 5}"],
                              "rl.trl_kwargs.eval_strategy='steps': trustclip train evaluates the held-out benchmarks "
                              "with rl.eval_every"),
    "cast_lm_head_to_fp32": (["--set", "rl.trl_kwargs={cast_lm_head_to_fp32: true}"],
                                        "rl.trl_kwargs.cast_lm_head_to_fp32=True: the trainer computes the LM head, "
                                        "log-probs and ratio in float32 already"),
    "corrupt config.yaml": (["--resume", "--output-dir", "{corrupt}"],
                                   "{corrupt}/config.yaml is not a readable run configuration"),
    "config.yaml not a mapping": (["--resume", "--output-dir", "{listed}"],
                                         "{listed}/config.yaml is not a run configuration"),
}


@pytest.mark.parametrize("print_config", [False, True], ids=["train", "print-config"])
@pytest.mark.parametrize("case", list(LATE_OR_SILENT_TRAIN_INPUTS))
def test_train_refuses_before_any_work(case, print_config, tiny_model_path, tmp_path, capsys):
    """Inputs that once failed late or silently: one line naming the value, before any work, also --print-config."""
    needs = {"liger": "liger_kernel", "vllm": "vllm", "deepspeed": "deepspeed",
             "optimizer package": "bitsandbytes"}
    if case in needs and _installed(needs[case]):
        pytest.skip("the package is installed here")
    levels = tmp_path / "levels.jsonl"
    levels.write_text("".join(json.dumps({"problem": f"p{i}", "answer": "1", "level": 1 + i % 2}) + "\n"
                              for i in range(6)))
    for name, text in (("corrupt", "rl: {objective: kl3\n  max_steps: [1\n"), ("listed", "- 1\n- 2\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(text)
    args, message = LATE_OR_SILENT_TRAIN_INPUTS[case]
    places = {"levels": levels, "corrupt": tmp_path / "corrupt", "listed": tmp_path / "listed"}
    args, message = [fill(a, **places) for a in args], fill(message, **places)
    out = tmp_path / "run"
    argv = ["train", *tiny(tiny_model_path), "--output-dir", str(out), *args] + (["--print-config"] * print_config)
    code, stdout, err = run_cli(argv, capsys)
    assert code == 2, stdout + err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("spelling", [["--set", "rl.objective={name}"], ["--objective", "{name}"],
                                      ["--set", "rl={objective: {name}}"]])
@pytest.mark.parametrize(("name", "delta"), [("atr_seq", 6e-8), ("truly_ppo", 0.03), ("kl3", 0.07)])
def test_naming_an_objective_gives_its_own_defaults(name, delta, spelling):
    import argparse

    from trustclip import get_objective
    from trustclip.commands.train import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build_config(parser.parse_args([a.replace("{name}", name) for a in spelling]))
    assert config.rl.objective == name
    assert get_objective(name, **config.rl.objective_kwargs).hparams["delta"] == delta
    config = build_config(parser.parse_args([*[a.replace("{name}", name) for a in spelling[:2]],
                                             "--set", "rl.objective_kwargs.delta=0.5"]))
    assert config.rl.objective_kwargs == {"delta": 0.5}  # its hyper-parameters set after it still apply
    if "rl.objective" in spelling[1] or spelling[0] == "--objective":  # (--set rl={...} replaces the whole section)
        config = build_config(parser.parse_args(["--set", "rl.objective_kwargs.delta=0.5",
                                                 *[a.replace("{name}", name) for a in spelling[:2]]]))
        assert config.rl.objective_kwargs == {"delta": 0.5}  # in either order


def test_a_recipe_naming_an_objective_gives_its_own_defaults(tmp_path, capsys):
    from trustclip.settings import load_config

    (tmp_path / "base.yaml").write_text("rl:\n  objective: kl3\n  objective_kwargs: {delta: 0.2}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nrl:\n  objective: truly_ppo\n")
    (tmp_path / "plain.yaml").write_text("rl:\n  objective: atr_seq\n")
    assert load_config(tmp_path / "child.yaml").rl.objective_kwargs == {}  # not the base's kl3 delta
    assert load_config(tmp_path / "plain.yaml").rl.objective_kwargs == {}  # not the embedded default's 0.07
    assert load_config(tmp_path / "base.yaml").rl.objective_kwargs == {"delta": 0.2}
    code, out, err = run_cli(["train", "--config", str(tmp_path / "plain.yaml"), "--print-config"], capsys)
    assert code == 0, err
    assert "objective: atr_seq\n  objective_kwargs: {}" in out


def test_eval_of_a_run_with_a_corrupt_config_names_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "rl" / "final").mkdir(parents=True)
    (run / "rl" / "final" / "config.json").write_text("{}")
    (run / "config.yaml").write_text("rl: [unclosed\n")
    (run / "state.json").write_text("{}")
    code, out, err = run_cli(["eval", "--run", str(run), "--output", str(tmp_path / "out")], capsys)
    assert code == 2 and f"{run / 'config.yaml'} is not a readable run configuration" in err, out + err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_resume_with_a_corrupt_state_names_the_file(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", *tiny(tiny_model_path), "--output-dir", str(out), "--print-config"], capsys)
    assert code == 0, err
    out.mkdir()
    from trustclip.settings import load_config

    (out / "config.yaml").write_text(__import__("yaml").safe_dump(load_config(None, [
        f"model.name_or_path={tiny_model_path}"], output_dir=str(out)).to_dict()))
    (out / "state.json").write_text('{"sft": {"done": tr')
    code, stdout, err = run_cli(["train", "--resume", "--output-dir", str(out)], capsys)
    assert code == 2 and f"{out / 'state.json'} (which stages finished) is not readable JSON" in err, stdout + err


def test_builtin_tiny_is_one_model_for_train_and_eval(tmp_path):
    from transformers import AutoConfig

    from trustclip.commands.eval import _model_path
    from trustclip.models import build_tiny_model, resolve_model_name
    from trustclip.settings import TrainConfig, load_config

    trained = build_tiny_model(**TrainConfig().model.tiny)  # what `trustclip train` builds for builtin:tiny
    assert Path(resolve_model_name("builtin:tiny")) == trained == build_tiny_model()  # what `trustclip eval` loads
    assert AutoConfig.from_pretrained(trained).num_hidden_layers == 2  # the README's embedded default
    wide = load_config(None, ["model.tiny={num_layers: 1, hidden_size: 64}"])
    assert Path(_model_path("builtin:tiny", wide)) == build_tiny_model(num_layers=1, hidden_size=64)  # a run's shape


def test_compare_dry_run_checks_every_run(tmp_path, capsys):
    code, out, err = run_cli(["compare", "--objectives", "clip,atr", "--seeds", "1", "--set", "rl.aggregation=mean",
                              "--output-dir", str(tmp_path / "cmp"), "--dry-run"], capsys)
    assert code == 2 and "rl.aggregation='mean' is invalid" in err, out + err
    code, out, err = run_cli(["compare", "--objectives", "clip", "--seeds", "1", "--set",
                              "rl.per_device_train_batch_size=6", "--output-dir", str(tmp_path / "cmp"), "--dry-run"],
                             capsys)
    assert code == 2 and "divisible by num_generations" in err, out + err


def test_objective_flag_then_set_hyperparameters():
    import argparse

    from trustclip.commands.train import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build_config(parser.parse_args(["--objective", "kl3", "--set", "rl.objective_kwargs.delta=0.3"]))
    assert (config.rl.objective, config.rl.objective_kwargs) == ("kl3", {"delta": 0.3})
    config = build_config(parser.parse_args(["--objective", "clip", "--set", "rl.objective_kwargs={epsilon: 0.3}"]))
    assert (config.rl.objective, config.rl.objective_kwargs) == ("clip", {"epsilon": 0.3})
    config = build_config(parser.parse_args(["--objective", "clip_higher"]))
    assert config.rl.objective_kwargs == {}  # the objective's own defaults, not kl3's delta


BAD_EVAL = {
    "limit -3": (["--limit", "-3"], "data.eval_limit=-3 is invalid"),
    "limit 0": (["--limit", "0"], "data.eval_limit=0 is invalid"),
    "prompt style": (["--prompt-style", "fancy"], "unknown prompt style 'fancy'"),
    "missing model": (["--model", "./no/such/model"], "no such folder"),
    "model is a file": (["--model", "{file}"], "is a file"),
    "k 0": (["--k", "0"], "eval.k=0 is invalid"),
    "missing benchmark": (["--benchmark", "x=missing.jsonl"], "data file not found"),
    "output is a file": (["--output", "{file}"], "is a file"),
    "output under a file": (["--output", "{file}/sub"], "is a file, so the folder cannot be made"),
    "runs from two runs": (["--model", "{run_a}", "--model", "{run_b}"], "belong to different runs"),
}


@pytest.mark.parametrize("case", list(BAD_EVAL))
def test_eval_rejects_bad_settings_before_any_work(case, tmp_path, a_file, capsys):
    runs = {}
    for name in ("run_a", "run_b"):
        (tmp_path / name / "final").mkdir(parents=True)
        (tmp_path / name / "final" / "config.json").write_text("{}")
        (tmp_path / name / "config.yaml").write_text("{}\n")
        (tmp_path / name / "state.json").write_text("{}")
        runs[name] = str(tmp_path / name / "final")
    args, message = BAD_EVAL[case]
    args, message = [fill(a, file=a_file, **runs) for a in args], fill(message, file=a_file)
    model = [] if "--model" in args else ["--model", "builtin:tiny"]
    output = [] if "--output" in args else ["--output", str(tmp_path / "out")]
    code, out, err = run_cli(["eval", *model, *args, *output], capsys)
    assert code == 2 and message in err and "Traceback" not in err, out + err
    assert not (tmp_path / "out").exists()


def test_eval_device_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, out, err = run_cli(["eval", "--model", "builtin:tiny", "--device", "cuda"], capsys)
    assert code == 2 and "--device 'cuda': this machine has 0 CUDA device(s)" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["bounds", "--plot", "out.txt"], "--plot 'out.txt': matplotlib writes"),
    (["bounds", "--objective", "dcpo", "--q", "1.5"], "q must be a probability in (0, 1]"),
    (["bounds", "--objective", "trgppo", "--q", "nan"], "q must be a probability in (0, 1]"),
])
def test_bounds_rejects_bad_input_in_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err, out + err
    assert not (tmp_path / "out.txt").exists()


# ------------------------------------------------------------------ the CLI itself
def test_help_imports_neither_torch_nor_scipy_and_says_it_all():
    code = ("import sys; from trustclip.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', sorted(m for m in ('torch', 'scipy', 'transformers', 'numpy') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr
    description = " ".join(proc.stdout.split())
    assert "and every baseline). `trustclip COMMAND --help` describes a command." in description  # not cut off


def test_a_closed_pipe_is_not_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "trustclip.cli", "objectives", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc.stdout.close()  # the reader is gone before the first write (as with `| head -1`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipeError" not in err, err


# ------------------------------------------------------------------ resume
def test_resume_takes_the_runs_settings(tiny_model_path, tmp_path, capsys):
    import argparse

    from trustclip.commands.train import add_arguments, build_config

    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--stages", "sft", *tiny(tiny_model_path, **{"sft.max_steps": 3}),
                            "--output-dir", str(out), "--quiet"], capsys)
    assert code == 0, err
    saved = (out / "config.yaml").read_text()

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = build_config(parser.parse_args(["--resume", "--output-dir", str(out)]))
    assert (config.sft.max_steps, config.model.name_or_path, config.resume) == (3, str(tiny_model_path), True)
    assert config.stages == ["sft"]

    code, stdout, err = run_cli(["train", "--resume", "--output-dir", str(out), "--set", "sft.max_steps=3",
                                 "--quiet"], capsys)  # repeating a setting with the run's value is fine
    assert code == 0, err
    assert (out / "config.yaml").read_text() == saved  # not overwritten with the defaults

    code, stdout, err = run_cli(["train", "--resume", "--output-dir", str(out), "--set", "sft.max_steps=5",
                                 "--set", "sft.learning_rate=0.1"], capsys)
    assert code == 2, stdout + err
    assert "sft.max_steps=5 (the run has 3); sft.learning_rate=0.1 (the run has 0.003)" in err
    assert (out / "config.yaml").read_text() == saved


def test_quiet_prints_the_final_table_only(tiny_model_path, tmp_path, capsys):
    code, out, err = run_cli(["train", "--stages", "sft,eval", *tiny(tiny_model_path), "--output-dir",
                              str(tmp_path / "run"), "--quiet"], capsys)
    assert code == 0, err
    assert "held-out accuracy (mean@2)" in out and "amc_like" in out
    assert "[sft]" not in out and "[eval]" not in out


def test_resume_falls_back_from_a_half_written_checkpoint(tiny_model_path, tmp_path, capsys):
    """A kill while checkpoint-3 was being written (its optimizer state cut short): --resume continues from
    checkpoint-2 and finishes, each step logged once."""
    out = tmp_path / "run"
    sets = tiny(tiny_model_path, **{"rl.max_steps": 3, "rl.save_total_limit": 3})
    code, _, err = run_cli(["train", "--stages", "rl", *sets, "--output-dir", str(out), "--quiet"], capsys)
    assert code == 0, err
    state = json.loads((out / "state.json").read_text())
    state.pop("rl")  # as if killed during RL
    (out / "state.json").write_text(json.dumps(state))
    optimizer = out / "rl" / "checkpoint-3" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    metrics = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"step": 3' not in line]
    (out / "metrics.jsonl").write_text("\n".join(metrics) + "\n")

    code, stdout, err = run_cli(["train", "--resume", "--output-dir", str(out)], capsys)
    assert code == 0, stdout + err
    assert "skipping" in stdout and "checkpoint-3: optimizer.pt is cut short" in stdout
    assert f"resuming from {out / 'rl' / 'checkpoint-2'}" in stdout
    assert json.loads((out / "state.json").read_text())["rl"]["steps"] == 3
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("stage") == "rl" and "loss" in json.loads(line)]
    assert steps == [1, 2, 3]


def test_checkpoint_completeness(tiny_model_path, tmp_path, capsys):
    from trustclip.train.stages import checkpoint_problem, last_checkpoint

    out = tmp_path / "run"
    sets = tiny(tiny_model_path, **{"rl.max_steps": 2, "rl.save_total_limit": 2})
    assert main(["train", "--stages", "rl", *sets, "--output-dir", str(out), "--quiet"]) == 0
    rl = out / "rl"
    assert checkpoint_problem(rl / "checkpoint-2") is None
    assert last_checkpoint(rl, print) == str(rl / "checkpoint-2")
    for name in ("model.safetensors", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        path = rl / "checkpoint-2" / name
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) - 7])
        assert checkpoint_problem(rl / "checkpoint-2") is not None, name
        assert last_checkpoint(rl, print) == str(rl / "checkpoint-1"), name
        path.write_bytes(whole)
    (rl / "checkpoint-2" / "trainer_state.json").unlink()
    assert checkpoint_problem(rl / "checkpoint-2") == "trainer_state.json is missing"


# ------------------------------------------------------------------ evaluating a run reproduces its summary
@pytest.fixture(scope="module")
def trained_run(tiny_model_path, tmp_path_factory):
    """A run whose model answers some held-out problems (SFT long enough to learn the format)."""
    from trustclip.train import load_config, run_pipeline

    out = tmp_path_factory.mktemp("trained") / "run"
    overrides = [f"model.name_or_path={tiny_model_path}", "report_to=[]", "plots=false", "sft.max_steps=40",
                 "data.builtin_n_train=400", "rl.max_steps=1", "rl.per_device_train_batch_size=16",
                 "rl.max_completion_length=16", "data.builtin_n_eval=16", "eval.k=2"]
    summary = run_pipeline(load_config(None, overrides, output_dir=str(out)), printer=lambda _: None)
    return out, summary


@pytest.mark.parametrize("how", ["--model", "--run"])
def test_eval_of_a_runs_model_reproduces_its_summary(trained_run, tmp_path, capsys, how):
    out, summary = trained_run
    assert summary["accuracy_after"]["amc_like"] > 0  # a model that answers something: the check has teeth
    target = ["--model", str(out / "rl" / "final")] if how == "--model" else ["--run", str(out)]
    code, stdout, err = run_cli(["eval", *target, "--output", str(tmp_path / "eval"), "--no-progress"], capsys)
    assert code == 0, stdout + err
    final = json.loads((tmp_path / "eval" / "results.json").read_text())["final"]
    assert {split: m["mean@2"] for split, m in final.items()} == summary["accuracy_after"]
    assert {split: m["pass@2"] for split, m in final.items()} == summary["pass_after"]


def test_eval_says_which_settings_differ_from_the_run(trained_run, tmp_path, capsys):
    out, _ = trained_run
    code, stdout, err = run_cli(["eval", "--run", str(out), "--k", "4", "--limit", "2", "--output",
                                 str(tmp_path / "eval"), "--no-progress"], capsys)
    assert code == 0, err
    assert "overridden: eval.k=4 instead of the run's 2, data.eval_limit=2 instead of the run's None" in stdout


# ------------------------------------------------------------------ one declaration per setting
def test_trainer_configs_take_every_field_of_the_same_name():
    """grpo_config / sft_config hand over every section field TRL's config also has (no list to keep in sync);
    the fields left out are exactly trustclip's own."""
    import dataclasses

    from trustclip.settings import load_config
    from trustclip.train.stages import grpo_config, sft_config

    config = load_config(None, ["rl.learning_rate=3e-5", "rl.steps_per_generation=2", "rl.top_k=5",
                                "sft.max_length=64", "rl.trl_kwargs={entropy_coef: 0.01}"])
    for section, build, own in (
            (config.rl, grpo_config, {"reward_timeout", "eval_every", "trl_kwargs"}),
            (config.sft, sft_config, {"data", "split", "subset", "solution_key", "problem_key", "answer_key",
                                      "limit"})):
        built = build(config, Path("unused"))
        values = dataclasses.asdict(section)
        left_out = {name for name in values if not hasattr(built, name)}
        assert left_out == own
        for name in set(values) - own:
            assert getattr(built, name) == values[name], name
    assert grpo_config(config, Path("unused")).entropy_coef == 0.01  # rl.trl_kwargs on top


def test_a_section_field_named_after_no_library_field_is_refused():
    """A section field shared with TRL's config names that field; a misspelt or stale name would otherwise never reach
    `--help` (nor TRL, which takes the fields by name)."""
    from trustclip.integrations.trl import TrustClipGRPOConfig
    from trustclip.settings import library_option

    with pytest.raises(TypeError, match="max_grad_nrom"):
        library_option(TrustClipGRPOConfig, "max_grad_nrom", rule="> 0")


def test_a_stage_hands_over_the_fields_declared_as_library_options_and_no_other():
    """The hand-over to TRL follows each field's declaration (`library_option` names the TRL field), so a reader can
    trace rl.objective to TrustClipGRPOConfig.objective by name; a field of trustclip's own that happens to share a
    TRL name is not handed over."""
    from dataclasses import dataclass

    from trl import SFTConfig

    from trustclip.options import option
    from trustclip.settings import library_option, library_settings, load_config

    @dataclass
    class Section:
        max_steps: int = option(5, "trustclip's own count, not TRL's")
        learning_rate: float = library_option(SFTConfig, "learning_rate", 0.1)

    assert library_settings(Section()) == {"learning_rate": 0.1}
    rl = load_config(None, ["rl.objective=clip"]).rl
    handed = library_settings(rl)
    assert handed["objective"] == "clip" and handed["objective_kwargs"] == rl.objective_kwargs
    assert not {"eval_every", "reward_timeout", "trl_kwargs"} & set(handed)


# The embedded CPU run's own values of the fields the sections share with TRL's configs; every other shared field
# keeps the library's default.
EMBEDDED_SFT = {"max_steps": 200, "learning_rate": 3e-3, "lr_scheduler_type": "constant",
                "per_device_train_batch_size": 64, "max_length": 256}
EMBEDDED_RL = {"max_steps": 350, "learning_rate": 2e-4, "lr_scheduler_type": "cosine",
               "per_device_train_batch_size": 256, "objective": "kl3", "objective_kwargs": {"delta": 0.07},
               "aggregation": "dr_grpo", "advantage_estimator": "dr_grpo", "num_generations": 4, "num_iterations": 2,
               "temperature": 0.7, "max_completion_length": 32, "truncated_reward": 0.0, "skip_zero_advantage": True,
               "save_steps": 50, "save_total_limit": 2, "logging_steps": 1, "vllm_mode": "colocate"}


def test_library_fields_are_declared_once_and_the_recipe_states_its_own_values():
    """The sft / rl sections take each TRL / TrustClipGRPOConfig field they share from the library (its help, then
    trustclip train's rule if any, and its default unless the embedded run states its own value), and a plain
    TrustClipGRPOConfig keeps the library's defaults."""
    import dataclasses

    from trl import SFTConfig

    from trustclip.integrations.trl import TrustClipGRPOConfig
    from trustclip.settings import RLArgs, SFTArgs

    for section, library, own in ((SFTArgs, SFTConfig, EMBEDDED_SFT), (RLArgs, TrustClipGRPOConfig, EMBEDDED_RL)):
        declared = {f.name: f for f in dataclasses.fields(library)}
        built = section()
        shared = [f for f in dataclasses.fields(section) if f.name in declared]
        assert set(own) <= {f.name for f in shared}
        for f in shared:
            library_help = declared[f.name].metadata["help"]
            assert f.metadata["help"] == library_help or f.metadata["help"].startswith(
                library_help + " In trustclip train: "), f.name
            assert getattr(built, f.name) == own.get(f.name, declared[f.name].default), f.name
    rl = RLArgs()
    assert (rl.skip_zero_advantage, rl.truncated_reward, rl.objective_kwargs) == (True, 0.0, {"delta": 0.07})
    plain = TrustClipGRPOConfig(output_dir="unused")
    assert (plain.skip_zero_advantage, plain.truncated_reward, plain.objective_kwargs) == (False, None, {})
    assert (plain.objective, plain.aggregation, plain.advantage_estimator) == ("kl3", "dr_grpo", "dr_grpo")


def test_a_run_saved_before_merged_lora_forward_resumes_without_it(tmp_path):
    """A config.yaml written before `rl.merged_lora_forward` existed is a run that trained with PEFT's forward: resumed,
    it keeps that; a run that states the setting keeps its value, and a new run gets the default."""
    import yaml

    from trustclip.settings import TrainConfig, load_config, resume_config

    saved = TrainConfig().to_dict()
    del saved["rl"]["merged_lora_forward"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert resume_config({"output_dir": str(tmp_path)}).rl.merged_lora_forward is False
    saved["rl"]["merged_lora_forward"] = True
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert resume_config({"output_dir": str(tmp_path)}).rl.merged_lora_forward is True
    assert load_config(None, []).rl.merged_lora_forward is True


def test_a_resumed_run_keeps_its_stages(tmp_path):
    """`stages` decides what a run computes (RL from the SFT model or from the base model), so it is not run
    control: resuming a run with other stages is an error naming both values."""
    import yaml

    from trustclip.settings import RUN_CONTROL, TrainConfig, load_config
    from trustclip.train.checks import check_output_dir

    assert "stages" not in RUN_CONTROL
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(TrainConfig(stages=["sft", "rl"]).to_dict()))
    check_output_dir(load_config(None, ["stages=sft,rl", "quiet=true"], output_dir=str(tmp_path), resume=True))
    with pytest.raises(ValueError, match=r"stages=\['rl'\] \(the run has \['sft', 'rl'\]\)"):
        check_output_dir(load_config(None, ["stages=rl"], output_dir=str(tmp_path), resume=True))


def test_command_line_values_are_read_as_yaml_once():
    from trustclip.settings import parse_override, parse_value

    assert [parse_value(v) for v in ("1e-5", "3", "true", "null", "[a, b]", "{k: 1}", "x", " ")] == [
        1e-5, 3, True, None, ["a", "b"], {"k": 1}, "x", ""]
    assert parse_override("rl.learning_rate=1e-5") == ("rl.learning_rate", 1e-5)
    with pytest.raises(ValueError, match=r"--set 'rl.x=\[': value '\[' is not valid YAML"):
        parse_override("rl.x=[")


def test_periodic_eval_callback_with_every_0_never_evaluates():
    from types import SimpleNamespace

    from trustclip.train.callbacks import PeriodicEvalCallback

    calls = []
    callback = PeriodicEvalCallback(trainer=None, every=0, evaluate_fn=lambda *a, **k: calls.append(k))
    callback.on_step_end(None, SimpleNamespace(global_step=4), None)
    assert calls == []


def test_resume_takes_only_checkpoint_n_folders(tmp_path):
    """A user's `checkpoint-10-old` backup is no checkpoint of the run (transformers' sort_checkpoints lists it)."""
    from trustclip.train.stages import last_checkpoint

    (tmp_path / "checkpoint-10-old").mkdir()
    said: list[str] = []
    assert last_checkpoint(tmp_path, said.append) is None
    assert said == []


@pytest.mark.parametrize("print_config", [False, True], ids=["train", "print-config"])
@pytest.mark.parametrize("where", ["data.eval", "data.train"])
def test_prompts_too_long_for_the_model_are_refused_before_any_work(where, print_config, tiny_model_path, tmp_path,
                                                                     capsys):
    """The tiny model has 256 positions: a 300-character prompt plus the generated tokens cannot fit (transformers
    would only warn). The run refuses before any model is loaded; --print-config flags it too."""
    data = tmp_path / "long.jsonl"
    rows = [{"id": "short", "problem": "1+1?", "answer": "2", "solution": "2"},
            {"id": "long", "problem": "Compute 1+1. " * 23, "answer": "2", "solution": "2"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = f"data.eval=['long={data}']" if where == "data.eval" else f"data.train={data}"
    out = tmp_path / "run"
    argv = ["train", *tiny(tiny_model_path), "--output-dir", str(out), "--set", source, "--stages", "rl,eval"]
    code, stdout, err = run_cli(argv + ["--print-config"] * print_config, capsys)
    option = "eval.max_new_tokens=12" if where == "data.eval" else "rl.max_completion_length=12"
    assert code != 0 and "(id 'long') has" in err and f"with {option} exceed the 256 positions of model" in err, err
    assert not out.exists()


def test_the_prompt_length_check_reads_an_adapters_tokenizer_from_its_base_when_it_has_none(tiny_model_path,
                                                                                            tmp_path):
    """A LoRA adapter folder saved without a tokenizer (training loads its base's): the base's positions and
    tokenizer decide, and the message names the adapter."""
    from trustclip.input_checks import check_generation_room

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny_model_path)}))
    rows = [{"id": "short", "problem": "1+1?"}, {"id": "long", "problem": "Compute 1+1. " * 23}]
    check_generation_room(str(adapter), [("data.train", rows[:1], 12, "rl.max_completion_length")], "auto", None)
    with pytest.raises(ValueError, match=rf"\(id 'long'\) has \d+ tokens, which with rl.max_completion_length=12 "
                                         rf"exceed the 256 positions of model {adapter}"):
        check_generation_room(str(adapter), [("data.train", rows, 12, "rl.max_completion_length")], "auto", None)
