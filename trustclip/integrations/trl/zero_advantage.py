"""DAPO's zero-advantage filter without its re-sampling (`skip_zero_advantage`, arXiv 2503.14476, Eq. 11), on a
generation batch: plain tensors and lists in, the kept rows out; the only collective is the caller's
`sum_over_processes`."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

# Per-completion inputs of a multimodal batch that are not split per row (their leading dimension is not B).
MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


def loss_mask(batch: dict[str, Any]) -> torch.Tensor:
    """The completion tokens the loss acts on (tool-call tokens excluded, as in TRL)."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


def drop_zero_advantage(output: dict[str, Any], steps_per_generation: int,
                        sum_over_processes: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                        ) -> tuple[dict[str, Any], float]:
    """This process's generation batch without its zero-advantage completions (per-completion tensors and lists
    keep their rows, in order), and the kept fraction over every process. The batch is later split into
    `steps_per_generation` equal slices, so the kept count is rounded up to a multiple of it with zero-advantage rows
    (they add nothing to the gradient). `num_items_in_batch` becomes the kept valid tokens of every process."""
    if any(key in output for key in MULTIMODAL_KEYS):
        raise ValueError("skip_zero_advantage does not support multimodal inputs (their image tensors are not "
                         "split per completion); turn it off")
    advantages = output["advantages"]
    informative = advantages.ne(0) if advantages.dim() == 1 else advantages.ne(0).any(dim=1)
    rows = informative.nonzero().flatten()
    size = advantages.size(0)
    wanted = min(size, max(steps_per_generation, math.ceil(rows.numel() / steps_per_generation) * steps_per_generation))
    if wanted > rows.numel():
        fillers = (~informative).nonzero().flatten()[: wanted - rows.numel()]
        rows = torch.cat([rows, fillers]).sort().values
    kept = {}
    for key, value in output.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.size(0) == size:
            kept[key] = value[rows]
        elif isinstance(value, list) and len(value) == size:
            kept[key] = [value[i] for i in rows.tolist()]
        else:
            kept[key] = value
    sizes = torch.tensor([rows.numel(), size], dtype=torch.float, device=advantages.device)
    counts = torch.cat([loss_mask(kept).sum().float().reshape(1), sizes])  # on device: one sync, after the reduce
    tokens, n_kept, n_all = sum_over_processes(counts).tolist()
    kept["num_items_in_batch"] = torch.tensor(tokens, device=advantages.device)
    return kept, n_kept / max(n_all, 1.0)
