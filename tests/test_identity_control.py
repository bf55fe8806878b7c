"""The identity control of the ATR paper (issue 16, item 1): ATR with threshold delta is exactly asymmetric
ratio clipping with eps_low = 1 - l, eps_high = u - 1, [l, u] the Lambert-W roots of w - 1 - log w = delta
(arXiv 2602.05494, Theorem 4.2). So `atr(delta=0.07)` and `clip_higher(1 - l, u - 1)` must train identically
under one seed: same completions, losses, rewards, clip fractions and ratios, step for step.

A few steps of the TRL trainer on the built-in tiny model, off-policy (num_iterations = 2, a high learning
rate) so that ratios leave 1 and the bounds act; the test asserts that they do, and that a clip_higher with
other bounds (DAPO's 0.2 / 0.28) does not reproduce ATR's metrics, so the comparison can fail. ~30 s alone,
most of it importing TRL and building the tiny model; each 4-step run takes ~4 s."""

from __future__ import annotations

import copy
import math

import pytest

pytest.importorskip("trl")

from trustclip import ratio_bounds  # noqa: E402

STEPS = 4
DELTA = 0.07
L, U = ratio_bounds("atr", delta=DELTA)
PROMPTS = [f"Compute {a}+{b}. Answer in \\boxed{{}}.\n" for a, b in [(3, 4), (12, 7), (5, 9), (21, 30)]]
# Wall-clock entries of the log, the only ones two identical runs may disagree on.
TIMING = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")


def digit_reward(completions, **kwargs):
    """A dense reward (fraction of digits): every group has variance, every step a gradient."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from trustclip.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_path)


def train_log(tiny, tmp_path, objective: str, kwargs: dict) -> list[dict]:
    """Per-step log of STEPS optimizer steps of `objective` from the tiny model, seed 0."""
    from datasets import Dataset

    from trustclip.integrations.trl import TrustClipGRPOConfig, TrustClipGRPOTrainer
    from trustclip.integrations.trl.compat import checkpointing_off

    model, tokenizer = tiny
    args = TrustClipGRPOConfig(
        output_dir=str(tmp_path / objective), max_steps=STEPS, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=2e-2, num_iterations=2, objective=objective, objective_kwargs=kwargs,
        use_cpu=True, bf16=False, **checkpointing_off(), report_to="none",
        logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = TrustClipGRPOTrainer(copy.deepcopy(model), reward_funcs=digit_reward, args=args,
                                   train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS * 4]),
                                   processing_class=tokenizer)
    trainer.train()
    return [{k: v for k, v in row.items() if k not in TIMING} for row in trainer.state.log_history]


@pytest.fixture(scope="module")
def atr_log(tiny, tmp_path_factory):
    return train_log(tiny, tmp_path_factory.mktemp("atr"), "atr", {"delta": DELTA})


def test_atr_trains_exactly_like_clip_higher_with_its_lambert_w_bounds(tiny, tmp_path, atr_log):
    identity = train_log(tiny, tmp_path, "clip_higher", {"epsilon_low": 1 - L, "epsilon_high": U - 1})
    steps = [row for row in atr_log if "loss" in row]
    assert len(steps) == STEPS
    # the bounds acted: some ratios left [l, u] and were clipped, on both sides over the run
    assert max(row["objective/ratio_max"] for row in steps) > U
    assert min(row["objective/ratio_min"] for row in steps) < L
    assert sum(row["objective/clip_frac"] for row in steps) > 0
    assert len(identity) == len(atr_log)
    for step, (a, b) in enumerate(zip(atr_log, identity, strict=True)):
        assert a.keys() == b.keys(), f"log entry {step}: different metrics"
        for key in a:
            same = a[key] == b[key] or (isinstance(a[key], float) and math.isnan(a[key]) and math.isnan(b[key]))
            assert same, f"log entry {step}, {key}: atr {a[key]!r} != clip_higher(1 - l, u - 1) {b[key]!r}"


def test_other_bounds_do_not_match(tiny, tmp_path, atr_log):
    """The check above can fail: DAPO's clip_higher(0.2, 0.28) clips other tokens and trains differently."""
    dapo = train_log(tiny, tmp_path, "clip_higher", {"epsilon_low": 0.2, "epsilon_high": 0.28})
    differing = {key for a, b in zip(atr_log, dapo, strict=True) for key in a if a[key] != b.get(key)}
    assert {"objective/clip_frac", "loss"} <= differing
