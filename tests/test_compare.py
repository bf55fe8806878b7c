"""`trustclip compare`: planning, seed statistics and generated sentences, resumable execution (with a
fast stand-in pipeline that writes the trainer's files), and one real end-to-end compare of two objectives
x two seeds on a tiny setting whose report cells are checked against the runs' own logs."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from trustclip.cli import main as cli_main
from trustclip.compare import CompareSettings, plan_runs, run_compare
from trustclip.compare.plan import parse_hparams, parse_objectives, parse_seeds, parse_sweep
from trustclip.compare.runner import ChangedRunError, execute
from trustclip.compare.stats import ahead, change_sentence, rank_sentence, stat
from trustclip.files import read_jsonl, write_json_atomic
from trustclip.train.config import load_config

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


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def pm(values: list[float]) -> str:
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values, ddof=1):.1f}"


# ---------------------------------------------------------------------------------------- planning tests
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
    own = plan_runs(["clip", "atr"], [0], tmp_path, share_sft=False)
    assert [r.run_id for r in own] == ["clip/seed0", "atr/seed0"] and own[0].config["stages"] == ["sft", "rl", "eval"]


def test_periodic_evaluation_is_on_unless_turned_off(tmp_path):
    def every(**kwargs) -> int:
        return CompareSettings(output_dir=tmp_path, objectives=["clip"], **kwargs).base_config()["rl"]["eval_every"]

    default_steps = load_config().rl.max_steps
    assert every() == default_steps // 5  # the embedded default has none: compare adds 5 evaluation points
    assert every(overrides=["rl.max_steps=20"]) == 4
    assert every(overrides=["rl.eval_every=0"]) == 0 and every(eval_every=0) == 0
    assert every(eval_every=7, overrides=["rl.eval_every=3"]) == 7


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

    import trustclip.train.config as config_module
    from trustclip.compare.worker import build_config

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
    runs = plan_runs(["clip", "atr"], [0], tmp_path, sweep=parse_sweep("delta=0.03,0.1"),
                     hparams=parse_hparams(["clip.epsilon=0.3"], ["clip", "atr"]), share_sft=False)
    assert [r.group for r in runs] == ["clip", "atr_delta=0.03", "atr_delta=0.1"]
    assert runs[0].hparams == {"epsilon": 0.3} and runs[0].sweep_key is None
    assert [r.hparams["delta"] for r in runs[1:]] == [0.03, 0.1]
    lr = plan_runs(["clip"], [0], tmp_path, sweep=parse_sweep("rl.learning_rate=1e-4,2e-4"), share_sft=False)
    assert [r.config["rl"]["learning_rate"] for r in lr] == [1e-4, 2e-4]


@pytest.mark.parametrize(("call", "message"), [
    (lambda p: plan_runs(["clip", "sapo"], [0], p, sweep=parse_sweep("delta=0.1")), "no compared objective"),
    (lambda p: parse_objectives("kl3,atr"), "same objective"),
    (lambda p: parse_objectives("clip,nope"), "unknown objective 'nope'"),
    (lambda p: plan_runs(["atr"], [0], p, hparams={"atr": {"delta": -1}}), "delta=-1 is invalid"),
    (lambda p: plan_runs(["clip"], [0], p, hparams={"clip": {"delta": 0.1}}), "unknown hyper-parameter"),
    (lambda p: plan_runs(["clip"], [0], p, overrides=["seed=3"]), "set by compare itself"),
    (lambda p: plan_runs(["clip"], [0], p, overrides=["rl.max_steps=0"]), "rl.max_steps=0 is invalid"),
    (lambda p: parse_hparams(["sapo.tau_pos=2"], ["clip"]), "not compared"),
    (lambda p: parse_sweep("delta"), "expected KEY=V1,V2"),
    (lambda p: parse_sweep("delta=0.1,0.1"), "repeated"),
    (lambda p: parse_seeds(0), ">= 1"),
    (lambda p: parse_seeds(seed_list="1,1"), "distinct"),
])
def test_bad_input_is_a_clear_error(tmp_path, call, message):
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
    assert cli_main(["compare", "--output-dir", str(tmp_path / "saved"), "--dry-run"]) == 0
    assert "clip/seed0" in capsys.readouterr().out


# ----------------------------------------------------------------------------------- statistics and text
def test_rank_sentence_only_claims_a_lead_beyond_the_seed_spread():
    separated = {"a": stat([0.50, 0.52, 0.54]), "b": stat([0.30, 0.32, 0.34])}
    assert ahead(separated["a"], separated["b"])
    text = rank_sentence("acc", separated)
    assert "**a** has the highest mean (52.0 ± 2.0 points, n=3)" in text and "above every other" in text
    close = {"a": stat([0.50, 0.40, 0.60]), "b": stat([0.45, 0.46, 0.47])}
    assert "within seed spread of b (46.0 ± 1.0)" in rank_sentence("acc", close)
    assert "no ordering is claimed" in rank_sentence("acc", {"a": stat([0.9]), "b": stat([0.1])})
    assert "share the highest mean" in rank_sentence("acc", {"a": stat([0.0, 0.0]), "b": stat([0.0, 0.0])})
    assert "lowest" in rank_sentence("loss", separated, higher_is_better=False)
    assert "increase larger" in change_sentence("a", stat([0.1, 0.12, 0.11]), "acc")
    assert "not distinguishable" in change_sentence("a", stat([0.1, -0.1, 0.0]), "acc")
    assert math.isnan(stat([1.0]).std) and stat([1.0, float("nan"), 3.0]).n == 2


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
    import json, os, time
    from pathlib import Path

    BASE = {"clip": 0.20, "kl3": 0.50, "sapo": 0.30}

    def value(objective, seed, split_index, delta=0.0):
        return BASE[objective] + 2 * delta + 0.1 * split_index + 0.03 * seed

    def pipeline(config):
        out = Path(config.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        objective, seed = config.rl.objective, config.seed
        delta = config.rl.objective_kwargs.get("delta", 0.0)
        (out / "state.json").write_text(json.dumps({"started": True}))
        with open(out / "calls.txt", "a") as fh:
            fh.write(f"resume={config.resume} stages={','.join(config.stages)} model={config.model.name_or_path}\\n")
        if "rl" not in config.stages:  # a shared SFT run
            (out / "sft" / "final").mkdir(parents=True, exist_ok=True)
            (out / "sft" / "final" / "config.json").write_text("{}")
            (out / "summary.json").write_text(json.dumps({"metric": "mean@2", "seconds": {"total": 0.5}}))
            return {}
        time.sleep(float(os.environ.get("FAKE_DELAY_" + objective, "0")))
        if os.environ.get("FAKE_FAIL") == objective:
            raise RuntimeError("boom")
        splits = ["s1", "s2"]
        def metrics(shift):
            m = {s: {"mean@2": value(objective, seed, i, delta) + shift,
                     "pass@2": value(objective, seed, i, delta) + 0.2 + shift} for i, s in enumerate(splits)}
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
                       "objective/clip_frac_low": 0.01 * seed, "objective/clip_frac_high": 0.02}
                if step == 5:  # a periodic evaluation better than the final one on s1
                    row.update({f"eval/{s}/{k}": v + (0.05 if s == "s1" else -0.05)
                                for s, ms in after.items() for k, v in ms.items()})
                fh.write(json.dumps(row) + "\\n")
        summary = {"metric": "mean@2", "accuracy_after": {s: m["mean@2"] for s, m in after.items()},
                   "seconds": {"total": 1.5}, "rl_steps": 10}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary
''')


@pytest.fixture()
def fake_env(tmp_path, monkeypatch):
    """A stand-in pipeline module importable by worker processes."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fake_pipeline.py").write_text(FAKE_PIPELINE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "pkg"), os.environ.get("PYTHONPATH", "")]))
    return tmp_path / "out"


def fake_settings(out: Path, objectives=("clip", "atr"), seeds=(0, 1, 2), **kwargs) -> CompareSettings:
    return CompareSettings(output_dir=out, objectives=list(objectives), seeds=list(seeds),
                           overrides=["eval.k=2", "rl.eval_every=5"], pipeline="fake_pipeline:pipeline",
                           progress_every=1.0, jobs=2, **kwargs)


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
    # Table 2: final (best) mean over seeds; the step-5 evaluation beats the final one on s1 only.
    t2 = md_table(text, "## Table 2")
    assert t2[0] == ["Objective", "s1 Mean@2", "s1 Pass@2", "s2 Mean@2", "s2 Pass@2", "Average Mean@2",
                     "Average Pass@2"]
    groups = [("clip", 0.2), ("atr_delta=0.05", 0.6), ("atr_delta=0.1", 0.7)]
    for row, (group, base) in zip(t2[1:], groups, strict=True):
        assert row[0] == group
        s1 = [base + 0.03 * s for s in seeds]
        s2 = [base + 0.1 + 0.03 * s for s in seeds]
        avg = [(a + b) / 2 for a, b in zip(s1, s2, strict=True)]
        assert row[1] == f"{pct(np.mean(s1))} ({pct(np.mean(s1) + 0.05)})"
        assert row[3] == f"{pct(np.mean(s2))} ({pct(np.mean(s2))})"  # final beats step 5 on s2
        assert row[4] == f"{pct(np.mean(s2) + 0.2)} ({pct(np.mean(s2) + 0.2)})"
        # "best" Average is the best checkpoint's average (step 5 has a lower average), not a mix of splits
        assert row[5] == f"{pct(np.mean(avg))} ({pct(np.mean(avg))})"
    # Table 3: mean ± sample std over seeds, and the RL start row.
    t3 = md_table(text, "## Table 3")
    assert t3[1] == ["clip", "3", pm([0.2 + 0.03 * s for s in seeds]), pm([0.3 + 0.03 * s for s in seeds]),
                     pm([0.25 + 0.03 * s for s in seeds])]
    assert t3[-1][0] == "*RL start (SFT model)*" and t3[-1][2] == pm([0.05 + 0.03 * s for s in seeds])
    assert "SFT shared per seed" in text
    calls = {p.parent.relative_to(out / "runs").as_posix(): p.read_text().split()
             for p in (out / "runs").glob("*/seed*/calls.txt")}
    start = (out / "runs" / "_sft" / "seed2" / "sft" / "final").resolve()
    assert calls["atr_delta=0.1/seed2"][1:] == ["stages=rl,eval", f"model={start}"]
    assert calls["_sft/seed2"][1] == "stages=sft"
    # Findings are generated from these numbers: 0.1 is ahead of 0.05 beyond the spread (std 0.03); the
    # sweep sentence ranks the values of delta.
    assert "**atr_delta=0.1** has the highest mean" in text and "above every other group's mean + std" in text
    assert "Sweep of atr over delta, Average Mean@2: **delta=0.1** has the highest mean" in text
    assert "Paired by seed, atr_delta=0.05 - clip: 40.0 ± 0.0 points in Average Mean@2 (n=3), a difference" in text
    # Dynamics: entropy over the last 10% of steps (= step 10) and mean clip fraction over RL.
    dyn = md_table(text, "## Training dynamics")
    entropy = [0.5 + 0.01 * s for s in seeds]
    assert dyn[1][2] == f"{np.mean(entropy):.3f} ± {np.std(entropy, ddof=1):.3f}"
    # results.json / csv hold the same numbers unrounded.
    results = json.loads((out / "results.json").read_text())
    clip = next(g for g in results["groups"] if g["group"] == "clip")
    assert clip["final"]["s1"]["mean@2"]["values"] == pytest.approx([0.2, 0.23, 0.26])
    assert clip["seeds"] == [0, 1, 2]
    csv_text = (out / "results.csv").read_text()
    assert "final,clip,clip,,,0,s1,mean@2,value,0.2" in csv_text


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


def test_changed_settings_are_not_mixed(fake_env):
    out = fake_env
    assert run_compare(fake_settings(out, objectives=("clip",), seeds=(0,)), say=lambda s: None) == 0
    changed = fake_settings(out, objectives=("clip",), seeds=(0,))
    changed.overrides = [*changed.overrides, "rl.learning_rate=0.001"]
    with pytest.raises(ChangedRunError, match="different settings"):
        run_compare(changed, say=lambda s: None)
    changed.redo_changed = True
    n = len(events(out))
    assert run_compare(changed, say=lambda s: None) == 0
    assert started(events(out, n)) == ["clip/seed0"]


def test_killed_compare_resumes_without_redoing_finished_runs(fake_env):
    """SIGKILL the compare while its second run is in progress: the orphaned worker exits by itself, and the
    rerun skips the finished run and resumes the killed one (the trainer's resume) without other starts."""
    out = fake_env
    cmd = [sys.executable, "-m", "trustclip.cli", "compare", "--objectives", "clip,atr", "--seeds", "1",
           "--set", "eval.k=2", "--jobs", "1", "--pipeline", "fake_pipeline:pipeline", "--output-dir", str(out)]
    env = {**os.environ, "FAKE_DELAY_kl3": "60"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_dir = out / "runs" / "atr" / "seed0"
    deadline = time.time() + 120
    while not (killed_dir / "calls.txt").is_file():
        assert time.time() < deadline and proc.poll() is None, "the second run never started"
        time.sleep(0.2)
    first_marker = out / "runs" / "clip" / "seed0" / "run_complete.json"
    mtime = first_marker.stat().st_mtime_ns
    worker_pid = next(r["pid"] for r in events(out) if r["event"] == "start" and r["run"] == "atr/seed0")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while _alive(worker_pid):
        assert time.time() < deadline, "the orphaned worker kept running after the compare was killed"
        time.sleep(0.2)
    assert not (killed_dir / "run_complete.json").exists()
    n = len(events(out))
    result = subprocess.run(cmd, env=os.environ.copy(), capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    rerun = events(out, n)
    assert started(rerun) == ["atr/seed0"]
    assert [r["run"] for r in rerun if r["event"] == "skip"] == ["_sft/seed0", "clip/seed0"]
    assert next(r for r in rerun if r["event"] == "start")["resumed"] is True
    calls = [line.split()[0] for line in (killed_dir / "calls.txt").read_text().splitlines()]
    assert calls == ["resume=False", "resume=True"]
    assert first_marker.stat().st_mtime_ns == mtime
    assert "2 already finished, 1 to run" in result.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.is_file() and "zombie" in status.read_text())


def test_second_compare_on_the_same_directory_is_refused(fake_env):
    from trustclip.compare.runner import acquire_compare_lock

    with acquire_compare_lock(fake_env), pytest.raises(RuntimeError, match="another compare"):
        execute([], fake_env)


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
    numbers = {(o, s): _run_numbers(out / "runs" / o / f"seed{s}") for o in ("clip", "atr") for s in (0, 1)}
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
    for row in md_table(text, "## Runs")[1:]:
        objective, seed = row[0].split("/seed")
        n = numbers[(objective, int(seed))]
        assert row[3] == f"{pct(n['after']['average']['mean@2'])} ({pct(n['best']['average']['mean@2'])})"
        assert row[5] == str(n["n_evals"])
    assert cells_checked == 2 * 8 + 2 * 4


def test_end_to_end_rerun_redoes_only_the_unfinished_run(tiny_compare):
    out, settings, _ = tiny_compare
    markers = {p.parent.relative_to(out / "runs").as_posix(): p
               for p in (out / "runs").glob("*/seed*/run_complete.json")}
    assert sorted(markers) == ["_sft/seed0", "_sft/seed1", "atr/seed0", "atr/seed1", "clip/seed0", "clip/seed1"]
    mtimes = {k: p.stat().st_mtime_ns for k, p in markers.items()}
    markers["atr/seed1"].unlink()  # as if the compare had been killed before this run was marked finished
    n = len(events(out))
    assert run_compare(settings, say=lambda s: None) == 0
    rerun = events(out, n)
    assert started(rerun) == ["atr/seed1"]
    assert sorted(r["run"] for r in rerun if r["event"] == "skip") == ["_sft/seed0", "_sft/seed1", "atr/seed0",
                                                                        "clip/seed0", "clip/seed1"]
    for key, path in markers.items():
        assert path.is_file()
        assert (path.stat().st_mtime_ns == mtimes[key]) == (key != "atr/seed1")
