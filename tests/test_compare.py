"""`trustclip compare`: planning, seed statistics and generated sentences, resumable execution (with a
fast stand-in pipeline that writes the trainer's files), and one real end-to-end compare of two objectives
x two seeds on a tiny setting whose report cells are checked against the runs' own logs."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from trustclip.cli import main as cli_main
from trustclip.compare import CompareSettings, plan_runs, run_compare
from trustclip.compare.plan import base_config, parse_objectives, parse_seeds, parse_sweep, resolve_reference
from trustclip.compare.runner import COMPARE_LOCK, ChangedRunError, execute
from trustclip.files import read_jsonl, try_lock, write_json_atomic
from trustclip.settings import load_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPORT_FILES = ("report.md", "results.json", "results.csv", "curves.csv", "compare.json", "compare_log.jsonl")
FIGURES = ("training_curves.png", "eval_vs_step.png", "at_k.png")


# ------------------------------------------------------------------------------------------------ helpers
def events(root: Path, session_start: int = 0) -> list[dict]:
    return read_jsonl(root / "compare_log.jsonl")[session_start:]


def started(rows: list[dict]) -> list[str]:
    return sorted(r["run"] for r in rows if r["event"] == "start")


def md_table(text: str, heading: str) -> list[list[str]]:
    """Rows (cells) of the first markdown table after the line starting with `heading`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[0:1] + rows[2:]  # drop the |---| line


def tidy_csv(out: Path) -> dict[tuple[str, int, str], float]:
    """results.csv's rows (the tidy table): (group, seed, outcome) -> value."""
    with (out / "results.csv").open() as fh:
        return {(row["group"], int(row["seed"]), row["outcome"]): float(row["value"]) for row in csv.DictReader(fh)}


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def pm(values: list[float]) -> str:
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values, ddof=1):.1f}"


# ---------------------------------------------------------------------------------------- planning tests
def rl_runs(*args, **kwargs) -> list:
    """The compared (RL) runs of a plan, without the shared SFT runs."""
    return [r for r in plan_runs(*args, **kwargs) if r.kind == "rl"]


def test_plan_is_seed_major_and_fixes_everything_but_the_objective(tmp_path):
    every = plan_runs(["clip", "atr"], [0, 1], tmp_path, overrides=["rl.max_steps=7"])
    assert [r.run_id for r in every] == ["_sft/seed0", "clip/seed0", "atr/seed0", "_sft/seed1", "clip/seed1",
                                         "atr/seed1"]
    sft, runs = every[0], [r for r in every if r.kind == "rl"]
    assert sft.kind == "sft" and sft.config["stages"] == ["sft"]
    assert runs[0].depends_on is sft and runs[1].depends_on is sft and runs[2].depends_on is every[3]
    assert runs[0].config["stages"] == ["rl", "eval"]
    assert runs[0].to_dict()["start_model"] == "../../_sft/seed0/sft/final"
    assert runs[1].objective == "kl3" and runs[1].hparams == {"delta": 0.07}  # the recipe's kl3 kwargs
    assert runs[0].config["rl"]["objective_kwargs"] == {}  # ...are not given to clip
    assert {r.config["rl"]["max_steps"] for r in runs} == {7}
    for a in runs:
        for b in runs:
            diff = {k for k in a.config if a.config[k] != b.config[k]}
            assert diff <= {"seed", "rl"}
            rl_diff = {k for k in a.config["rl"] if a.config["rl"][k] != b.config["rl"][k]}
            assert rl_diff <= {"objective", "objective_kwargs"}
    assert runs[0].run_dir == tmp_path / "runs" / "clip" / "seed0"
    assert len({r.fingerprint() for r in every}) == 6


def test_periodic_evaluation_is_on_unless_turned_off(tmp_path):
    def every(overrides=()) -> int:
        return base_config(None, overrides)["rl"]["eval_every"]

    default_steps = load_config().rl.max_steps
    assert every() == default_steps // 5  # the embedded default has none: compare adds 5 evaluation points
    assert every(overrides=["rl.max_steps=20"]) == 4
    assert every(overrides=["rl.eval_every=0"]) == 0
    assert every(overrides=["rl.eval_every=3"]) == 3


def test_shared_sft_follows_options_that_change_sft(tmp_path):
    lr = plan_runs(["clip"], [0], tmp_path, sweep=parse_sweep("rl.learning_rate=1e-4,2e-4"))
    assert [r.run_id for r in lr] == ["_sft/seed0", "clip_rl.learning_rate=0.0001/seed0",
                                      "clip_rl.learning_rate=0.0002/seed0"]
    steps = plan_runs(["clip"], [0], tmp_path, sweep=parse_sweep("sft.max_steps=2,3"))
    sfts = [r for r in steps if r.kind == "sft"]
    assert len(sfts) == 2 and sfts[0].run_id != sfts[1].run_id
    assert [s.config["sft"]["max_steps"] for s in sfts] == [2, 3]
    assert [r.depends_on for r in steps if r.kind == "rl"] == sfts


def test_shared_sft_survives_new_rl_and_eval_defaults(tmp_path, monkeypatch):
    """A release that changes the RL / evaluation defaults must not orphan the SFT runs of a comparison."""
    import dataclasses

    import trustclip.settings as config_module
    from trustclip.compare.runner import build_config

    sft = plan_runs(["clip"], [0], tmp_path, overrides=["rl.max_steps=7", "eval.k=4"])[0]
    assert sft.kind == "sft" and sft.config["rl"] == {} and sft.config["eval"] == {}
    built = build_config(sft.to_dict(), tmp_path / "sft_run", resume=False)  # empty sections: the defaults
    assert built.rl == config_module.RLArgs() and built.eval == config_module.EvalArgs()
    assert built.stages == ["sft"]

    def with_default(cls: type, name: str, value: object) -> type:
        return dataclasses.make_dataclass(cls.__name__, [(name, type(value), dataclasses.field(default=value))],
                                          bases=(cls,))

    monkeypatch.setattr(config_module, "RLArgs", with_default(config_module.RLArgs, "max_steps", 999))
    monkeypatch.setattr(config_module, "EvalArgs", with_default(config_module.EvalArgs, "k", 3))
    again = plan_runs(["clip"], [0], tmp_path, overrides=["rl.max_steps=7", "eval.k=4"])[0]
    assert again.fingerprint() == sft.fingerprint()


def test_sweep_applies_to_objectives_that_have_the_parameter(tmp_path):
    runs = rl_runs(["clip[epsilon=0.3]", "atr"], [0], tmp_path, sweep=parse_sweep("delta=0.03,0.1"))
    assert [r.group for r in runs] == ["clip[epsilon=0.3]", "atr_delta=0.03", "atr_delta=0.1"]
    assert runs[0].hparams == {"epsilon": 0.3} and runs[0].sweep_key is None
    assert [r.hparams["delta"] for r in runs[1:]] == [0.03, 0.1]
    lr = rl_runs(["clip"], [0], tmp_path, sweep=parse_sweep("rl.learning_rate=1e-4,2e-4"))
    assert [r.config["rl"]["learning_rate"] for r in lr] == [1e-4, 2e-4]


def test_a_swept_value_that_changes_nothing_reuses_the_unswept_run(tmp_path):
    """Sweeping atr's delta over its default (0.07), or a training option over the recipe's own value, gives the
    very run the unswept group makes: same directory, same fingerprint, so a shared pool trains it once."""
    plain = {r.run_id: r for r in plan_runs(["atr", "clip"], [0], tmp_path)}
    swept = plan_runs(["atr", "clip"], [0], tmp_path, sweep=parse_sweep("delta=0.05,0.07"))
    at_default = next(r for r in swept if r.group == "atr_delta=0.07")
    assert at_default.sweep_value == 0.07 and at_default.hparams == {"delta": 0.07}
    assert at_default.run_dir == plain["atr/seed0"].run_dir
    assert at_default.fingerprint() == plain["atr/seed0"].fingerprint()
    moved = next(r for r in swept if r.group == "atr_delta=0.05")
    assert moved.run_dir.parent.name == "kl3_delta=0.05" and moved.fingerprint() != at_default.fingerprint()
    lr = rl_runs(["clip"], [0], tmp_path, overrides=["rl.learning_rate=2e-4"],
                   sweep=parse_sweep("rl.learning_rate=1e-4,2e-4"))
    assert [r.run_dir.parent.name for r in lr] == ["clip_rl.learning_rate=0.0001", "clip"]
    # a variant at the objective's own value is the plain objective's run too; another value is its own
    variants = rl_runs(["clip[epsilon=0.2]", "clip_higher[epsilon_low=0.3]"], [0], tmp_path)
    plain_clip = rl_runs(["clip"], [0], tmp_path)[0]
    assert variants[0].group == "clip[epsilon=0.2]" and variants[0].run_dir == plain_clip.run_dir
    assert variants[0].fingerprint() == plain_clip.fingerprint()
    assert variants[1].run_dir.parent.name == "clip_higher_epsilon_low=0.3"


L3, U3 = 0.6709670432, 1.4222251178  # the Lambert-W bounds of KL3 at delta 0.07 (trustclip bounds)
TABLE3 = ("clip, clip[epsilon=0.329], clip[epsilon=0.422], clip_higher, "
          f"clip_higher[epsilon_low={1 - L3!r}, epsilon_high={U3 - 1!r}], atr")


def test_variants_of_one_objective_are_groups_of_their_own(tmp_path):
    labels = parse_objectives(TABLE3)
    identity = f"clip_higher[epsilon_low={1 - L3!r},epsilon_high={U3 - 1!r}]"
    assert labels == ["clip", "clip[epsilon=0.329]", "clip[epsilon=0.422]", "clip_higher", identity, "atr"]
    runs = rl_runs(labels, [0], tmp_path)
    assert [r.group for r in runs] == labels
    assert [r.run_dir.parent.name for r in runs] == [  # from the settings: atr is kl3, at its default delta
        "clip", "clip_epsilon=0.329", "clip_epsilon=0.422", "clip_higher",
        f"clip_higher_epsilon_low={1 - L3!r}_epsilon_high={U3 - 1!r}", "kl3"]
    assert [r.hparams.get("epsilon") for r in runs[:3]] == [0.2, 0.329, 0.422]
    assert runs[3].hparams == {"epsilon_low": 0.2, "epsilon_high": 0.28}
    assert runs[4].hparams == {"epsilon_low": 1 - L3, "epsilon_high": U3 - 1}  # full precision
    assert len({r.fingerprint() for r in runs}) == 6
    group = [(r.group, r.label, r.objective) for r in runs]
    assert resolve_reference(None, group) == "clip"
    assert resolve_reference("clip[ epsilon=0.329 ]", group) == "clip[epsilon=0.329]"
    for name in ("kl3", "dapo"):  # a registered name or an alias is no item of --objectives: no group
        with pytest.raises(ValueError, match=re.escape(f"--reference {name!r} is not a compared group")):
            resolve_reference(name, group)
    assert resolve_reference(None, group[3:]) == "clip_higher"  # no clip: the first group
    swept = rl_runs(["clip[epsilon=0.3]", "atr"], [0], tmp_path, sweep=parse_sweep("delta=0.05,0.1"))
    assert [r.group for r in swept] == ["clip[epsilon=0.3]", "atr_delta=0.05", "atr_delta=0.1"]
    with pytest.raises(ValueError, match=re.escape("--reference 'atr' names 2 groups (atr_delta=0.05, atr_delta=0.1)")):
        resolve_reference("atr", [(r.group, r.label, r.objective) for r in swept])


@pytest.mark.parametrize(("call", "message"), [
    (lambda p: plan_runs(["clip", "sapo"], [0], p, sweep=parse_sweep("delta=0.1")), "no compared objective"),
    (lambda p: parse_objectives("kl3,atr"), "same objective"),
    (lambda p: parse_objectives("clip,clip[epsilon=0.3], clip[ epsilon=0.3]"), "are the same item"),
    (lambda p: parse_objectives("clip,clip[epsilon=0.3"), "unbalanced or nested brackets"),
    (lambda p: parse_objectives("clip[epsilon=[0.3]]"), "unbalanced or nested brackets"),
    (lambda p: parse_objectives("clip[eps=0.3]"), "clip has no hyper-parameter 'eps'; valid: epsilon"),
    (lambda p: parse_objectives("clip[epsilon]"), "expected KEY=VALUE inside the brackets"),
    (lambda p: parse_objectives("clip[]"), "expected KEY=VALUE inside the brackets, got ''"),
    (lambda p: parse_objectives("clip[epsilon=0.3,epsilon=0.2]"), "epsilon is given twice"),
    (lambda p: parse_objectives("clip(epsilon=0.3)"), "expected NAME or NAME[KEY=VALUE,...]"),
    (lambda p: plan_runs(["clip", "clip[epsilon=2]"], [0], p), "objective 'clip[epsilon=2]': clip: epsilon=2 is"),
    (lambda p: plan_runs(["clip", "clip[epsilon=0.2]"], [0], p), "'clip' and 'clip[epsilon=0.2]' have the same"),
    (lambda p: plan_runs(["clip[epsilon=0.3]"], [0], p, sweep=parse_sweep("epsilon=0.1,0.2")), "sets epsilon itself"),
    (lambda p: resolve_reference("sapo", [("clip", "clip", "clip")]), "'sapo' is not a compared group; groups: clip"),
    (lambda p: parse_objectives("clip,nope"), "unknown objective 'nope'"),
    (lambda p: plan_runs(["atr[delta=-1]"], [0], p), "delta=-1 is invalid"),
    (lambda p: plan_runs(["clip"], [0], p, overrides=["seed=3"]), "set by compare itself"),
    (lambda p: plan_runs(["clip"], [0], p, overrides=["rl.max_steps=0"]), "rl.max_steps=0 is invalid"),
    (lambda p: parse_sweep("delta"), "expected KEY=V1,V2"),
    (lambda p: parse_sweep("delta=0.1,0.1"), "repeated"),
    (lambda p: parse_seeds(0), ">= 1"),
])
def test_bad_input_is_a_clear_error(tmp_path, call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(tmp_path)


@pytest.mark.parametrize(("call", "message"), [
    (lambda p: parse_sweep("rl.objective=clip,kl3"), "rl.objective is not a sweepable setting; list the objectives "
                                                     "with --objectives"),
    (lambda p: parse_sweep("rl.objective_kwargs={delta: 0.1},{delta: 0.2}"), "rl.objective_kwargs is not a "
                                                                             "sweepable setting"),
    (lambda p: parse_sweep("rl.objective_kwargs.delta=0.1,0.2"), "swept by its name: --sweep delta=..."),
    (lambda p: parse_sweep("seed=1,2"), "seed is not a sweepable setting; give the seeds with --seeds"),
    (lambda p: parse_sweep("objective=clip,kl3"), "objective is not a sweepable setting; list the objectives"),
    (lambda p: parse_sweep("output_dir=a,b"), "output_dir is not a sweepable setting"),
])
def test_a_setting_compare_sets_itself_is_not_sweepable(tmp_path, call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(tmp_path)


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    code = cli_main(["compare", "--objectives", "clip,bogus", "--output-dir", str(tmp_path)])
    assert code == 2
    assert "unknown objective 'bogus'" in capsys.readouterr().err
    assert cli_main(["compare", "--output-dir", str(tmp_path / "empty")]) == 2  # nothing saved to reuse
    write_json_atomic(tmp_path / "saved" / "compare.json", {"objectives": ["clip"], "seeds": [0]})
    assert cli_main(["compare", "--output-dir", str(tmp_path / "saved"), "--seeds", "2", "--dry-run"]) == 2
    assert "--seeds change(s) the experiment: give --objectives too" in capsys.readouterr().err
    # a flag given as 0 is given: refused, not silently dropped
    assert cli_main(["compare", "--output-dir", str(tmp_path / "saved"), "--seeds", "0", "--dry-run"]) == 2
    assert "--seeds change(s) the experiment" in capsys.readouterr().err
    assert cli_main(["compare", "--output-dir", str(tmp_path / "saved"), "--dry-run"]) == 0
    assert "clip/seed0" in capsys.readouterr().out


@pytest.mark.parametrize("removed", [["--hparam", "atr.delta=0.1"], ["--seed-list", "0,1"], ["--run-timeout", "60"],
                                     ["--progress-every", "5"], ["--restart-partial"], ["--redo-changed"],
                                     ["--eval-every", "5"], ["--no-share-sft"]])
def test_unknown_flags_are_refused_before_anything_is_written(tmp_path, capsys, removed):
    args = ["compare", "--objectives", "atr", *removed, "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stop:
        cli_main(args)
    assert stop.value.code == 2 and f"unrecognized arguments: {' '.join(removed)}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_saved_list_of_seeds_is_reused(tmp_path, capsys):
    """`--seeds N` is seeds 0..N-1; a compare.json saved with another list (the removed --seed-list) still plans it."""
    write_json_atomic(tmp_path / "compare.json", {"objectives": ["clip"], "seeds": [1, 3]})
    assert cli_main(["compare", "--output-dir", str(tmp_path), "--dry-run"]) == 0
    listed = re.findall(r"^ +(\S+) ", capsys.readouterr().out, re.MULTILINE)
    assert listed == ["_sft/seed1", "clip/seed1", "_sft/seed3", "clip/seed3"]


@pytest.mark.parametrize(("args", "message"), [
    (["--sweep", "rl.objective=clip,kl3"], "rl.objective is not a sweepable setting; list the objectives with "
                                           "--objectives"),
    (["--objectives", "clip[epsilon=0.3]", "--sweep", "epsilon=0.1,0.2"], "sets epsilon itself"),
])
def test_compare_refuses_before_any_run_also_dry_run(tmp_path, capsys, args, message):
    objectives = [] if "--objectives" in args else ["--objectives", "clip"]
    for dry in ([], ["--dry-run"]):
        code = cli_main(["compare", *objectives, "--seeds", "1", *args, "--output-dir", str(tmp_path / "cmp"), *dry])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert not (tmp_path / "cmp").exists()


# ----------------------------------------------------------------------------------- statistics and text
def test_io_atomic_write_and_truncated_jsonl(tmp_path):
    write_json_atomic(tmp_path / "a.json", {"x": float("nan")})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": None}
    assert not list(tmp_path.glob(".a.json*"))
    (tmp_path / "m.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [1, 2]
    (tmp_path / "bad.jsonl").write_text('{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_jsonl(tmp_path / "bad.jsonl")


# --------------------------------------------------------------------- execution with a stand-in pipeline
FAKE_PIPELINE = textwrap.dedent('''
    """Stand-in for trustclip.train.pipeline.run_pipeline: writes the same files, with known numbers."""
    import json, math, os, time
    from pathlib import Path

    BASE = {"clip": 0.20, "kl3": 0.50, "sapo": 0.30, "clip_higher": 0.25}

    def jitter(objective, seed):
        """Seed-to-seed noise that differs between objectives, so that paired differences have a spread."""
        return 0.02 * math.sin(1 + seed * len(objective))

    def value(objective, seed, split_index, delta=0.0, epsilon=0.2):
        return BASE[objective] + 2 * delta + epsilon - 0.2 + 0.1 * split_index + 0.03 * seed + jitter(objective, seed)

    def clip_frac(objective, seed):
        return 0.01 * seed + (0.05 if objective == "clip" else 0.02)

    def pipeline(config):
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        objective, seed = config.rl.objective, config.seed
        delta = config.rl.objective_kwargs.get("delta", 0.0)
        epsilon = config.rl.objective_kwargs.get("epsilon", 0.2)
        (out / "state.json").write_text(json.dumps({"started": True}))
        with open(out / "calls.txt", "a") as fh:
            fh.write(f"resume={config.resume} stages={','.join(config.stages)} model={config.model.name_or_path}\\n")
        if "rl" not in config.stages:  # a shared SFT run
            if os.environ.get("FAKE_FAIL") == "sft":
                raise RuntimeError("boom")
            (out / "sft" / "final").mkdir(parents=True, exist_ok=True)
            (out / "sft" / "final" / "config.json").write_text("{}")
            (out / "summary.json").write_text(json.dumps({"metric": "mean@2", "seconds": {"total": 0.5}}))
            return {}
        time.sleep(float(os.environ.get("FAKE_DELAY_" + objective, "0")))
        gate, waited = os.environ.get("FAKE_GATE_" + objective), 0.0
        while gate and not os.path.exists(gate) and waited < 120:  # held until the test opens the gate
            time.sleep(0.1)
            waited += 0.1
        if os.environ.get("FAKE_FAIL") == objective:
            raise RuntimeError("boom")
        splits = ["s1", "s2"]
        def metrics(shift):
            m = {s: {"mean@2": value(objective, seed, i, delta, epsilon) + shift,
                     "pass@2": value(objective, seed, i, delta, epsilon) + 0.2 + shift} for i, s in enumerate(splits)}
            m["average"] = {k: sum(m[s][k] for s in splits) / 2 for k in ("mean@2", "pass@2")}
            return m
        after, before = metrics(0.0), metrics(-0.15)
        curves = {s: {"k": [1.0, 2.0], "mean": [after[s]["mean@2"]] * 2,
                      "pass": [after[s]["mean@2"], after[s]["pass@2"]]} for s in splits}
        (out / "eval").mkdir(exist_ok=True)
        (out / "eval" / "after.json").write_text(json.dumps({"metrics": after, "curves": curves, "seed": 0}))
        (out / "eval" / "before.json").write_text(json.dumps({"metrics": before, "curves": {}, "seed": 0}))
        with open(out / "metrics.jsonl", "w") as fh:
            for step in range(1, 11):
                row = {"stage": "rl", "step": step, "reward": BASE[objective] * step / 10,
                       "entropy": 1.0 - 0.05 * step + 0.01 * seed, "completions/mean_length": 20.0 + step,
                       "objective/clip_frac_low": 0.01 * seed, "objective/clip_frac_high": 0.02,
                       "objective/clip_frac": clip_frac(objective, seed) * step / 5.5,  # mean over RL: clip_frac
                       "objective/offpolicy_frac": 0.3}
                if step == 5:  # a periodic evaluation better than the final one on s1
                    row.update({f"eval/{s}/{k}": v + (0.05 if s == "s1" else -0.05)
                                for s, ms in after.items() for k, v in ms.items()})
                fh.write(json.dumps(row) + "\\n")
        if os.environ.get("FAKE_NO_SUMMARY") == objective:
            return {}
        summary = {"metric": "mean@2", "accuracy_after": {s: m["mean@2"] for s, m in after.items()},
                   "seconds": {"total": 1.5}, "rl_steps": 10}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary
''')


FAKE = {}
exec(FAKE_PIPELINE, FAKE)  # the stand-in's own formulas, to check the report against


@pytest.fixture()
def fake_env(tmp_path, monkeypatch):
    """A stand-in pipeline module importable by worker processes."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fake_pipeline.py").write_text(FAKE_PIPELINE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "pkg"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))  # and by `finish_in_process`
    return tmp_path / "out"


def finish_in_process(settings: CompareSettings, monkeypatch) -> list:
    """Every planned run finished by the worker's own code in this process (no worker processes: fast)."""
    import trustclip.compare.runner as worker
    from trustclip.compare.runner import prepare_run_dir

    runs = settings.plan()
    for spec in runs:  # plan order: each seed's SFT run before the RL runs that start from it
        prepare_run_dir(spec, pipeline=settings.pipeline)
        worker.run_worker(spec.run_dir)
        assert worker.is_finished(spec)
    return runs


def fake_settings(out: Path, objectives=("clip", "atr"), seeds=(0, 1, 2), **kwargs) -> CompareSettings:
    return CompareSettings(output_dir=out, objectives=list(objectives), seeds=list(seeds),
                           overrides=["eval.k=2", "rl.eval_every=5"], pipeline="fake_pipeline:pipeline",
                           jobs=2, **kwargs)


def one_rl_run(out: Path) -> CompareSettings:
    """clip, seed 0, without an SFT stage: one worker (each worker start imports torch: seconds)."""
    settings = fake_settings(out, objectives=("clip",), seeds=(0,))
    settings.overrides.append("stages=[rl, eval]")
    return settings


FIVE = (0, 1, 2, 3, 4)


def average(objective: str, seed: int, **hparams) -> float:
    """The stand-in's final Average Mean@2 of a run."""
    return (FAKE["value"](objective, seed, 0, **hparams) + FAKE["value"](objective, seed, 1, **hparams)) / 2


def test_report_cells_match_the_runs_numbers(fake_env):
    """Two objectives (one swept over delta) x 3 seeds with known numbers: every kind of cell is checked."""
    out = fake_env
    assert run_compare(fake_settings(out, sweep="delta=0.05,0.1"), say=lambda s: None) == 0
    for name in REPORT_FILES:
        assert (out / name).is_file(), name
    for name in (*FIGURES, "sweep.png"):
        assert (out / "figures" / name).read_bytes()[:8] == PNG_MAGIC
    text = (out / "report.md").read_text()
    seeds = (0, 1, 2)
    value = FAKE["value"]
    # Table 2: final (best) mean over seeds; the step-5 evaluation beats the final one on s1 only.
    t2 = md_table(text, "## Table 2")
    assert t2[0] == ["Objective", "s1 Mean@2", "s1 Pass@2", "s2 Mean@2", "s2 Pass@2", "Average Mean@2",
                     "Average Pass@2"]
    groups = [("clip", "clip", 0.0), ("atr_delta=0.05", "kl3", 0.05), ("atr_delta=0.1", "kl3", 0.1)]
    for row, (group, objective, delta) in zip(t2[1:], groups, strict=True):
        assert row[0] == group
        s1 = [value(objective, s, 0, delta) for s in seeds]
        s2 = [value(objective, s, 1, delta) for s in seeds]
        avg = [(a + b) / 2 for a, b in zip(s1, s2, strict=True)]
        assert row[1] == f"{pct(np.mean(s1))} ({pct(np.mean(s1) + 0.05)})"
        assert row[3] == f"{pct(np.mean(s2))} ({pct(np.mean(s2))})"  # final beats step 5 on s2
        assert row[4] == f"{pct(np.mean(s2) + 0.2)} ({pct(np.mean(s2) + 0.2)})"
        # "best" Average is the best checkpoint's average (step 5 has a lower average), not a mix of splits
        assert row[5] == f"{pct(np.mean(avg))} ({pct(np.mean(avg))})"
    # Table 3: mean ± sample std over seeds, and the RL start row.
    t3 = md_table(text, "## Table 3")
    clip = {i: [value("clip", s, i) for s in seeds] for i in (0, 1)}
    clip_avg = [(a + b) / 2 for a, b in zip(clip[0], clip[1], strict=True)]
    assert t3[1] == ["clip", "3", pm(clip[0]), pm(clip[1]), pm(clip_avg)]
    assert t3[-1][0] == "*RL start (SFT model)*" and t3[-1][2] == pm([v - 0.15 for v in clip[0]])
    assert "SFT shared per seed" in text
    calls = {p.parent.relative_to(out / "runs").as_posix(): p.read_text().split()
             for p in (out / "runs").glob("*/seed*/calls.txt")}
    start = (out / "runs" / "_sft" / "seed2" / "sft" / "final").resolve()
    assert calls["kl3_delta=0.1/seed2"][1:] == ["stages=rl,eval", f"model={start}"]  # folders: from the settings
    assert calls["_sft/seed2"][1] == "stages=sft"
    # Findings follow from paired intervals: at 3 seeds the bootstrap-t interval of a varying difference is
    # unbounded, so atr - clip is not resolved; the two deltas differ by exactly +10 points on every seed.
    gap = np.mean([average("kl3", s, delta=0.05) - average("clip", s) for s in seeds])
    assert (f"atr_delta=0.05 - clip, held-out Mean@2, final: +{100 * gap:.1f} points [95% CI -inf, +inf], n = 3 "
            "paired seeds; the interval includes 0: no difference resolved at n = 3") in text
    # Dynamics: entropy over the last 10% of steps (= step 10) and mean clip fraction over RL.
    dyn = md_table(text, "## Training dynamics")
    entropy = [0.5 + 0.01 * s for s in seeds]
    assert dyn[1][2] == f"{np.mean(entropy):.3f} ± {np.std(entropy, ddof=1):.3f}"
    clip_frac = [FAKE["clip_frac"]("clip", s) for s in seeds]
    assert dyn[0][4] == "active-constraint fraction (mean over RL)"
    assert dyn[1][4] == f"{np.mean(clip_frac):.4f} ± {np.std(clip_frac, ddof=1):.4f}"
    # results.csv holds the same numbers unrounded; results.json the groups' seeds.
    results = json.loads((out / "results.json").read_text())
    clip = next(g for g in results["groups"] if g["group"] == "clip")
    numbers = tidy_csv(out)
    assert {s: numbers[("clip", s, "final/s1/mean@2")] for s in seeds} == pytest.approx(
        {s: value("clip", s, 0) for s in seeds})
    assert clip["seeds"] == [0, 1, 2]
    csv_text = (out / "results.csv").read_text()
    assert f"clip/seed0,clip,0,final/s1/mean@2,{value('clip', 0, 0)}" in csv_text


def test_sweep_report_states_the_trend(fake_env, monkeypatch):
    """A sweep of 3 deltas: the report gives the per-seed slope of Mean@2 on log10 delta with its interval."""
    deltas = (0.02, 0.2, 2.0)
    settings = fake_settings(fake_env, objectives=("atr",), seeds=FIVE, sweep="delta=" + ",".join(map(str, deltas)))
    finish_in_process(settings, monkeypatch)
    settings.report_only = True
    assert run_compare(settings, say=lambda s: None) == 0
    text = (fake_env / "report.md").read_text()
    slope = np.polyfit(np.log10(deltas), [average("kl3", 0, delta=d) for d in deltas], 1)[0]
    assert slope > 0  # the stand-in adds 2 * delta, the same on every seed
    line = next(x for x in text.splitlines() if x.startswith("- atr - zero slope, slope of held-out Mean@2, final"))
    assert f"per tenfold delta: +{100 * slope:.1f} points" in line
    assert line.endswith(": higher than zero slope.") and f"n = {len(FIVE)}" in line

def test_paired_comparisons_intervals(fake_env, monkeypatch):
    """Five seeds of clip, atr and a clip variant: the paired table and results.json carry the intervals computed from
    the runs' own numbers; results.csv holds the tidy table only."""
    from trustclip.compare.paired_stats import paired_difference

    settings = fake_settings(fake_env, objectives=("clip", "atr", "clip[epsilon=0.3]"), seeds=FIVE)
    finish_in_process(settings, monkeypatch)
    settings.report_only = True
    assert run_compare(settings, say=lambda s: None) == 0
    text = (fake_env / "report.md").read_text()
    expected = paired_difference({s: average("kl3", s, delta=0.07) for s in FIVE},
                                 {s: average("clip", s) for s in FIVE}, group="atr", ref="clip", outcome="mean@K")
    assert 0 < expected.low < expected.high and expected.sd > 0  # a real interval: the seeds differ
    rows = {(r[0], r[1]): r[2:] for r in md_table(text, "## Paired comparisons against clip")[1:]}
    assert len(rows) == 2 * 9  # every other group x every outcome
    assert rows[("atr", "held-out Mean@2, final")] == [
        f"+{100 * expected.mean:.1f} points", f"[+{100 * expected.low:.1f}, +{100 * expected.high:.1f}]", "5",
        "higher", "not estimable" if expected.seeds_needed is None else str(expected.seeds_needed)]
    assert rows[("clip[epsilon=0.3]", "held-out Mean@2, final")][:4] == ["+10.0 points", "[+10.0, +10.0]", "5",
                                                                         "higher"]
    constraint = "active-constraint fraction, mean over RL (% of tokens)"
    assert rows[("atr", constraint)][:4] == ["-3.00 pp", "[-3.00, -3.00]", "5", "lower"]
    assert rows[("atr", "off-policy fraction (ratio outside [0.8, 1.2]), mean over RL (% of tokens)")][3] == "identical"
    assert rows[("atr", "collapse: final Mean@2 below the RL start (% of runs)")][3] == "identical"
    assert (f"atr - clip, held-out Mean@2, final: +{100 * expected.mean:.1f} points [95% CI +{100 * expected.low:.1f}, "
            f"+{100 * expected.high:.1f}], n = 5 paired seeds: higher than clip.") in text
    assert "studentised bootstrap (bootstrap-t)" in text
    results = json.loads((fake_env / "results.json").read_text())
    assert results["reference"] == "clip"
    entry = next(c for c in results["comparisons"] if c["group"] == "atr" and c["outcome"] == "mean@K")
    assert entry["seeds"] == list(FIVE) and entry["n"] == 5 and entry["verdict"] == "higher"
    assert (entry["low"], entry["high"]) == pytest.approx((expected.low, expected.high))
    assert entry["differences"] == pytest.approx(list(expected.differences))
    assert tidy_csv(fake_env)[("atr", 3, "mean@K")] == pytest.approx(average("kl3", 3, delta=0.07))
    assert (fake_env / "results.csv").read_text().splitlines()[0] == "run,group,seed,outcome,value"
    with (fake_env / "curves.csv").open() as fh:
        curves = list(csv.DictReader(fh))
    panels = {row["panel"] for row in curves if row["figure"] == "training_curves"}
    assert {"active-constraint fraction", "off-policy fraction (ratio outside [0.8, 1.2])", "reward (train)"} <= panels
    # the per-seed scatter against the reference: one point per paired seed, at (clip's, atr's) final average
    assert (fake_env / "figures" / "paired_by_seed.png").stat().st_size > 0
    paired = sorted((float(r["x"]), float(r["mean"])) for r in curves
                    if r["figure"] == "paired_by_seed" and r["group"] == "atr" and r["panel"].startswith("mean@"))
    expected_points = sorted((tidy_csv(fake_env)[("clip", s, "mean@K")], tidy_csv(fake_env)[("atr", s, "mean@K")])
                             for s in FIVE)
    assert len(paired) == len(FIVE)
    assert [v for point in paired for v in point] == pytest.approx([v for point in expected_points for v in point])


def test_reference_is_a_report_setting(fake_env, monkeypatch, capsys):
    """--reference changes no run: a report-only rebuild (CLI) compares against another group (here a variant),
    the choice is remembered, a bad name is refused before anything runs, and a full rerun with another
    reference starts nothing."""
    import argparse

    from trustclip.commands.compare import add_arguments, settings_from_args

    settings = fake_settings(fake_env, objectives=("clip", "atr", "clip[epsilon=0.3]"), seeds=(0, 1, 2, 3))
    runs = finish_in_process(settings, monkeypatch)
    markers = {spec.run_id: (spec.run_dir / "summary.json").stat().st_mtime_ns for spec in runs}
    write_json_atomic(fake_env / "compare.json", settings.experiment())  # as a compare saves it, for the CLI
    base = ["compare", "--output-dir", str(fake_env), "--report-only"]
    assert cli_main([*base, "--reference", "clip[ epsilon = 0.3 ]"]) == 0
    text = (fake_env / "report.md").read_text()
    assert "## Paired comparisons against clip[epsilon=0.3]" in text
    assert "clip - clip[epsilon=0.3], held-out Mean@2, final: -10.0 points [95% CI -10.0, -10.0]" in text
    assert json.loads((fake_env / "compare.json").read_text())["reference"] == "clip[ epsilon = 0.3 ]"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args(base[1:])).reference == "clip[ epsilon = 0.3 ]"  # remembered
    capsys.readouterr()
    assert cli_main([*base, "--reference", "sapo"]) == 2
    assert "--reference 'sapo' is not a compared group; groups: clip, atr, clip[epsilon=0.3]" in capsys.readouterr().err
    n = len(events(fake_env))
    settings.reference = "atr"
    assert run_compare(settings, say=lambda s: None) == 0
    assert started(events(fake_env, n)) == []
    assert "## Paired comparisons against atr" in (fake_env / "report.md").read_text()
    assert {spec.run_id: (spec.run_dir / "summary.json").stat().st_mtime_ns for spec in runs} == markers


def test_failed_run_does_not_stop_the_others(fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "clip")
    out = fake_env
    assert run_compare(fake_settings(out, seeds=(0,)), say=lambda s: None) == 1
    text = (out / "report.md").read_text()
    assert "Missing runs (1):** clip/seed0" in text and "worker exited with code 1" in text
    assert [r["run"] for r in events(out) if r["event"] == "fail"] == ["clip/seed0"]
    monkeypatch.delenv("FAKE_FAIL")
    n = len(events(out))
    assert run_compare(fake_settings(out, seeds=(0,)), say=lambda s: None) == 0  # the rerun retries it only
    assert started(events(out, n)) == ["clip/seed0"]


def test_one_worker_runs_whole_seeds_in_turn(fake_env):
    """jobs=1: each seed's SFT run, then that seed's RL runs, then the next seed: a compare stopped midway has
    complete seeds, not every SFT model and no RL run."""
    settings = fake_settings(fake_env, objectives=("clip",), seeds=(0, 1))
    settings.jobs = 1
    assert run_compare(settings, say=lambda s: None) == 0
    assert [r["run"] for r in events(fake_env) if r["event"] == "start"] == [
        "_sft/seed0", "clip/seed0", "_sft/seed1", "clip/seed1"]


def test_changed_settings_are_not_mixed(fake_env):
    out = fake_env
    assert run_compare(fake_settings(out, objectives=("clip",), seeds=(0,)), say=lambda s: None) == 0
    changed = fake_settings(out, objectives=("clip",), seeds=(0,))
    changed.overrides = [*changed.overrides, "rl.learning_rate=0.001"]
    with pytest.raises(ChangedRunError, match="different settings"):
        run_compare(changed, say=lambda s: None)
    shutil.rmtree(out / "runs" / "clip" / "seed0")  # what the message asks for: delete the run to redo it
    n = len(events(out))
    assert run_compare(changed, say=lambda s: None) == 0
    assert started(events(out, n)) == ["clip/seed0"]


def test_compares_sharing_a_runs_dir_make_each_run_once(fake_env):
    """Two experiments in one pool: the second makes only its new objective's runs, starts them from the first's SFT
    models, and reports the shared runs' numbers; each report stays in its own output directory."""
    pool = fake_env.parent / "pool"
    first = fake_settings(fake_env / "first", objectives=("clip", "atr"), seeds=(0, 1), runs_dir=str(pool))
    assert run_compare(first, say=lambda s: None) == 0
    assert (pool / "runs" / "clip" / "seed0" / "summary.json").is_file()
    assert not (fake_env / "first" / "runs").exists()
    second = fake_settings(fake_env / "second", objectives=("clip", "sapo"), seeds=(0, 1), runs_dir=str(pool))
    assert run_compare(second, say=lambda s: None) == 0
    assert started(events(fake_env / "second")) == ["sapo/seed0", "sapo/seed1"]
    skipped = sorted(r["run"] for r in events(fake_env / "second") if r["event"] == "skip")
    assert skipped == ["_sft/seed0", "_sft/seed1", "clip/seed0", "clip/seed1"]
    for report in ("first", "second"):
        numbers = tidy_csv(fake_env / report)
        assert [numbers[("clip", s, "final/average/mean@2")] for s in (0, 1)] == pytest.approx(
            [average("clip", s) for s in (0, 1)])
    saved = json.loads((fake_env / "second" / "compare.json").read_text())
    assert saved["runs_dir"] == str(pool)  # a rerun without --objectives finds the same pool


def test_a_runs_folder_follows_from_its_settings(tmp_path):
    def one(objectives, **kwargs):
        return rl_runs(objectives, [0], tmp_path, **kwargs)[0]

    plain = one(["atr"])
    changed = one(["atr[delta=0.2]"])
    assert changed.run_dir != plain.run_dir and changed.run_dir.parent.name == "kl3_delta=0.2"
    assert plain.run_dir.parent.name == "kl3"  # the registered name: atr and kl3 are one objective
    same = [one(["atr[delta=0.1]"]), one(["atr[delta=1e-1]"]), one(["kl3[delta=0.1]"]),
            next(r for r in rl_runs(["atr"], [0], tmp_path, sweep=parse_sweep("delta=0.1,0.3"))
                 if r.sweep_value == 0.1)]
    assert {r.run_dir for r in same} == {tmp_path / "runs" / "kl3_delta=0.1" / "seed0"}
    assert len({r.fingerprint() for r in same}) == 1
    higher = [one(["clip_higher[epsilon_low=0.2,epsilon_high=0.3]"]), one(["clip_higher[epsilon_high=0.3]"]),
              one(["dapo[epsilon_high=3e-1]"])]
    assert len({r.run_dir for r in higher}) == 1 and len({r.fingerprint() for r in higher}) == 1
    ints = [one(["dual_clip[clip_ratio_c=4]"]), one(["dual_clip[clip_ratio_c=4.0]"])]
    assert len({r.run_dir for r in ints}) == 1 and len({r.fingerprint() for r in ints}) == 1
    assert one(["dual_clip[clip_ratio_c=3]"]).run_dir == one(["dual_clip"]).run_dir  # its default


def test_pooled_compares_keep_their_own_runs_and_share_equal_ones(fake_env):
    """A group changed by its brackets does not land in (or delete) another compare's plain run; the same settings
    written three ways are made once."""
    pool = fake_env.parent / "pool"
    changed = fake_settings(fake_env / "changed", objectives=("atr[delta=0.2]",), seeds=(0,), runs_dir=str(pool))
    assert run_compare(changed, say=lambda s: None) == 0
    made = pool / "runs" / "kl3_delta=0.2" / "seed0" / "summary.json"
    mtime = made.stat().st_mtime_ns
    plain = fake_settings(fake_env / "plain", objectives=("atr",), seeds=(0,), runs_dir=str(pool))
    assert run_compare(plain, say=lambda s: None) == 0
    assert started(events(fake_env / "plain")) == ["atr/seed0"]
    assert made.stat().st_mtime_ns == mtime  # the other compare's run is untouched
    for i, written in enumerate(("atr[delta=0.1]", "atr[delta=1e-1]", "kl3[delta=0.1]")):
        settings = fake_settings(fake_env / f"same{i}", objectives=(written,), seeds=(0,), runs_dir=str(pool))
        assert run_compare(settings, say=lambda s: None) == 0
        assert started(events(fake_env / f"same{i}")) == ([f"{written}/seed0"] if i == 0 else [])
    assert sorted(p.name for p in (pool / "runs").iterdir()) == ["_sft", "kl3", "kl3_delta=0.1", "kl3_delta=0.2"]


def test_killed_compare_leaves_its_worker_to_finish_and_the_rerun_skips_it(fake_env):
    """SIGKILL the compare while its RL run is in progress: the orphaned worker finishes that run, holding the
    pool's lock (a rerun meanwhile is refused, naming how to find it), and the rerun then starts nothing."""
    out = fake_env
    cmd = [sys.executable, "-m", "trustclip.cli", "compare", "--objectives", "atr", "--seeds", "1",
           "--set", "eval.k=2", "--jobs", "1", "--output-dir", str(out)]
    gate = out.parent / "gate"
    proc = subprocess.Popen(cmd, env={**os.environ, "FAKE_GATE_kl3": str(gate),
                                      "TRUSTCLIP_TEST_PIPELINE": "fake_pipeline:pipeline"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    orphan_dir = out / "runs" / "kl3" / "seed0"
    deadline = time.time() + 120
    while not (orphan_dir / "calls.txt").is_file():
        assert time.time() < deadline and proc.poll() is None, "the RL run never started"
        time.sleep(0.2)
    first_marker = out / "runs" / "_sft" / "seed0" / "summary.json"
    mtime = first_marker.stat().st_mtime_ns
    worker_pid = next(r["pid"] for r in events(out) if r["event"] == "start" and r["run"] == "atr/seed0")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = (out / "compare.json").stat().st_mtime_ns
    try:
        meanwhile = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=180)
        assert meanwhile.returncode == 2 and "pgrep -f trustclip.compare.runner" in meanwhile.stderr
        assert _alive(worker_pid) and (out / "compare.json").stat().st_mtime_ns == saved  # refused before writing
        gate.touch()
        deadline = time.time() + 120
        while _alive(worker_pid):
            assert time.time() < deadline, "the orphaned worker never ended"
            time.sleep(0.2)
    finally:
        if _alive(worker_pid):
            os.killpg(worker_pid, signal.SIGKILL)
    assert (orphan_dir / "summary.json").is_file()
    n = len(events(out))
    result = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    rerun = events(out, n)
    assert started(rerun) == [] and [r["run"] for r in rerun if r["event"] == "skip"] == ["_sft/seed0", "atr/seed0"]
    assert [line.split()[0] for line in (orphan_dir / "calls.txt").read_text().splitlines()] == ["resume=False"]
    assert first_marker.stat().st_mtime_ns == mtime


def test_a_failed_sft_run_fails_its_rl_runs_without_starting_them(fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "sft")
    assert run_compare(fake_settings(fake_env, objectives=("clip",), seeds=(0,)), say=lambda s: None) == 1
    reasons = {r["run"]: r["reason"] for r in events(fake_env) if r["event"] == "fail"}
    assert reasons["clip/seed0"] == "its SFT run _sft/seed0 failed" and "code 1" in reasons["_sft/seed0"]
    assert started(events(fake_env)) == ["_sft/seed0"]


def test_a_pipeline_that_writes_no_summary_fails_its_run(fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_NO_SUMMARY", "clip")
    assert run_compare(one_rl_run(fake_env), say=lambda s: None) == 1
    reason = next(r["reason"] for r in events(fake_env) if r["event"] == "fail")
    assert reason.startswith("the pipeline returned without writing summary.json; log: ")


def _signal_when_running(run_dir: Path, sig: int, then=None) -> None:
    """(A thread) once the run's worker has started, send `sig` to this process, then call `then`."""
    def send() -> None:
        deadline = time.time() + 120
        while not (run_dir / "calls.txt").is_file() and time.time() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), sig)
        if then is not None:
            time.sleep(1.0)
            then()

    threading.Thread(target=send, daemon=True).start()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])  # Ctrl-C, a closed terminal (SIGTERM: the same path)
def test_a_stop_signal_stops_the_workers_and_the_rerun_resumes_them(fake_env, monkeypatch, sig):
    """The signal while a run is in progress: its worker is stopped, the run logged as interrupted, the compare exits
    130 with its handlers restored; the rerun resumes that run (the trainer's resume) and starts nothing else."""
    gate, run_dir, said = fake_env.parent / "gate", fake_env / "runs" / "clip" / "seed0", []
    monkeypatch.setenv("FAKE_GATE_clip", str(gate))  # the run waits for the gate
    # pytest started by `nohup` or `&` inherits the signal ignored, and the compare rightly keeps it ignored (the test
    # below): give this process a handler of its own, as an interactive shell does.
    def before(*_):
        return None

    previous = signal.signal(sig, before)
    try:
        _signal_when_running(run_dir, sig)
        assert run_compare(one_rl_run(fake_env), say=said.append) == 130
        assert signal.getsignal(sig) is before
    finally:
        signal.signal(sig, previous)
    assert any("interrupted: stopped 1 running run(s)" in s for s in said)
    assert not _alive(next(r["pid"] for r in events(fake_env) if r["event"] == "start" and r["run"] == "clip/seed0"))
    assert [r["run"] for r in events(fake_env) if r["event"] == "interrupted"] == ["clip/seed0"]
    gate.touch()
    n = len(events(fake_env))
    assert run_compare(one_rl_run(fake_env), say=lambda s: None) == 0
    rerun = events(fake_env, n)
    assert started(rerun) == ["clip/seed0"] and next(r for r in rerun if r["event"] == "start")["resumed"] is True
    assert [r["run"] for r in rerun if r["event"] == "skip"] == []
    assert [line.split()[0] for line in (run_dir / "calls.txt").read_text().splitlines()] == [
        "resume=False", "resume=True"]


def test_a_hangup_ignored_by_nohup_stays_ignored(fake_env, monkeypatch):
    """`nohup trustclip compare ...`: SIGHUP was ignored when the compare started, so a hang-up does not stop it."""
    gate = fake_env.parent / "gate"
    monkeypatch.setenv("FAKE_GATE_clip", str(gate))
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        _signal_when_running(fake_env / "runs" / "clip" / "seed0", signal.SIGHUP, then=gate.touch)
        assert run_compare(one_rl_run(fake_env), say=lambda s: None) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.is_file() and "zombie" in status.read_text())


def test_second_compare_on_the_same_directory_is_refused(fake_env):
    with try_lock(fake_env / COMPARE_LOCK), pytest.raises(RuntimeError, match="another compare"):
        execute([], fake_env)


def test_one_lock_per_pool_refuses_a_compare_with_another_output_dir(fake_env):
    """Compares sharing --runs-dir take one lock, the pool's: a second one fails at once, naming the holder."""
    pool = fake_env.parent / "pool"
    settings = fake_settings(fake_env / "second", objectives=("clip",), seeds=(0,), runs_dir=str(pool))
    with try_lock(pool / COMPARE_LOCK), pytest.raises(RuntimeError, match=rf"another compare \(pid {os.getpid()}\)"):
        run_compare(settings, say=lambda s: None)
    assert not (pool / "runs").exists()  # no run was started


# ------------------------------------------------------------------------- real end to end (tiny setting)
TINY = ["sft.max_steps=2", "sft.per_device_train_batch_size=8", "rl.max_steps=3", "rl.num_generations=4",
        "rl.per_device_train_batch_size=8", "rl.max_completion_length=16", "rl.eval_every=2", "rl.save_steps=2",
        "data.eval_limit=3", "eval.k=2", "eval.max_new_tokens=16", "report_to=none", "plots=false"]


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out"
    settings = CompareSettings(output_dir=out, objectives=["clip", "atr"], seeds=[0, 1], overrides=TINY, jobs=2)
    lines: list[str] = []
    t0 = time.time()
    code = run_compare(settings, say=lines.append)
    assert code == 0, "\n".join(lines)
    return out, settings, time.time() - t0


def _run_numbers(run_dir: Path) -> dict:
    after = json.loads((run_dir / "eval" / "after.json").read_text())["metrics"]
    best = {s: dict(m) for s, m in after.items()}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        for key, v in row.items():
            if key.startswith("eval/"):
                split, metric = key[5:].rsplit("/", 1)
                best[split][metric] = max(best[split][metric], v)
    rl = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("stage") == "rl" and "entropy" in r]
    return {"after": after, "best": best, "entropy": rl[-1]["entropy"], "n_evals": 1 + sum(
        any(k.startswith("eval/") for k in r) for r in read_jsonl(run_dir / "metrics.jsonl"))}


def test_end_to_end_every_file_and_cell(tiny_compare):
    out, _, _ = tiny_compare
    for name in REPORT_FILES:
        assert (out / name).stat().st_size > 0, name
    for name in FIGURES:
        assert (out / "figures" / name).read_bytes()[:8] == PNG_MAGIC
    text = (out / "report.md").read_text()
    folders = {"clip": "clip", "atr": "kl3"}  # a run's folder is named by its settings
    numbers = {(o, s): _run_numbers(out / "runs" / folders[o] / f"seed{s}") for o in folders for s in (0, 1)}
    t2 = md_table(text, "## Table 2")
    splits = [h.rsplit(" ", 1)[0] for h in t2[0][1::2]]
    keys = ["average" if s == "Average" else s for s in splits]
    assert keys[:-1] == ["amc_like", "aime24_like", "aime25_like"]
    cells_checked = 0
    for row in t2[1:]:
        objective = row[0]
        for i, split in enumerate(keys):
            for j, metric in enumerate(("mean@2", "pass@2")):
                final = np.mean([numbers[(objective, s)]["after"][split][metric] for s in (0, 1)])
                best = np.mean([numbers[(objective, s)]["best"][split][metric] for s in (0, 1)])
                assert row[1 + 2 * i + j] == f"{pct(final)} ({pct(best)})"
                cells_checked += 1
    for row in md_table(text, "## Table 3")[1:3]:
        assert row[1] == "2"
        for i, split in enumerate(keys):
            assert row[2 + i] == pm([numbers[(row[0], s)]["after"][split]["mean@2"] for s in (0, 1)])
            cells_checked += 1
    for row in md_table(text, "## Training dynamics")[1:]:
        entropy = [numbers[(row[0], s)]["entropy"] for s in (0, 1)]
        assert row[2] == f"{np.mean(entropy):.3f} ± {np.std(entropy, ddof=1):.3f}"
        assert float(row[2].split(" ± ")[0]) > 0  # a real, non-trivial number from metrics.jsonl
    rows = tidy_csv(out)  # every run's own numbers, unrounded
    for (objective, seed), n in numbers.items():
        assert rows[(objective, seed, "final/average/mean@2")] == pytest.approx(n["after"]["average"]["mean@2"])
        assert rows[(objective, seed, "best/average/mean@2")] == pytest.approx(n["best"]["average"]["mean@2"])
    checkpoints = "/".join(map(str, sorted({n["n_evals"] for n in numbers.values()})))
    assert f"'best' is the maximum over {checkpoints} evaluated RL checkpoints" in text
    assert cells_checked == 2 * 8 + 2 * 4
    # the paired comparison of atr with clip, from the runs' own final numbers: 2 seeds give an unbounded
    # bootstrap-t interval (or a point when both seeds differ equally), never a verdict from a hand rule
    results = json.loads((out / "results.json").read_text())
    assert results["reference"] == "clip"
    entry = next(c for c in results["comparisons"] if c["group"] == "atr" and c["outcome"] == "mean@K")
    diffs = [numbers[("atr", s)]["after"]["average"]["mean@2"] - numbers[("clip", s)]["after"]["average"]["mean@2"]
             for s in (0, 1)]
    assert entry["seeds"] == [0, 1] and entry["differences"] == pytest.approx(diffs, abs=1e-12)
    row = next(r for r in md_table(text, "## Paired comparisons against clip") if r[1] == "held-out Mean@2, final")
    assert row[0] == "atr" and row[4] == "2"
    if diffs[0] == diffs[1]:
        assert row[3] == f"[{100 * diffs[0]:+.1f}, {100 * diffs[0]:+.1f}]"
    else:
        assert row[3] == "[-inf, +inf]" and row[5] == "not resolved"
        assert entry["low"] is None and entry["high"] is None and entry["bounded"] is False


def test_end_to_end_rerun_redoes_only_the_unfinished_run(tiny_compare):
    out, settings, _ = tiny_compare
    markers = {p.parent.relative_to(out / "runs").as_posix(): p
               for p in (out / "runs").glob("*/seed*/summary.json")}
    assert sorted(markers) == ["_sft/seed0", "_sft/seed1", "clip/seed0", "clip/seed1", "kl3/seed0", "kl3/seed1"]
    mtimes = {k: p.stat().st_mtime_ns for k, p in markers.items()}
    markers["kl3/seed1"].unlink()  # as if the compare had been killed before atr/seed1's pipeline ended
    n = len(events(out))
    assert run_compare(settings, say=lambda s: None) == 0
    rerun = events(out, n)
    assert started(rerun) == ["atr/seed1"]
    assert sorted(r["run"] for r in rerun if r["event"] == "skip") == ["_sft/seed0", "_sft/seed1", "atr/seed0",
                                                                        "clip/seed0", "clip/seed1"]
    for key, path in markers.items():
        assert path.is_file()
        assert (path.stat().st_mtime_ns == mtimes[key]) == (key != "kl3/seed1")


def test_held_out_length_and_entropy_are_outcomes_only_where_recorded(fake_env, monkeypatch):
    """An evaluation with completion stats gives the runs `eval_length` / `eval_entropy` outcomes (the held-out
    average), compared with the reference paired by seed; runs evaluated without them keep the old outcome list."""
    from trustclip.compare.results import OPTIONAL, group_runs, load_run, outcomes_of, paired_comparisons, run_rows

    settings = fake_settings(fake_env, objectives=("clip", "atr"), seeds=(0, 1))
    runs = [spec for spec in finish_in_process(settings, monkeypatch) if spec.kind == "rl"]
    plain = group_runs([load_run(spec) for spec in runs])
    assert not {o.key for o in outcomes_of(plain)} & set(OPTIONAL)
    assert not {d.outcome for d in paired_comparisons(plain, "clip")} & set(OPTIONAL)

    def length(objective, seed):
        return 20.0 + 5 * seed + (10.0 if objective == "kl3" else 0.0)

    for spec in runs:
        path = spec.run_dir / "eval" / "after.json"
        data = json.loads(path.read_text())
        stats = {"length": length(spec.objective, spec.seed), "entropy": 0.5 + 0.1 * spec.seed}
        data["completion_stats"] = {"s1": stats, "s2": stats, "average": stats}
        path.write_text(json.dumps(data))
    records = [load_run(spec) for spec in runs]
    row = run_rows(records[0])
    assert row["eval_length"] == length(runs[0].objective, runs[0].seed)
    assert row["completions/final/s1/entropy"] == pytest.approx(0.5 + 0.1 * runs[0].seed)
    diffs = {d.outcome: d for d in paired_comparisons(group_runs(records), "clip")}
    assert diffs["eval_length"].mean == pytest.approx(10.0) and diffs["eval_length"].n == 2
    assert diffs["eval_entropy"].mean == pytest.approx(0.0)
    from trustclip.compare.report import completions_table

    assert completions_table(plain) is None  # old runs: no such table in their report
    table = completions_table(group_runs(records))
    assert table.splitlines()[2].startswith("| clip | n/a | 22.5 ± 3.5 | n/a | 0.550 ± 0.071 |")  # no before stats


def test_the_report_shows_how_many_held_out_problems_can_separate_the_groups(fake_env, monkeypatch):
    """Where the final evaluations recorded each problem's count of correct samples, the report gives per split and
    group the share of problems solved 0 of K and K of K times, and the share of (seed, problem) pairs tied with the
    reference at one of those extremes; problems.csv has every count. Runs without the counts: no such section."""
    from trustclip.compare.report import problem_rows, problems_table
    from trustclip.compare.results import group_runs, load_run, splits_of

    settings = fake_settings(fake_env, objectives=("clip", "atr"), seeds=(0, 1))
    runs = [spec for spec in finish_in_process(settings, monkeypatch) if spec.kind == "rl"]
    assert problems_table(group_runs([load_run(spec) for spec in runs]), ["s1", "s2"], 2, "clip") is None
    s1 = {("clip", 0): [0, 2, 1, 2], ("clip", 1): [0, 0, 2, 1], ("kl3", 0): [0, 2, 2, 1], ("kl3", 1): [1, 0, 2, 2]}
    for spec in runs:
        path = spec.run_dir / "eval" / "after.json"
        data = json.loads(path.read_text())
        data["solved"] = {"s1": s1[(spec.objective, spec.seed)], "s2": [2, 2, 2, 2]}  # s2: every sample right
        path.write_text(json.dumps(data))
    records = [load_run(spec) for spec in runs]
    groups = group_runs(records)
    rows = [line.split(" | ") for line in problems_table(groups, splits_of(records), 2, "clip").splitlines()[2:]]
    assert [[cell.strip("| ") for cell in row] for row in rows] == [
        ["s1", "clip", "2", "4", "37.5", "37.5", "-"],  # 0 of 2: 1/4 and 2/4 of the problems; 2 of 2: 2/4, 1/4
        ["s1", "atr", "2", "4", "25.0", "50.0", "50.0"],  # tied at 0 or 2 with clip's run: 2 of 4 on each seed
        ["s2", "clip", "2", "4", "0.0", "100.0", "-"],
        ["s2", "atr", "2", "4", "0.0", "100.0", "100.0"]]  # nothing on s2 can separate them
    assert problems_table(groups, splits_of(records), 2, None).splitlines()[0].count("|") == 7  # no tied column
    csv_rows = problem_rows(groups)
    assert len(csv_rows) == 2 * 2 * 2 * 4
    assert [r["solved"] for r in csv_rows if r["group"] == "atr" and r["seed"] == 1 and r["split"] == "s1"] == [
        1, 0, 2, 2]
    write_json_atomic(fake_env / "compare.json", settings.experiment())
    assert cli_main(["compare", "--output-dir", str(fake_env), "--report-only"]) == 0
    assert "## Held-out problems: how many can separate the groups" in (fake_env / "report.md").read_text()
    assert (fake_env / "problems.csv").read_text().count("\n") == 1 + 32


def test_dynamics_table_shows_what_acts_in_cfpo_and_m2po_only_where_logged(fake_env, monkeypatch):
    """cfpo never clips (clip_frac 0) and m2po masks whatever the sign of A: their own statistics, under the names the
    objectives give them, get a column (n/a for the runs that did not log them); reports without them are unchanged."""
    import torch

    from trustclip.compare.report import dynamics_table
    from trustclip.compare.results import SERIES, group_runs, load_run
    from trustclip.objectives import compute_token_loss

    ones = torch.ones(1, 2, dtype=torch.float64)
    logged = {name: f"objective/{stat}" for name, stat in (("cfpo", "pushback_frac"), ("m2po", "m2_masked_frac"))}
    for name, key in logged.items():  # the keys the report reads are the statistics the objectives return
        out, _ = compute_token_loss(name, logp=-ones, old_logp=-2 * ones, advantages=torch.ones(1), mask=ones)
        assert key.removeprefix("objective/") in out.stats and key in SERIES
    settings = fake_settings(fake_env, objectives=("clip", "atr"), seeds=(0, 1))
    runs = [spec for spec in finish_in_process(settings, monkeypatch) if spec.kind == "rl"]
    plain = dynamics_table(group_runs([load_run(spec) for spec in runs]))
    assert "cfpo" not in plain and "m2po" not in plain
    for spec in runs:
        if spec.objective == "kl3":  # atr's runs stand in for runs that log cfpo's pull-back fraction
            path = spec.run_dir / "metrics.jsonl"
            rows = [row | {logged["cfpo"]: 0.01 * row["step"] * (1 + spec.seed)} for row in read_jsonl(path)]
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    table = md_table("## T\n" + dynamics_table(group_runs([load_run(spec) for spec in runs])), "## T")
    column = table[0].index("penalty pull-back fraction (cfpo) (mean over RL)")
    means = [0.055 * (1 + seed) for seed in (0, 1)]  # mean over steps 1-10 of 0.01 step (1 + seed)
    assert table[1][0] == "clip" and table[1][column] == "n/a"
    assert table[2][column] == f"{np.mean(means):.4f} ± {np.std(means, ddof=1):.4f}"
    assert not any("m2po" in head for head in table[0])


def test_findings_give_how_rl_moved_held_out_entropy_and_length(fake_env, monkeypatch):
    """Where evaluations recorded completion stats, the Findings pair each run's final held-out entropy and length
    with its own RL start; without them, no such sentence."""
    from trustclip.compare.report import findings
    from trustclip.compare.results import group_runs, load_run

    settings = fake_settings(fake_env, objectives=("clip", "atr"), seeds=(0, 1, 2, 3, 4))
    runs = [spec for spec in finish_in_process(settings, monkeypatch) if spec.kind == "rl"]
    args = (["s1", "s2", "average"], ["mean@2", "pass@2"], 10, 10, 5, "clip", [])
    assert not any("held-out entropy" in line for line in findings(group_runs([load_run(s) for s in runs]), *args))
    for spec in runs:
        for when, entropy, length in (("before", 0.4, 20.0), ("after", 0.4 - 0.1 * (spec.seed + 1), 20.0 + spec.seed)):
            path = spec.run_dir / "eval" / f"{when}.json"
            data = json.loads(path.read_text())
            stats = {"length": length, "entropy": entropy}
            data["completion_stats"] = {"s1": stats, "s2": stats, "average": stats}
            path.write_text(json.dumps(data))
    text = findings(group_runs([load_run(s) for s in runs]), *args)
    entropy = [line for line in text if "held-out entropy" in line]
    length = [line for line in text if "held-out completion length" in line]
    assert [line.split(",")[0] for line in entropy] == ["clip - RL start", "atr - RL start"]
    assert entropy[0].startswith("clip - RL start, held-out entropy, Average (nats/token, T = 1): -0.300 nats [")
    assert entropy[0].endswith("n = 5 paired seeds: lower than RL start.")  # every seed lower: -0.1 ... -0.5
    assert length[1].startswith("atr - RL start, held-out completion length, Average (tokens): +2.0 tokens [")


def test_tidy_table_is_the_one_source_of_every_group_number(fake_env, monkeypatch):
    """Every number of a run is one row (run, group, seed, outcome, value); a group's numbers are its pivot, `gain` is
    final - RL start once (the outcome, the per-split rows and the Findings' gain sentence agree), and results.csv
    holds the same rows."""
    from trustclip.compare.report import findings
    from trustclip.compare.results import group_runs, load_run, tidy

    settings = fake_settings(fake_env, objectives=("clip", "atr"), seeds=(0, 1))
    runs = [spec for spec in finish_in_process(settings, monkeypatch) if spec.kind == "rl"]
    records = [load_run(spec) for spec in runs]
    rows = tidy(records)
    assert {tuple(row) for row in rows} == {("run", "group", "seed", "outcome", "value")}
    value = {(row["run"], row["outcome"]): row["value"] for row in rows}
    for r in records:
        value_of = FAKE["value"]  # the registered objective (atr is kl3) at its hyper-parameters
        expected = {f"s{i + 1}": value_of(r.spec.objective, r.spec.seed, i, **r.spec.hparams) for i in (0, 1)}
        expected["average"] = (expected["s1"] + expected["s2"]) / 2  # the stand-in's formulas, not a copy of a file
        for split in ("s1", "s2", "average"):
            for metric, shift in (("mean@2", 0.0), ("pass@2", 0.2)):
                assert value[(r.spec.run_id, f"final/{split}/{metric}")] == pytest.approx(expected[split] + shift)
                assert value[(r.spec.run_id, f"gain/{split}/{metric}")] == pytest.approx(0.15)  # the stand-in's start
        assert value[(r.spec.run_id, "gain")] == value[(r.spec.run_id, "gain/average/mean@2")]
        assert value[(r.spec.run_id, "collapse")] == 0.0
        assert value[(r.spec.run_id, "mean@K")] == pytest.approx(expected["average"])
    groups = group_runs(records)
    assert [g.group for g in groups] == ["clip", "atr"]
    clip = groups[0]
    assert clip.values["final/s1/mean@2"] == pytest.approx({s: FAKE["value"]("clip", s, 0) for s in (0, 1)})
    assert clip.stat("final/s1/mean@2").mean == pytest.approx(np.mean([FAKE["value"]("clip", s, 0) for s in (0, 1)]))
    assert clip.stat("gain/average/mean@2").n == 2
    text = findings(groups, ["s1", "s2", "average"], ["mean@2", "pass@2"], 4, 4, 5, "clip", [])
    assert "clip - RL start, held-out Average Mean@2: +15.0 points [95% CI +15.0, +15.0], n = 2 paired seeds: " \
           "higher than RL start." in text
    settings.report_only = True
    assert run_compare(settings, say=lambda s: None) == 0
    with (fake_env / "results.csv").open() as fh:
        csv_rows = list(csv.DictReader(fh))
    assert len(csv_rows) == len(rows)
    assert {(row["run"], row["outcome"]) for row in csv_rows} >= {
        ("clip/seed0", "final/s1/mean@2"), ("atr/seed1", "gain/average/pass@2"), ("clip/seed1", "gain"),
        ("atr/seed0", "dynamics/entropy (last 10%)")}


def test_a_failed_resume_fails_once_and_says_how_to_restart(fake_env, monkeypatch):
    """A partial run whose resume fails is reported failed (no silent restart from scratch); the message names the
    two ways on (rerun, or delete that run's folder), and a rerun after deleting it starts it afresh."""
    monkeypatch.setenv("FAKE_FAIL", "clip")
    settings = fake_settings(fake_env, objectives=("clip",), seeds=(0,))
    assert run_compare(settings, say=lambda s: None) == 1  # the fake pipeline leaves state.json behind
    n = len(events(fake_env))
    said: list[str] = []
    assert run_compare(settings, say=said.append) == 1
    rerun = events(fake_env, n)
    assert [(r["event"], r.get("resumed")) for r in rerun if r["event"] in ("start", "fail")] == [
        ("start", True), ("fail", None)]
    assert any(f"rerun to resume it, or delete {fake_env / 'runs' / 'clip' / 'seed0'} to start this run afresh" in line
               for line in said)
    monkeypatch.delenv("FAKE_FAIL")
    shutil.rmtree(fake_env / "runs" / "clip" / "seed0")
    n = len(events(fake_env))
    assert run_compare(settings, say=lambda s: None) == 0
    assert [r["resumed"] for r in events(fake_env, n) if r["event"] == "start"] == [False]
    calls = (fake_env / "runs" / "clip" / "seed0" / "calls.txt").read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("resume=False")  # the failed attempts' files were removed


# ------------------------------------------------------------------------- the Makefile's experiments
REPO = Path(__file__).resolve().parents[1]


def makefile_compare(target: str) -> tuple[str, str, Path]:
    """(--objectives, --reference, the testbed recipe) of a `make` experiment target, as the Makefile writes them."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(rf"^{target}:.*\n\t(.*)$", text, re.M).group(1)
    return (re.search(r"--objectives (\S+)", recipe).group(1).strip('"'),
            re.search(r"--reference (\S+)", recipe).group(1),
            REPO / re.search(r"^TESTBED := (\S+)", text, re.M).group(1))


def test_make_rivals_plans_every_rival_and_reuses_table2s_runs(tmp_path):
    """`make rivals`: atr, clip, the four rivals and the control on the testbed, paired against atr, each run
    accepted by `trustclip train`'s checks; atr, clip and the control are the same runs (same folders in the shared
    pool) as `make table2`'s, so they are made once."""
    from trustclip.compare.runner import check_runs

    objectives, reference, testbed = makefile_compare("rivals")
    base = base_config(str(testbed), [])
    rivals = [s for s in plan_runs(objectives, [0], tmp_path, base=base) if s.kind == "rl"]
    assert {s.objective for s in rivals} == {"kl3", "clip", "dppo_tv", "dppo_kl", "cfpo", "m2po", "unconstrained"}
    assert resolve_reference(reference, [(s.group, s.label, s.objective) for s in rivals]) == "atr"
    check_runs(rivals)
    table2 = {s.objective: s.run_dir for s in plan_runs(makefile_compare("table2")[0], [0], tmp_path, base=base)
              if s.kind == "rl"}
    shared = {s.objective for s in rivals if table2.get(s.objective) == s.run_dir}
    assert shared == {"kl3", "clip", "unconstrained"}
