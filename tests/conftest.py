"""Shared fixtures. Everything runs offline: the hub is switched off before transformers is imported,
and the tiny model cache goes to a per-session temporary directory."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# Set before any test imports transformers/datasets: a hub id without it hangs ~45 s on retries.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRUSTCLIP_CACHE", tempfile.mkdtemp(prefix="trustclip-test-cache-"))

# The check of the paper's Theorems 5.1 / 5.2 is a script beside the other benchmarks, not part of the library.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import pytest  # noqa: E402

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes `device` runs on the CPU and, where one is available, on the GPU too (no skipped copies on
    a CPU-only machine; scripts/gpu_check.sh runs these on CUDA)."""
    if "device" in metafunc.fixturenames:
        import torch

        metafunc.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])


@pytest.fixture(scope="session", autouse=True)
def real_vllm_missing():
    """Evaluations in this process sample with HF even where vLLM is installed: eval.backend=auto would start a vLLM
    engine in the test process, which takes over its torch threads (and would change the numbers the tests compare).
    Session-wide, so that module fixtures that train see it too; the value is the real check (`vllm_missing`)."""
    from trustclip.evaluation import generation

    real = generation.vllm_missing
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generation, "vllm_missing", lambda: "vLLM is off in this test process (tests/conftest.py)")
        yield real


@pytest.fixture(autouse=True)
def hf_evaluation(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, real_vllm_missing) -> None:
    """Tests marked `vllm` see the installed vLLM (they start engines in subprocesses only)."""
    if request.node.get_closest_marker("vllm") is not None:
        monkeypatch.setattr("trustclip.evaluation.generation.vllm_missing", real_vllm_missing)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a freshly built tiny Qwen3 model + char-level tokenizer (seed 0)."""
    from trustclip.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_path: Path):
    """(model, tokenizer) loaded from `tiny_model_path`. Shared by the session: do not train it in place."""
    from trustclip.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The shared benchmark JSONL files; tests that need them are skipped when they are absent."""
    if not (SHARED_DATA / "aime2024.jsonl").is_file():
        pytest.skip(f"shared benchmark data not found in {SHARED_DATA}")
    return SHARED_DATA
