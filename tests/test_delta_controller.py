"""Adaptive delta: the DeltaController's rule on synthetic update statistics, its state across a checkpoint, the
objectives it moves (atr_adaptive's own, and any other objective's delta), and its wiring in TrustClipGRPOTrainer
(fed once per generation batch from the off-policy updates, saved, resumed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from trustclip import DeltaController


# ------------------------------------------------------------------ the rule on synthetic statistics
def test_kl3_target_tightens_when_the_update_moves_too_far_and_widens_when_too_little():
    controller = DeltaController(delta=0.07)  # target kl3_mean 0.01, tolerance 1.5, factor 2, range [0.005, 0.5]
    deltas = [controller.update({"kl3_mean": 0.05}) for _ in range(6)]  # far above 0.015
    assert deltas == [0.035, 0.0175, 0.00875, 0.005, 0.005, 0.005]  # halves, then stops at delta_min
    deltas = [controller.update({"kl3_mean": 0.001}) for _ in range(9)]  # far below 0.01 / 1.5
    assert deltas == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5, 0.5]  # doubles, then stops at delta_max
    for value in (0.0067, 0.01, 0.0149):  # inside the dead band [target / 1.5, target * 1.5]: no move
        assert controller.update({"kl3_mean": value}) == 0.5
    assert controller.updates == 18 and controller.last_statistic == 0.0149


def test_clip_frac_target_moves_delta_the_other_way():
    controller = DeltaController(delta=0.07, target="clip_frac", target_value=0.02)
    assert controller.update({"clip_frac": 0.2, "kl3_mean": 0.5}) == 0.14  # too many tokens held: wider region
    assert controller.update({"clip_frac": 0.0, "kl3_mean": 0.0}) == 0.07  # none held: tighter
    assert controller.update({"clip_frac": 0.025, "kl3_mean": 9.9}) == 0.07  # in the band; kl3_mean is not read


def _plant(target: str, spread: float):
    """A synthetic policy update: token log-ratios ~ N(0, spread); tokens outside the KL3 region are held at its
    edge. clip_frac falls and the mean KL3 rises with delta, as in training."""
    x = np.random.default_rng(0).normal(0.0, spread, 20_000)
    kl3 = np.exp(x) - 1 - x
    if target == "clip_frac":
        return lambda delta: float((kl3 > delta).mean() / 2)  # held: outside and moved the way A favours
    return lambda delta: float(np.minimum(kl3, delta).mean())


@pytest.mark.parametrize("target, factor, start", [("kl3_mean", 2.0, 0.5), ("kl3_mean", 2.0, 0.005),
                                                   ("clip_frac", 1.25, 0.005), ("clip_frac", 1.25, 0.5)])
def test_closed_loop_reaches_the_target_band_from_either_side(target, factor, start):
    statistic = _plant(target, spread=0.25)
    controller = DeltaController(delta=start, target=target, factor=factor)
    first = statistic(start)
    deltas, stats = [], []
    for _ in range(40):
        stats.append(statistic(controller.delta))
        deltas.append(controller.update({target: stats[-1]}))
    moved_up = deltas[0] > start
    # the first move: towards the band (kl3 too high or clip_frac too low -> tighter, and the reverse)
    assert moved_up == ((first < 0.01) if target == "kl3_mean" else (first > 0.01))
    assert all(0.005 <= d <= 0.5 for d in deltas)
    assert 0.01 / 1.5 <= stats[-1] <= 0.01 * 1.5 and len(set(deltas[-10:])) == 1  # settled inside the band


def test_clip_frac_with_ppos_factor_2_can_cycle():
    """Why docs/beyond-the-paper.md advises factor ~1.25 for clip_frac: a Gaussian tail makes the clip fraction
    change ~10x per doubling of delta, so with factor 2 it jumps over the whole dead band."""
    statistic = _plant("clip_frac", spread=0.25)
    controller = DeltaController(delta=0.07, target="clip_frac")
    deltas = [controller.update({"clip_frac": statistic(controller.delta)}) for _ in range(30)]
    assert len(set(deltas[-10:])) == 2 and not any(0.01 / 1.5 <= statistic(d) <= 0.015 for d in deltas[-10:])


def test_state_round_trips_through_json_and_the_continued_run_is_identical():
    statistic = _plant("kl3_mean", spread=0.3)
    straight = DeltaController(delta=0.3)
    for _ in range(3):
        straight.update({"kl3_mean": statistic(straight.delta)})
    saved = json.loads(json.dumps(straight.state_dict()))
    assert saved["delta"] != 0.3 and saved["updates"] == 3
    resumed = DeltaController(delta=0.3)
    resumed.load_state_dict(saved)
    assert resumed.delta == straight.delta and resumed.objective.hparams["delta"] == straight.delta
    for _ in range(5):
        assert resumed.update({"kl3_mean": statistic(resumed.delta)}) == \
            straight.update({"kl3_mean": statistic(straight.delta)})
    assert resumed.state_dict() == straight.state_dict()


def test_bad_state_and_statistics_are_refused():
    controller = DeltaController()
    saved = controller.state_dict()
    with pytest.raises(ValueError, match=r"other settings than this run \(target_value: saved 0.01, now 0.02\)"):
        DeltaController(target_value=0.02).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"lacks \['settings'\]"):
        controller.load_state_dict({k: v for k, v in saved.items() if k != "settings"})
    with pytest.raises(ValueError, match=r"saved delta=0.9 is outside \[0.005, 0.5\]"):
        controller.load_state_dict(saved | {"delta": 0.9})
    with pytest.raises(ValueError, match=r"needs the statistic 'kl3_mean' \(target\); got keys \['clip_frac'\]"):
        controller.update({"clip_frac": 0.1})
    for bad in (math.nan, math.inf, -0.1):
        with pytest.raises(ValueError, match="kl3_mean=.* must be a finite number >= 0"):
            controller.update({"kl3_mean": bad})
    assert controller.updates == 0 and controller.delta == 0.07  # nothing moved
    with pytest.raises(ValueError, match=r"objective 'clip' has none; objectives with one: .*kl3"):
        DeltaController("clip")
    with pytest.raises(ValueError, match="delta range .* is empty"):
        DeltaController(delta_min=0.3, delta_max=0.2)


def test_the_controller_moves_the_delta_of_any_objective_that_has_one():
    """kl1 with the controller's settings given beside its own: the same rule moves its delta, and the objective it
    hands out is kl1 at that delta, with the ratio region of that delta."""
    from trustclip import get_objective, ratio_bounds

    controller = DeltaController("kl1", delta=0.04, two_sided=True, target="clip_frac", target_value=0.02)
    assert controller.settings == {"delta": 0.04, "target": "clip_frac", "target_value": 0.02, "delta_min": 0.005,
                                   "delta_max": 0.5, "tolerance": 1.5, "factor": 2.0}
    assert controller.update({"clip_frac": 0.5}) == 0.08  # too many tokens held: a wider region
    objective = controller.objective
    assert (objective.name, dict(objective.hparams)) == ("kl1", {"delta": 0.08, "two_sided": True})
    assert ratio_bounds(objective) == ratio_bounds(get_objective("kl1", delta=0.08, two_sided=True))
    assert ratio_bounds(objective) != ratio_bounds(get_objective("kl1", delta=0.04, two_sided=True))


def test_controller_settings_of_another_objective_are_checked_like_atr_adaptives():
    with pytest.raises(ValueError, match=r"adaptive delta of kl2: the delta range .* is empty"):
        DeltaController("kl2", delta_min=0.3, delta_max=0.2)
    with pytest.raises(ValueError, match=r"adaptive delta: factor=0.5 is invalid; it must be > 1.0"):
        DeltaController("kl2", factor=0.5)
    with pytest.raises(ValueError, match="unknown hyper-parameter"):  # an objective's own stay its own
        DeltaController("kl2", epsilon=0.2)


# ------------------------------------------------------------------ the TrainerCallback, without a trainer
def test_callback_moves_delta_once_per_generation_batch_from_its_off_policy_micro_batches():
    """Two optimizer steps of two micro-batches per generation batch: the first step's micro-batches (ratio 1) are
    not counted; the token-weighted mean of the others moves delta at the batch's last micro-batch."""
    from trustclip.integrations.trl.delta_control import DeltaControlCallback

    callback = DeltaControlCallback(DeltaController(delta=0.04, target_value=0.01), gradient_accumulation_steps=2,
                                    generate_every=4)
    statistics = [(5.0, 10.0), (5.0, 10.0), (0.001, 30.0), (0.1, 10.0)]  # (kl3_mean, tokens) per micro-batch
    logged = [callback.record({"kl3_mean": kl3}, tokens, step) for step, (kl3, tokens) in enumerate(statistics)]
    assert [entry["objective/delta"] for entry in logged] == [0.04] * 4  # every update of the batch: one delta
    window_mean = (0.001 * 30 + 0.1 * 10) / 40  # 0.02575 > 0.015: the update moved too far
    assert logged[-1]["objective/controller_kl3_mean"] == pytest.approx(window_mean)
    assert "objective/controller_kl3_mean" not in logged[1] and callback.controller.delta == 0.02


def test_callback_writes_its_state_before_the_trainer_saves_and_loads_it_back(tmp_path):
    from types import SimpleNamespace

    from trustclip.integrations.trl.delta_control import DELTA_CONTROLLER_FILE, DeltaControlCallback

    callback = DeltaControlCallback(DeltaController(delta=0.04), gradient_accumulation_steps=1, generate_every=2)
    callback.controller.update({"kl3_mean": 0.5})
    args, state = SimpleNamespace(output_dir=str(tmp_path), should_save=True), SimpleNamespace(global_step=6)
    callback.on_step_end(args, state, SimpleNamespace(should_save=False))
    assert not (tmp_path / "checkpoint-6").exists()  # no save this step: nothing written
    callback.on_step_end(args, state, SimpleNamespace(should_save=True))  # the Trainer saves right after this event
    saved = json.loads((tmp_path / "checkpoint-6" / DELTA_CONTROLLER_FILE).read_text())
    assert saved["delta"] == 0.02 and saved["updates"] == 1
    resumed = DeltaControlCallback(DeltaController(delta=0.04), gradient_accumulation_steps=1, generate_every=2)
    resumed.load(tmp_path / "checkpoint-6", "atr_adaptive")
    assert resumed.controller.state_dict() == callback.controller.state_dict()
    with pytest.raises(ValueError, match="checkpoint-7: it has no delta_controller.json"):
        resumed.load(tmp_path / "checkpoint-7", "atr_adaptive")


# ------------------------------------------------------------------ in TrustClipGRPOTrainer
pytest.importorskip("trl")
from test_trainer import make_config, make_trainer  # noqa: E402

# Any off-policy update has mean KL3 far above 1.5e-8, so delta halves once per generation batch.
HALVING = {"delta": 0.04, "target_value": 1e-8}


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from trustclip.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_path)


def _logged(trainer, key):
    return [(h["step"], h[key]) for h in trainer.state.log_history if key in h]


def test_trainer_moves_delta_once_per_generation_batch_from_its_off_policy_updates(tiny, tmp_path):
    trainer = make_trainer(tiny, tmp_path, objective="atr_adaptive", objective_kwargs=HALVING, max_steps=4)
    trainer.train()  # num_iterations=2: steps 1-2 use batch 1 (step 1 on-policy), steps 3-4 batch 2
    assert _logged(trainer, "objective/delta") == [(1, 0.04), (2, 0.04), (3, 0.02), (4, 0.02)]
    kl3 = dict(_logged(trainer, "objective/kl3_mean"))
    controlled = _logged(trainer, "objective/controller_kl3_mean")
    assert [step for step, _ in controlled] == [2, 4] and kl3[1] < 1e-10 < kl3[2]
    for step, value in controlled:  # the off-policy update's statistic alone, not diluted by the on-policy one
        assert value == pytest.approx(kl3[step], rel=1e-9)
    assert trainer.delta_controller.delta == 0.01 and trainer.delta_controller.updates == 2
    assert trainer.objective.hparams["delta"] == 0.01


def test_resume_continues_from_the_saved_delta(tiny, tmp_path):
    settings = dict(objective="atr_adaptive", objective_kwargs=HALVING, max_steps=4, save_strategy="steps",
                    save_steps=2)
    first = make_trainer(tiny, tmp_path / "a", **settings)
    first.train()
    checkpoint = tmp_path / "a" / "checkpoint-2"
    assert json.loads((checkpoint / "delta_controller.json").read_text())["delta"] == 0.02

    resumed = make_trainer(tiny, tmp_path / "b", **settings)
    assert resumed.delta_controller.delta == 0.04  # before loading: the initial delta
    resumed.train(resume_from_checkpoint=str(checkpoint))
    # steps 1-2 come from the checkpoint's log history; step 3 starts from the saved 0.02, not from 0.04
    assert _logged(resumed, "objective/delta") == [(1, 0.04), (2, 0.04), (3, 0.02), (4, 0.02)]
    assert resumed.delta_controller.state_dict()["delta"] == first.delta_controller.delta == 0.01
    assert resumed.delta_controller.updates == first.delta_controller.updates == 2

    (checkpoint / "delta_controller.json").unlink()
    with pytest.raises(ValueError, match="checkpoint-2: it has no delta_controller.json"):
        make_trainer(tiny, tmp_path / "c", **settings).train(resume_from_checkpoint=str(checkpoint))
    other = settings | {"objective_kwargs": HALVING | {"factor": 3.0}}
    with pytest.raises(ValueError, match=r"other settings than this run \(factor: saved 2.0, now 3.0\)"):
        make_trainer(tiny, tmp_path / "d", **other).train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))


def test_batch_settings_it_cannot_control_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'atr_adaptive' moves delta once per generation batch.*steps_per_generation"
                                         "=3 x num_iterations=1 must be a multiple of gradient_accumulation_steps=2"):
        make_config(tmp_path, objective="atr_adaptive", steps_per_generation=3, gradient_accumulation_steps=2,
                    num_iterations=1)
    with pytest.raises(ValueError, match=r"target_value=2 is outside the range of target='clip_frac'"):
        make_config(tmp_path, objective="atr_adaptive", objective_kwargs={"target": "clip_frac", "target_value": 2})
    from trustclip import RatioInterval  # the window check must not trip a "general" objective given its constraint

    assert make_config(tmp_path, objective="general", objective_kwargs={"constraint": RatioInterval(0.8, 1.2)})


def test_adaptive_delta_settings_are_checked_when_the_config_is_built(tmp_path):
    with pytest.raises(ValueError, match="objective 'clip' has none"):
        make_config(tmp_path, objective="clip", adaptive_delta=True)
    with pytest.raises(ValueError, match=r"controller settings \['factor'\] are given, but adaptive_delta is off"):
        make_config(tmp_path, objective="kl3", adaptive_delta_kwargs={"factor": 1.5})
    with pytest.raises(ValueError, match=r"adaptive_delta_kwargs=.*the delta range \[delta_min=0.3, delta_max=0.2\]"):
        make_config(tmp_path, objective="kl3", adaptive_delta=True,
                    adaptive_delta_kwargs='{"delta_min": 0.3, "delta_max": 0.2}')
    with pytest.raises(ValueError, match=r"'atr_adaptive' takes the controller's settings .* in objective_kwargs"):
        make_config(tmp_path, objective="atr_adaptive", adaptive_delta_kwargs={"factor": 1.5})
    with pytest.raises(ValueError, match="adaptive_delta=True moves delta once per generation batch.*must be a "
                                         "multiple of gradient_accumulation_steps=2"):
        make_config(tmp_path, objective="kl2", adaptive_delta=True, steps_per_generation=3,
                    gradient_accumulation_steps=2, num_iterations=1)
    assert make_config(tmp_path, objective="kl2", adaptive_delta=True).adaptive_delta_kwargs == {}


def test_trainer_moves_the_delta_of_another_delta_objective(tiny, tmp_path):
    """adaptive_delta on kl2: delta halves once per generation batch, as atr_adaptive's does, and the update trains
    kl2 at the current delta."""
    trainer = make_trainer(tiny, tmp_path, objective="kl2", objective_kwargs={"delta": 0.04}, adaptive_delta=True,
                           adaptive_delta_kwargs={"target_value": 1e-8}, max_steps=4)
    trainer.train()
    assert _logged(trainer, "objective/delta") == [(1, 0.04), (2, 0.04), (3, 0.02), (4, 0.02)]
    assert trainer.delta_controller.delta == 0.01 and trainer.delta_controller.updates == 2
    assert (trainer.objective.name, dict(trainer.objective.hparams)) == ("kl2", {"delta": 0.01})


def test_atr_adaptive_trains_as_kl3_with_adaptive_delta(tiny, tmp_path):
    """The alias and the feature are one thing: the same deltas, losses and statistics step by step."""
    from transformers import set_seed

    set_seed(0)  # each run from the same random state: the same samples
    alias = make_trainer(tiny, tmp_path / "alias", objective="atr_adaptive", objective_kwargs=HALVING, max_steps=4)
    alias.train()
    set_seed(0)
    feature = make_trainer(tiny, tmp_path / "feature", objective="kl3", objective_kwargs={"delta": 0.04},
                           adaptive_delta=True, adaptive_delta_kwargs={"target_value": 1e-8}, max_steps=4)
    feature.train()
    for key in ("objective/delta", "loss", "objective/kl3_mean", "objective/clip_frac"):
        assert _logged(alias, key) == _logged(feature, key), key
    assert alias.delta_controller.state_dict() == feature.delta_controller.state_dict()


def test_sigkill_then_resume_continues_delta(tiny_model_path, tmp_path):
    """`trustclip train --resume` after a SIGKILL: the first resumed step uses the delta saved in the checkpoint it
    resumes from, and the run ends where an uninterrupted one ends. Two CLI processes (~15 s on an idle machine)."""
    from test_train_cli import cli_env, kill_at_checkpoint, tiny_overrides

    out = tmp_path / "run"
    # lr 1e-4 moves the tiny policy far less than a mean KL3 of 0.3 / 1.5, so delta doubles every generation batch
    doubling = {"delta": 0.01, "target_value": 0.3}
    sets = tiny_overrides(tiny_model_path, out, **{"rl.max_steps": 10, "rl.save_steps": 2, "rl.save_total_limit": 1,
                                                   "rl.objective_kwargs": doubling})
    args = [sys.executable, "-m", "trustclip.cli", "train", "--stages", "rl", "--objective", "atr_adaptive",
            *[a for o in sets for a in ("--set", o)]]
    kill_at_checkpoint(args, cli_env(tmp_path), out / "rl" / "checkpoint-2")
    complete = [c for c in (out / "rl").glob("checkpoint-*") if (c / "trainer_state.json").is_file()]
    checkpoint = max(complete, key=lambda c: int(c.name.split("-")[1]))
    saved = json.loads((checkpoint / "delta_controller.json").read_text())
    step = int(checkpoint.name.split("-")[1])
    assert step < 10 and saved["delta"] == 0.01 * 2 ** (step // 2) and saved["updates"] == step // 2

    resumed = subprocess.run([*args, "--resume"], env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    delta = {r["step"]: r["objective/delta"] for r in rows if r["stage"] == "rl" and "objective/delta" in r}
    assert sorted(delta) == list(range(1, 11))
    assert delta[step + 1] == saved["delta"] != 0.01  # continues from the saved value, not the initial one
    assert [delta[s] for s in range(1, 11)] == [0.01 * 2 ** ((s - 1) // 2) for s in range(1, 11)]  # = uninterrupted
