"""Built-in synthetic verifiable task: integer arithmetic at four difficulty levels (`LEVELS`), the offline CPU
stand-in for competition math. Rows have the math benchmarks' format (`{"id", "problem", "answer"}`, answer a string)
plus `solution` (a short worked solution ending in `\\boxed{N}`, for the SFT-for-format stage) and `level`, so one
reward and one eval path serve both.

| level | example problem            | worked solution                      |
|-------|----------------------------|--------------------------------------|
| 1     | `Compute 12+35.`           | `12+35=47. \\boxed{47}`              |
| 2     | `Compute 52-75.`           | `52-75=-23. \\boxed{-23}`            |
| 3     | `Compute 12+35-7.`         | `12+35=47. 47-7=40. \\boxed{40}`     |
| 4     | `Compute (12+35)*7.`       | `12+35=47. 47*7=329. \\boxed{329}`   |

`make_synthetic_splits` gives `train` (levels 1-4 mixed, configurable; for SFT and RL) and the held-out analogues of
the paper's benchmarks, easy to hard (`DEFAULT_EVAL_SPLITS`). Held-out splits are disjoint from `train` and from each
other (exact problem text), and everything is a pure function of the seed. A split takes its levels in turn; a level
that runs out of distinct problems (1,000 repeats in a row) drops out and the other levels fill the rest.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trustclip.data.templates import format_prompt


@dataclass(frozen=True)
class ArithmeticLevel:
    """One difficulty level: `n_operands` numbers in `[lo, hi]` joined by operators from `ops`.

    `number` is what rows record as their `level` (the built-in levels carry theirs, also after
    `dataclasses.replace(LEVELS[k], hi=...)`); a custom level without one is recorded by its repr.
    """

    n_operands: int
    ops: str
    lo: int = 0
    hi: int = 99
    number: int | None = None

    def __post_init__(self) -> None:
        if self.n_operands < 2:
            raise ValueError(f"n_operands must be >= 2, got {self.n_operands}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if self.lo > self.hi or self.lo < 0:
            raise ValueError(f"need 0 <= lo <= hi, got lo={self.lo}, hi={self.hi}")


LEVELS: dict[int, ArithmeticLevel] = {
    1: ArithmeticLevel(2, "+", number=1),
    2: ArithmeticLevel(2, "+-", number=2),
    3: ArithmeticLevel(3, "+-", number=3),
    4: ArithmeticLevel(3, "+-*", number=4),
}
DEFAULT_TRAIN_LEVELS: tuple[int, ...] = (1, 2, 3, 4)
DEFAULT_EVAL_SPLITS: dict[str, tuple[int, ...]] = {
    "amc_like": (1, 2),
    "aime24_like": (3,),
    "aime25_like": (4,),
}


def make_problem(level: int | ArithmeticLevel, rng: random.Random) -> dict[str, str | int]:
    """Draw one problem; returns `problem`, `answer`, `solution` and `level`.

    The expression is evaluated left to right. When `*` is among the level's operators it is the last
    step (times a one-digit number), and a sum before it gets parentheses, so the written expression
    and the step-by-step chain always agree.
    """
    spec = LEVELS[level] if isinstance(level, int) else level
    acc = rng.randint(spec.lo, spec.hi)
    expr, steps = str(acc), []
    additive = spec.ops.replace("*", "")
    for i in range(spec.n_operands - 1):
        last = i == spec.n_operands - 2
        op = "*" if "*" in spec.ops and (last or not additive) else rng.choice(additive)
        x = rng.randint(2, 9) if op == "*" else rng.randint(spec.lo, spec.hi)
        new = acc + x if op == "+" else acc - x if op == "-" else acc * x
        if op == "*" and any(o in expr for o in "+-"):
            expr = f"({expr})"
        expr = f"{expr}{op}{x}"
        steps.append(f"{acc}{op}{x}={new}.")
        acc = new
    return {
        "problem": f"Compute {expr}.",
        "answer": str(acc),
        "solution": " ".join(steps) + f" \\boxed{{{acc}}}",
        "level": spec.number if spec.number is not None else repr(spec),
    }


def _draw_split(name: str, n: int, levels: Sequence[int | ArithmeticLevel], seed: int, taken: set[str]) -> list[dict]:
    """`n` rows whose problems are not in `taken` (the splits drawn before), added to it as they are drawn."""
    # A string seed gives an independent, reproducible stream per split (hash-seed independent).
    rng = random.Random(f"trustclip-synthetic-{seed}-{name}")
    rows: list[dict] = []
    active, misses = list(levels), 0
    while len(rows) < n and active:
        level = active[len(rows) % len(active)]  # round robin keeps the level mix exact ...
        row = make_problem(level, rng)
        if row["problem"] in taken:
            misses += 1
            if misses == 1000:  # ... until a level runs out of new problems: the others fill in
                active, misses = [lv for lv in active if lv != level], 0
            continue
        misses = 0
        taken.add(row["problem"])
        rows.append({"id": f"{name}-{len(rows)}", **row})
    if len(rows) < n:
        raise ValueError(f"could only draw {len(rows)} distinct problems for split {name!r} (asked {n}, levels "
                         f"{tuple(levels)}); lower n or add harder levels")
    return rows


def _check_levels(split: str, levels: Sequence[int | ArithmeticLevel]) -> None:
    if not levels:
        raise ValueError(f"split {split!r} has no levels")
    for lv in levels:
        if not isinstance(lv, ArithmeticLevel) and lv not in LEVELS:
            raise ValueError(f"split {split!r}: unknown level {lv!r}; known levels: {sorted(LEVELS)}")


def make_synthetic_splits(seed: int = 0, n_train: int = 2000, n_eval: int = 64, *,
                          train_levels: Sequence[int | ArithmeticLevel] = DEFAULT_TRAIN_LEVELS,
                          eval_splits: Mapping[str, Sequence[int | ArithmeticLevel]] | None = None,
                          ) -> dict[str, list[dict]]:
    """`{"train": rows, **{held-out split: rows}}`, deterministic from `seed`; rows as `make_problem`'s, with an `id`.
    Held-out splits are drawn first and `train` excludes their problems, so no eval problem is ever trained on.
    Levels are keys of `LEVELS` or custom `ArithmeticLevel`s (e.g. `ArithmeticLevel(2, "+", lo=0, hi=20)`)."""
    eval_splits = DEFAULT_EVAL_SPLITS if eval_splits is None else eval_splits
    _check_levels("train", train_levels)
    for name, lvs in eval_splits.items():
        _check_levels(name, lvs)
    taken: set[str] = set()
    held_out = {name: _draw_split(name, n_eval, lvs, seed, taken) for name, lvs in eval_splits.items()}
    return {"train": _draw_split("train", n_train, tuple(train_levels), seed, taken), **held_out}


def sft_examples(rows: Sequence[dict], tokenizer=None, style: str = "auto",
                 system_prompt: str | None = None) -> list[dict[str, str]]:
    """Prompt/completion pairs (TRL's format) for the SFT-for-format stage: the prompt as RL and eval build it
    (`format_prompt`), and the worked solution without eos (TRL's SFTTrainer appends it; a hand-written loop must)."""
    for i, row in enumerate(rows):  # every row is checked before any prompt is built
        if "solution" not in row:
            raise ValueError(f"row {i} (id {row.get('id')!r}) has no 'solution' field")
    return [{"prompt": format_prompt(row["problem"], tokenizer, style=style, system_prompt=system_prompt),
             "completion": row["solution"]} for row in rows]
