"""TrustClipGRPOTrainer under accelerate's FSDP2 on CPU: two gloo processes, each holding half the batch, take the
same optimizer step as one process holding all of it, for the tiny model and for LoRA.

accelerate 1.15 does not run FSDP on a CPU, and says nothing: `accelerate launch --use_fsdp --fsdp_version 2` with
`use_cpu=True` gives `DistributedType.MULTI_CPU` and wraps the model in DDP, because `AcceleratorState` turns FSDP on
only inside its branch for accelerators (accelerate/state.py:986-1013, `elif self.distributed_type in
[MULTI_GPU, MULTI_MLU, ..., MULTI_NEURON]` ... `self.distributed_type = DistributedType.FSDP`); without `use_cpu`
a CPU-only host gets `DistributedType.NO` (state.py:769-815: no accelerator, so no process group) and each process
trains alone; `accelerate launch --cpu --use_fsdp` is refused (commands/launch.py:1204-1206). The test records
what accelerate chose (the blocker, so an accelerate release that lifts it shows up here), then applies the one
shim below, a test fixture: after the trainer built its Accelerator, set the state to FSDP with the plugin the
trainer built from its `fsdp` / `fsdp_config` arguments. From there it is accelerate's own FSDP2 code
(`fsdp2_prepare_model`: `fully_shard` over a gloo mesh), the Trainer's loop, gradient clipping and optimizer step.

Generation is replaced by a fixed rollout (the same completions, advantages and old log-probs in both runs),
so that the two runs can be compared; everything after it is the trainer's step.

This file is also the script each process runs: `python tests/test_trl_fsdp2.py MODE BATCH MODEL OUT`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BATCH, PROMPT, RESPONSE, GROUP = 8, 5, 6, 4
LR = 0.5
VARIANTS = ("full", "lora")


# --------------------------------------------------------------------------- the processes
def make_rollout(model_path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A fixed rollout batch in TRL's layout (left-padded prompts, right-padded completions), with old log-probs
    = the model's own + offsets ~N(0, 0.3^2), so that the trust region clips some tokens."""
    from trustclip.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(model_path)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_mask = torch.arange(PROMPT) >= PROMPT - torch.randint(2, PROMPT + 1, (BATCH,), generator=gen)[:, None]
    completion_lens = torch.randint(1, RESPONSE + 1, (BATCH,), generator=gen)
    completion_lens[0] = RESPONSE
    completion_mask = (torch.arange(RESPONSE) < completion_lens[:, None]).long()
    prompt_ids = torch.randint(3, vocab, (BATCH, PROMPT), generator=gen) * prompt_mask
    completion_ids = torch.randint(3, vocab, (BATCH, RESPONSE), generator=gen) * completion_mask
    ids, attention = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask.long(), completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, PROMPT - 1:-1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]
    old = (logps + 0.3 * torch.randn(BATCH, RESPONSE, generator=gen)) * completion_mask
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask.long(), "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": torch.randn(BATCH, generator=gen),
            "old_per_token_logps": old, "num_items_in_batch": completion_mask.sum()}


def trainer_classes():
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from trustclip.integrations.trl import TrustClipGRPOTrainer

    class FixedRolloutTrainer(TrustClipGRPOTrainer):
        """The trainer with generation and scoring replaced by this process's rows of a fixed rollout."""

        def __init__(self, *args, rollout: dict, **kwargs) -> None:
            self.rollout = rollout
            super().__init__(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            return dict(self.rollout)

    class CPUFSDP2Trainer(FixedRolloutTrainer):
        """The shim: FSDP with the trainer's own plugin arguments, where accelerate chose MULTI_CPU (state.py:986)."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            self.accelerate_chose = {"distributed_type": state.distributed_type.value,
                                     "fsdp_plugin": getattr(state, "fsdp_plugin", None) is not None}
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            # in both shared states, as AcceleratorState does itself (state.py:1036); each AcceleratorState() copies
            # PartialState's value over its own (state.py:919)
            state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.is_fsdp_enabled = True

    return FixedRolloutTrainer, CPUFSDP2Trainer


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def run_variant(variant: str, fsdp2: bool, rollout: dict, model_path: str, out: Path) -> dict:
    from datasets import Dataset
    from peft import LoraConfig

    from trustclip.integrations.trl import TrustClipGRPOConfig
    from trustclip.integrations.trl.compat import checkpointing_off
    from trustclip.models import load_model_and_tokenizer

    fixed, shimmed = trainer_classes()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, tokenizer = load_model_and_tokenizer(model_path)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    fsdp = {"fsdp": True, "fsdp_config": {"fsdp_version": 2, "reshard_after_forward": True}} if fsdp2 else {}
    args = TrustClipGRPOConfig(
        output_dir=str(out / variant), per_device_train_batch_size=BATCH // world, num_generations=GROUP,
        max_completion_length=RESPONSE, num_iterations=2, objective="kl3", objective_kwargs={"delta": 0.07},
        use_cpu=True, report_to="none", save_strategy="no", max_steps=1, logging_steps=1, seed=0,
        **checkpointing_off(),
        # plain SGD: the step is -LR times the (clipped) gradient, so equal steps mean equal gradients
        optim="sgd", learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", **fsdp)
    trainer = (shimmed if fsdp2 else fixed)(
        model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": "a"}] * BATCH), peft_config=lora if variant == "lora" else None,
        rollout=rollout)
    before = {name: full(p) for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = {name: full(p) for name, p in trainer.model.named_parameters() if p.requires_grad}
    return {"before": before, "after": after, "rows": len(rollout["advantages"]),
            "sharded": any(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
            "accelerate_chose": getattr(trainer, "accelerate_chose", None),
            "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "clip_frac": [h["objective/clip_frac"] for h in trainer.state.log_history if "objective/clip_frac" in h]}


def main(mode: str, batch_path: str, model_path: str, out: str) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    batch = torch.load(batch_path)
    share = BATCH // world
    rollout = {k: v[rank * share:(rank + 1) * share] if v.dim() else v for k, v in batch.items()}
    results = {variant: run_variant(variant, mode == "fsdp2", rollout, model_path, Path(out)) for variant in VARIANTS}
    torch.save(results, Path(out) / f"{mode}-rank{rank}.pt")


# --------------------------------------------------------------------------- the test
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tiny_model_path: Path, tmp_path_factory) -> dict:
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("trl_fsdp2")
    torch.save(make_rollout(tiny_model_path), out / "batch.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    script = [str(Path(__file__).resolve()), str(out / "batch.pt"), str(tiny_model_path), str(out)]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "2",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(free_port())]
    procs = {"fsdp2": subprocess.Popen([*launch, script[0], "fsdp2", *script[1:]], env=env, cwd=out,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
             "single": subprocess.Popen([sys.executable, script[0], "single", *script[1:]], env=env, cwd=out,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)}
    try:
        for name, proc in procs.items():
            output, _ = proc.communicate(timeout=500)
            assert proc.returncode == 0, f"{name}:\n{output[-5000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {name: torch.load(out / name) for name in ("single-rank0.pt", "fsdp2-rank0.pt", "fsdp2-rank1.pt")}


def test_accelerate_alone_does_not_shard_on_cpu(runs) -> None:
    """The blocker: asked for FSDP2 on a CPU, accelerate 1.15 chooses MULTI_CPU (DDP) and drops the FSDP plugin."""
    for rank in ("fsdp2-rank0.pt", "fsdp2-rank1.pt"):
        assert runs[rank]["full"]["accelerate_chose"] == {"distributed_type": "MULTI_CPU", "fsdp_plugin": False}


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_fsdp2_processes_step_like_one_process(runs, variant: str) -> None:
    one, ranks = runs["single-rank0.pt"][variant], [runs["fsdp2-rank0.pt"][variant], runs["fsdp2-rank1.pt"][variant]]
    assert not one["sharded"] and all(r["sharded"] for r in ranks)  # FSDP2: DTensor shards, not DDP replicas
    assert one["rows"] == BATCH and [r["rows"] for r in ranks] == [BATCH // 2, BATCH // 2]
    assert one["before"].keys() == ranks[0]["after"].keys()
    if variant == "lora":
        assert all("lora_" in name for name in one["before"])
    moved = max((one["before"][k] - one["after"][k]).abs().max().item() for k in one["before"])
    assert moved > 1e-3  # the step changed the parameters
    for rank in ranks:
        for name, value in one["after"].items():
            torch.testing.assert_close(rank["after"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert rank["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert 0 < one["clip_frac"][0] < 1  # the trust region acted on this batch


if __name__ == "__main__":
    main(*sys.argv[1:])
