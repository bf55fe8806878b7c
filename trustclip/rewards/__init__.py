"""Verified rewards: binary correctness of the final answer (+1 correct, 0 otherwise), checked with math-verify,
plus an optional format reward. Layers, bottom up: `answers` (extraction, plain comparison), `verifier` (the
math-verify process pool with hard timeouts, `score_completions`), `trl` (TRL reward functions)."""

from trustclip.rewards.answers import extract_answer, fast_verdict, last_boxed
from trustclip.rewards.trl import CorrectnessReward, completion_text, format_reward
from trustclip.rewards.verifier import DEFAULT_TIMEOUT, MathVerifier, default_verifier, score_completions, verify_answer

__all__ = ["DEFAULT_TIMEOUT", "CorrectnessReward", "MathVerifier", "completion_text", "default_verifier",
           "extract_answer", "fast_verdict", "format_reward", "last_boxed", "score_completions", "verify_answer"]
