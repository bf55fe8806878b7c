"""TRL reward functions (`reward(completions, **columns) -> list[float]`) over `trustclip.rewards.verifier`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trustclip.rewards.answers import last_boxed
from trustclip.rewards.verifier import DEFAULT_TIMEOUT, MathVerifier, default_verifier, score_completions


def completion_text(completion: Any) -> str:
    """Text of a TRL completion: a string, or a list of chat messages (the assistant turns joined)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence):
        return "".join(completion_text(m) for m in completion)
    raise TypeError(f"unsupported completion type {type(completion).__name__}")


class CorrectnessReward:
    """TRL reward function: `reward(completions, **columns) -> list[float]`, 1.0 correct / 0.0 not.

    The reference answer comes from the dataset column `answer_key`. `metrics()` returns this reward's
    counters (`reward/timeouts`, `reward/errors`, ...) for the trainer to log.
    """

    def __init__(self, answer_key: str = "answer", timeout: float = DEFAULT_TIMEOUT, fallback: bool = True,
                 verifier: MathVerifier | None = None, name: str = "correctness") -> None:
        if not timeout > 0:
            raise ValueError(f"CorrectnessReward: timeout must be > 0 seconds, got {timeout!r}")
        self.answer_key = answer_key
        self.timeout = timeout
        self.fallback = fallback
        self.verifier = verifier
        self.__name__ = name  # TRL names logged reward columns after `__name__`

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float]:
        if self.answer_key not in columns:
            raise KeyError(f"reward needs the dataset column {self.answer_key!r}; got columns {sorted(columns)}")
        texts = [completion_text(c) for c in completions]
        return score_completions(texts, columns[self.answer_key], timeout=self.timeout, fallback=self.fallback,
                                 verifier=self.verifier)

    def metrics(self) -> dict[str, float]:
        return (self.verifier or default_verifier()).stats.as_metrics()


def format_reward(completions: Sequence[Any], **columns: Any) -> list[float]:
    """Optional format reward (TRL signature): 1.0 if the completion has a non-empty `\\boxed{}` answer."""
    return [1.0 if last_boxed(completion_text(c)) else 0.0 for c in completions]
