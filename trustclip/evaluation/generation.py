"""Sampling `config.n` completions per prompt: batched Hugging Face `generate`, or vLLM on a GPU."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Sequence
from typing import Any

from trustclip.evaluation.config import EvalConfig


def generate_hf(model: Any, tokenizer: Any, prompts: Sequence[str], config: EvalConfig, desc: str = "generate"):
    """`config.n` sampled completions per prompt with batched `model.generate`; returns texts per prompt.

    Prompts are sorted by length so batches pad little. The torch RNG is seeded with `config.seed` inside
    `fork_rng`, so the caller's (e.g. a trainer's) random stream is left untouched.
    """
    import torch
    from tqdm.auto import tqdm

    jobs = sorted(((i, p) for i, p in enumerate(prompts) for _ in range(config.n)), key=lambda j: -len(j[1]))
    outputs: list[list[str]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    was_training, old_side = model.training, tokenizer.padding_side
    tokenizer.padding_side = "left"  # decoder-only batches must be left-padded
    do_sample = config.temperature > 0
    gen_kwargs: dict[str, Any] = {"max_new_tokens": config.max_new_tokens, "do_sample": do_sample}
    if do_sample:
        gen_kwargs.update(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k or 0)
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), \
                torch.inference_mode(), \
                tqdm(total=len(jobs), desc=desc, disable=not config.show_progress, leave=False, unit="seq") as bar:
            torch.manual_seed(config.seed)
            for start in range(0, len(jobs), config.batch_size):
                batch = jobs[start : start + config.batch_size]
                enc = tokenizer([p for _, p in batch], return_tensors="pt", padding=True, add_special_tokens=False)
                enc = {k: v.to(device) for k, v in enc.items()}
                out = model.generate(**enc, **gen_kwargs, pad_token_id=tokenizer.pad_token_id)
                texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
                for (i, _), text in zip(batch, texts, strict=True):
                    outputs[i].append(text)
                bar.update(len(batch))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return outputs


def vllm_available() -> bool:
    """True when vLLM is installed and a CUDA GPU is present."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def check_backend(backend: str) -> None:
    """backend 'vllm' needs vLLM and a CUDA GPU: say so before any model is loaded."""
    if backend == "vllm" and not vllm_available():
        missing = "the vllm package" if importlib.util.find_spec("vllm") is None else "a CUDA GPU"
        raise ValueError(f"eval.backend='vllm' (--backend vllm) needs the vllm package and a CUDA GPU, and {missing} "
                         "is missing here; use --backend hf (or auto)")


def generate_vllm(model_path: str, prompts: Sequence[str], config: EvalConfig) -> list[list[str]]:
    """`config.n` completions per prompt with vLLM (GPU only); the engine is freed afterwards."""
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, seed=config.seed)
    params = SamplingParams(n=config.n, temperature=config.temperature,
                            top_p=config.top_p if config.temperature > 0 else 1.0, top_k=config.top_k or -1,
                            max_tokens=config.max_new_tokens, seed=config.seed)
    try:
        outs = llm.generate(list(prompts), params, use_tqdm=config.show_progress)
        return [[o.text for o in out.outputs] for out in outs]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()
