"""Prompt templates. One function, `format_prompt`, builds every prompt (SFT, RL and eval), so the model
sees the same text in all three stages.

Styles:
- `"math"`: the paper's recipe style (solve, reason step by step, final answer in `\\boxed{}`);
- `"tiny"`: the bare problem and a newline, for the character-level tiny model trained from scratch;
- `"raw"`: the problem text unchanged;
- `"auto"`: `"tiny"` for the trustclip tiny tokenizer, `"math"` otherwise;
- any other string containing `{problem}` is used as a custom template (braces need no escaping).

The templated text is wrapped by the tokenizer's chat template when it has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MATH_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
# The tiny model is trained from scratch, so an instruction carries no information for it (it learns the
# boxed format from the SFT stage) while every prompt character costs CPU time in SFT, RL and eval.
TINY_TEMPLATE = "{problem}\n"
TEMPLATES = {"math": MATH_TEMPLATE, "tiny": TINY_TEMPLATE, "raw": "{problem}"}
PROMPT_STYLE_KEY = "trustclip_prompt_style"  # a tokenizer_config.json entry naming a style (builtin:tiny: "tiny")


def resolve_template(style: str = "auto", tokenizer: Any = None) -> str:
    """Template string for a style name (or a custom template containing `{problem}`)."""
    if style == "auto":
        marked = getattr(tokenizer, "init_kwargs", {}).get(PROMPT_STYLE_KEY)
        style = marked if marked in TEMPLATES else "math"
    if style in TEMPLATES:
        return TEMPLATES[style]
    if "{problem}" not in style:
        raise ValueError(f"unknown prompt style {style!r}: use one of {sorted(TEMPLATES) + ['auto']} "
                         "or a custom template containing '{problem}'")
    return style


def prompt_messages(problem: str, style: str = "auto", tokenizer: Any = None, system_prompt: str | None = None):
    """Conversational prompt (list of chat messages), e.g. for TRL datasets in conversational format."""
    content = resolve_template(style, tokenizer).replace("{problem}", problem)
    # "" is an empty system turn: it replaces a template's default system prompt (SmolLM2's is 16 tokens)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return [*messages, {"role": "user", "content": content}]


def format_prompt(problem: str, tokenizer: Any = None, style: str = "auto", system_prompt: str | None = None,
                  **chat_kwargs: Any) -> str:
    """The prompt string for one problem, through the tokenizer's chat template when it has one.

    `chat_kwargs` go to `apply_chat_template` (e.g. `enable_thinking=False` for Qwen3).
    """
    messages = prompt_messages(problem, style, tokenizer, system_prompt)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **chat_kwargs)
    return f"{system_prompt}\n{messages[-1]['content']}" if system_prompt else messages[-1]["content"]


def build_prompt_rows(rows: Sequence[dict], tokenizer: Any = None, style: str = "auto", *, conversational: bool = False,
                      system_prompt: str | None = None, **chat_kwargs: Any) -> list[dict[str, Any]]:
    """Rows for a TRL GRPO dataset: `{"prompt", "answer", "id"}` (other columns are kept). With `conversational=True`
    the prompt is a message list and TRL applies the chat template itself."""
    if conversational:
        return [{**r, "prompt": prompt_messages(r["problem"], style, tokenizer, system_prompt)} for r in rows]
    return [{**r, "prompt": format_prompt(r["problem"], tokenizer, style, system_prompt, **chat_kwargs)} for r in rows]
