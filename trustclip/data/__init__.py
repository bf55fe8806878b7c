"""Prompt data: loaders for hub/local files, prompt templates, and the built-in synthetic task."""

from trustclip.data.loaders import DataFormatError, load_benchmark_specs, load_prompts
from trustclip.data.synthetic import LEVELS, ArithmeticLevel, make_problem, make_synthetic_splits, sft_examples
from trustclip.data.templates import build_prompt_rows, format_prompt, prompt_messages, resolve_template

__all__ = ["LEVELS", "ArithmeticLevel", "DataFormatError", "build_prompt_rows", "format_prompt",
           "load_benchmark_specs", "load_prompts", "make_problem", "make_synthetic_splits", "prompt_messages",
           "resolve_template", "sft_examples"]
