"""One prompt per problem: `data.system_prompt` reaches the SFT examples, the RL prompts and the evaluation prompts
alike, and "" replaces a chat template's default system prompt by an empty system turn."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")


def prompts_of_every_stage(config, tokenizer, row):
    from trustclip.data import sft_examples
    from trustclip.evaluation import evaluate
    from trustclip.train.stages import eval_config, rl_dataset

    seen = []

    def capture(prompts):
        seen.extend(prompts)
        return [["\\boxed{0}"] * eval_config(config).n for _ in prompts]

    d = config.data
    sft = sft_examples([row], tokenizer, style=d.prompt_style, system_prompt=d.system_prompt)[0]["prompt"]
    rl = rl_dataset(config, tokenizer, rows=[row])[0]["prompt"]
    evaluate(None, tokenizer, {"b": [row]}, eval_config(config), generate_fn=capture)
    return sft, rl, seen[0]


@pytest.mark.parametrize("system_prompt", [None, "", "Answer tersely."])
def test_system_prompt_reaches_sft_rl_and_eval(tiny_model_and_tokenizer, system_prompt):
    from trustclip.settings import load_config

    _, tokenizer = tiny_model_and_tokenizer
    overrides = [] if system_prompt is None else [f"data.system_prompt={system_prompt!r}"]
    config = load_config(None, [*overrides, "quiet=true"])
    assert config.data.system_prompt == system_prompt
    row = {"id": "p0", "problem": "Compute 3+4.", "answer": "7", "solution": "3+4=7. \\boxed{7}"}
    sft, rl, ev = prompts_of_every_stage(config, tokenizer, row)
    assert sft == rl == ev
    assert ("Answer tersely." in rl) == (system_prompt == "Answer tersely.")


def test_empty_system_prompt_replaces_smollm2s_default():
    from trustclip.data import format_prompt
    from trustclip.models import SMOLLM2_MODEL_NAME, build_gguf_model, load_tokenizer, locate_gguf

    try:
        locate_gguf(SMOLLM2_MODEL_NAME)
    except ModuleNotFoundError as err:
        pytest.skip(str(err))
    tokenizer = load_tokenizer(str(build_gguf_model(SMOLLM2_MODEL_NAME)))
    default = format_prompt("Compute 3+4.", tokenizer, style="math")
    empty = format_prompt("Compute 3+4.", tokenizer, style="math", system_prompt="")
    assert "SmolLM" in default and "SmolLM" not in empty
    assert empty.startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n")
    assert len(tokenizer(default).input_ids) - len(tokenizer(empty).input_ids) == 16
