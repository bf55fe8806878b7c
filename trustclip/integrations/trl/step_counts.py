"""Exact global normalisers of an optimizer step, for a trainer that splits generation batches into micro-batches.

The contract with `transformers.Trainer` (`loss_is_scaled_for_ga = True`): each micro-batch returns its share of the
optimizer step's one-big-batch loss, so that summing over accumulation steps and averaging over processes (DDP) gives
exactly the whole step's gradient. The step's valid tokens (`token_mean`) or sequences are counted over all processes
from the buffered generation batch when the accumulation window lies inside it (always with TRL's default
steps_per_generation), else TRL's estimate is used; exact counts matter with `skip_zero_advantage`, which leaves
processes with micro-batches of different sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trustclip.integrations.trl.zero_advantage import loss_mask


class StepCounts:
    """(valid tokens, sequences) of each slice of the current generation batch, summed over processes."""

    def __init__(self, *, steps_per_generation: int, gradient_accumulation_steps: int, num_iterations: int) -> None:
        self.steps_per_generation, self.accumulation = steps_per_generation, gradient_accumulation_steps
        self.generate_every = steps_per_generation * num_iterations
        self.exact = self.generate_every % gradient_accumulation_steps == 0  # each window inside a generation batch
        self.slices: list[tuple[float, float]] | None = None

    def count(self, slices: list[dict[str, Any]], sum_over_processes: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Record the slices of a new generation batch (one collective per generation batch)."""
        tokens = torch.stack([loss_mask(b).sum() for b in slices]).float()  # stays on device: one sync, below
        sequences = torch.tensor([float(b["completion_ids"].size(0)) for b in slices], device=tokens.device)
        self.slices = [tuple(c) for c in sum_over_processes(torch.stack([tokens, sequences], dim=1)).tolist()]

    def on_policy_slices(self, micro_step: int) -> list[bool]:
        """For each slice of a generation batch made at training micro-step `micro_step`: True when it is used only
        before the next optimizer update, so the policy that sampled it is the one being trained (ratio exactly 1).

        TRL regenerates at multiples of steps_per_generation x num_iterations (or when its buffer is empty, on a
        resume) and uses slice `s % steps_per_generation` at micro-step s; the optimizer steps after every
        `gradient_accumulation_steps` micro-steps, counted from the start of each epoch, where a short last step
        closes the epoch. Only an exact schedule (whole accumulation windows per generation batch) keeps the updates
        at global multiples; otherwise every slice is scored, which is always right."""
        if not self.exact:
            return [False] * self.steps_per_generation
        next_generation = (micro_step // self.generate_every + 1) * self.generate_every
        next_update = (micro_step // self.accumulation + 1) * self.accumulation
        used_later = {s % self.steps_per_generation for s in range(next_update, next_generation)}
        return [j not in used_later for j in range(self.steps_per_generation)]

    def denominators(self, aggregation: str, inputs: dict[str, Any], *, micro_step: int, accumulation: int,
                     training: bool, processes: int) -> dict[str, float]:
        """`num_tokens` (token_mean) or `num_sequences` of this micro-batch's optimizer step, per process: counted
        over every process when its accumulation window lies inside one generation batch."""
        if training and self.exact and self.slices is not None and accumulation == self.accumulation:
            start = (micro_step // accumulation) * accumulation
            window = [self.slices[s % self.steps_per_generation] for s in range(start, start + accumulation)]
            tokens, sequences = sum(t for t, _ in window), sum(n for _, n in window)
        else:  # eval (the whole batch), or a window spanning two generation batches: TRL's estimate
            share = accumulation / self.steps_per_generation if training else 1.0
            tokens = float(inputs["num_items_in_batch"]) * share
            sequences = inputs["completion_ids"].size(0) * accumulation * processes  # equal micro-batches
        if aggregation == "token_mean":
            return {"num_tokens": max(tokens, 1.0) / processes}
        return {"num_sequences": max(sequences, 1.0) / processes}
