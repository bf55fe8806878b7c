"""DAPO's zero-advantage filter (trustclip.integrations.trl.zero_advantage) on its own, without TRL: which rows it
keeps, the whole slices it fills, the counts it reduces over processes."""

from __future__ import annotations

import pytest
import torch

from trustclip.integrations.trl.zero_advantage import drop_zero_advantage


def generation_batch(advantages: list[float], length: int = 3) -> dict:
    n = len(advantages)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[:, -1] = torch.arange(n) % 2  # ragged: every other completion one token shorter
    return {"advantages": torch.tensor(advantages), "completion_ids": torch.arange(n)[:, None].repeat(1, length),
            "completion_mask": mask, "texts": [f"t{i}" for i in range(n)], "num_items_in_batch": mask.sum(),
            "prompt_ids": torch.zeros(n, 2, dtype=torch.long), "mode": "train"}


def test_keeps_the_informative_rows_in_order_with_their_tokens():
    batch = generation_batch([0.0, 0.5, 0.0, -1.0, 0.0, 2.0])
    kept, fraction = drop_zero_advantage(batch, steps_per_generation=1)
    assert kept["completion_ids"][:, 0].tolist() == [1, 3, 5] and kept["texts"] == ["t1", "t3", "t5"]
    assert torch.equal(kept["completion_mask"], batch["completion_mask"][[1, 3, 5]])
    assert kept["num_items_in_batch"].item() == 9 and kept["mode"] == "train"  # 3 rows x 3 tokens (odd rows: full)
    assert fraction == pytest.approx(3 / 6)


def test_tops_up_to_whole_slices_with_zero_advantage_rows():
    batch = generation_batch([0.0, 0.5, 0.0, 0.0, -0.5, 0.0, 1.0, 0.0])
    kept, _ = drop_zero_advantage(batch, steps_per_generation=2)
    assert kept["completion_ids"][:, 0].tolist() == [0, 1, 4, 6]  # 3 informative rows + the first filler
    nothing, fraction = drop_zero_advantage({**batch, "advantages": torch.zeros(8)}, steps_per_generation=2)
    assert nothing["completion_ids"][:, 0].tolist() == [0, 1] and fraction == 2 / 8  # one row per slice


def test_token_level_advantages_keep_a_row_with_any_nonzero_token():
    batch = generation_batch([0.0] * 4)
    batch["advantages"] = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.1, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    kept, _ = drop_zero_advantage(batch, steps_per_generation=1)
    assert kept["completion_ids"][:, 0].tolist() == [1, 3]


def test_counts_are_summed_over_processes():
    """Two processes: each keeps its own rows; the token count and the fraction are the totals of both."""
    first, second = generation_batch([0.0, 1.0, 0.0, 0.0]), generation_batch([1.0, -1.0, 0.0, 1.0])
    other = torch.tensor([8.0, 3.0, 4.0])  # the second process's (kept tokens, kept rows, rows)
    kept, fraction = drop_zero_advantage(first, 1, sum_over_processes=lambda counts: counts + other)
    assert kept["num_items_in_batch"].item() == 3 + 8 and fraction == pytest.approx(4 / 8)
    alone, _ = drop_zero_advantage(second, 1)
    assert alone["num_items_in_batch"].item() == 8  # what `other` stands for


def test_multimodal_batches_are_refused():
    with pytest.raises(ValueError, match="multimodal"):
        drop_zero_advantage({**generation_batch([1.0, 0.0]), "pixel_values": torch.zeros(2, 3)}, 1)
