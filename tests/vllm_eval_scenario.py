"""The vLLM evaluation scenario of tests/test_vllm_eval.py, run in a fresh process (an in-process vLLM engine takes
over the process's torch threads, which the test process must keep). One process for every step, so vLLM and
transformers are imported once (their imports take most of its time). Prints one JSON line.

    python tests/vllm_eval_scenario.py WORK_DIR

1. The models: builtin:tiny's architecture with its weights redrawn at std 0.1 (at its own 0.02 every greedy
   completion is one repeated newline, on which any two samplers agree), and a LoRA adapter on it with random
   (non-zero) weights, saved as an adapter folder; some completions end with the end-of-sequence token.
2. A benchmark whose answers are, for some rows, the last number of HF's greedy completion of either model (scored with
   data.answer_fallback), so that Mean@K is neither 0 nor 1 and a changed completion can change it.
3. `trustclip eval --backend hf` of both models; `trustclip eval --backend vllm` of the adapter (merged for vLLM),
   greedy, float32.
4. `trustclip train` from the redrawn model (evaluation before, RL with LoRA, evaluation after) with
   eval.backend=vllm, then `trustclip eval --backend hf` of its rl/final (an adapter, which vLLM got merged).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

PROBLEMS = [f"Compute {a}+{b}." for a, b in [(3, 4), (12, 7), (5, 9), (21, 30), (8, 8), (40, 2), (6, 1), (17, 25),
                                                (9, 9), (33, 4), (2, 71), (14, 14), (50, 5), (7, 38), (11, 0), (4, 46)]]
EVAL = ["--temperature", "0", "--k", "2", "--max-new-tokens", "24", "--answer-fallback", "--no-progress"]


def build_models(work: Path) -> tuple[Path, Path]:
    import torch
    from peft import LoraConfig, get_peft_model

    from trustclip.models import build_tiny_model, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(build_tiny_model(work / "tiny"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    base, adapter = work / "model", work / "adapter"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    model.name_or_path = str(base)  # the adapter's base_model_name_or_path
    torch.manual_seed(2)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    return base, adapter


def build_benchmark(models: tuple[Path, Path], work: Path) -> Path:
    """Answers: the last number of HF's greedy completion of the adapter (rows 0, 4, ...) or of the base model
    (rows 1, 5, ...), else a number no completion holds."""
    from trustclip.evaluation import EvalConfig, evaluate_checkpoints

    rows = [{"id": str(i), "problem": p, "answer": "0"} for i, p in enumerate(PROBLEMS)]
    config = EvalConfig(temperature=0.0, k=1, max_new_tokens=24, backend="hf", show_progress=False)
    base, adapter = evaluate_checkpoints([str(m) for m in models], {"b": rows}, config)
    for i, row in enumerate(rows):
        source = {0: adapter, 1: base}.get(i % 4)
        numbers = re.findall(r"\d+", source.samples["b"][i]["completions"][0]) if source else []
        row["answer"] = numbers[-1] if numbers else "123456789"
    path = work / "bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli(*argv: str) -> float:
    from trustclip.cli import main

    t = time.perf_counter()
    code = main(list(argv))
    if code != 0:
        raise SystemExit(f"trustclip {' '.join(argv)} exited with {code}")
    return round(time.perf_counter() - t, 1)


def samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


def results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def main(work: Path) -> dict:
    base, adapter = build_models(work)
    bench = build_benchmark((base, adapter), work)
    out: dict = {"seconds": {}}
    for backend, models in (("hf", [base, adapter]), ("vllm", [adapter])):  # HF first: vLLM changes torch's threads
        folder = work / backend
        out["seconds"][backend] = cli("eval", *[a for m in models for a in ("--model", str(m))], "--benchmark",
                                      f"b={bench}", "--backend", backend, *EVAL, "--output", str(folder))
        out[backend] = {"samples": samples(folder), "results": results(folder)}
    run = work / "run"
    sets = {"output_dir": run, "model.name_or_path": base, "model.lora": "true", "report_to": "[]", "bf16": "false",
            "data.eval": f"[b={bench}]", "data.answer_fallback": "true", "eval.backend": "vllm", "eval.k": 2,
            "eval.temperature": 0.0, "eval.max_new_tokens": 24, "rl.max_steps": 2, "rl.per_device_train_batch_size": 8,
            "rl.num_generations": 4, "rl.max_completion_length": 12, "rl.save_steps": 2, "data.train_limit": 64,
            "plots": "false", "quiet": "true"}
    overrides = [a for key, value in sets.items() for a in ("--set", f"{key}={value}")]
    out["seconds"]["train"] = cli("train", "--skip", "sft", *overrides)
    out["train"] = {when: json.loads((run / "eval" / f"{when}.json").read_text()) for when in ("before", "after")}
    out["train_final_is_adapter"] = (run / "rl" / "final" / "adapter_config.json").is_file()
    out["seconds"]["hf-after"] = cli("eval", "--model", str(run / "rl" / "final"), "--backend", "hf",
                                     "--output", str(work / "hf-after"), "--no-progress")
    out["hf-after"] = {"results": results(work / "hf-after")}
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    out["cpu_head_sizes"] = list(CPUAttentionBackend.get_supported_head_sizes())
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
