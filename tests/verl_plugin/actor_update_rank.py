"""One rank of verl 0.9.1's own actor update on CPU; `test_verl_actor_update.py` starts one process per rank.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python actor_update_rank.py SPEC.json

For each case of the spec (a list of Hydra overrides of verl's `ppo_trainer` config) it builds verl's
`ActorRolloutRefWorker` (role "actor") and runs what verl's trainer runs on it (`trainer/ppo/ray_trainer.py`,
`_compute_old_log_prob` and `_update_actor`): `init_model` -> `compute_log_prob` -> `update_actor`, which goes
through the FSDP2 engine's `train_batch` to `workers/utils/losses.py:ppo_loss` and `get_policy_loss_fn(loss_mode)`.
This rank holds its contiguous share of the batch, the rows Ray's dispatch would send it. The old log-probs are
verl's own log-probs plus the spec's fixed offsets: the policy that sampled the batch differs from the current one,
as on every mini-batch after the first, so the trust region has tokens to clip.

Writes `rank<r>.pt`: per case, this rank's rows, log-probs, old log-probs, verl's logged metrics, and every
parameter (full, gathered from the FSDP2 shards) before and after the update.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from verl_cpu import CPU_OVERRIDES, run_verl_on_cpu


def padded_batch(batch: dict, rows: slice, **local: torch.Tensor):
    """The rows of the batch (plus `local` tensors of these rows) as verl's trainer holds them (left-padded prompts,
    right-padded responses), in the no-padding layout its workers take (`DataProto.to_tensordict` then
    `left_right_2_no_padding`)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    keys = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "advantages")
    tensors = {key: batch[key][rows] for key in keys} | local
    data = left_right_2_no_padding(TensorDict(tensors, batch_size=[len(tensors["prompts"])]))
    tu.assign_non_tensor(data, temperature=1.0)  # the rollout temperature, as `_update_actor` passes it
    return data


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter in full (a collective call: all ranks make it)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in module.named_parameters()}


def run_case(overrides: list[str], spec: dict, batch: dict, rows: slice) -> dict:
    from hydra import compose, initialize_config_module
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import no_padding_2_padding

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[f"actor_rollout_ref.model.path={spec['model']}",
                                                               *CPU_OVERRIDES, *overrides])
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor")
    worker.init_model()
    before = full_parameters(worker.actor.engine.module)

    data = padded_batch(batch, rows)
    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False)
    log_probs = no_padding_2_padding(tu.get(worker.compute_log_prob(data), "log_probs"), data)

    old_log_probs = (log_probs + batch["old_offsets"][rows]) * batch["response_mask"][rows]
    data = padded_batch(batch, rows, old_log_probs=old_log_probs)
    actor = config.actor_rollout_ref.actor
    mini_batch_size = actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    tu.assign_non_tensor(data, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=mini_batch_size, mini_batch_size=mini_batch_size, epochs=actor.ppo_epochs,
                         seed=actor.data_loader_seed, dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True)
    metrics = tu.get(worker.update_actor(data), "metrics")
    return {"rows": (rows.start, rows.stop), "log_probs": log_probs, "old_log_probs": old_log_probs,
            "metrics": {key: [float(v) for v in values] for key, values in metrics.items()},
            "before": before, "after": full_parameters(worker.actor.engine.module)}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    run_verl_on_cpu()
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = torch.load(spec["batch"])
    share = len(batch["prompts"]) // world_size
    rows = slice(rank * share, (rank + 1) * share)
    results = {name: run_case(overrides, spec, batch, rows) for name, overrides in spec["cases"].items()}
    torch.save(results, Path(spec["out"]) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
