"""truly_ppo's chunked full-vocabulary log-probs, entropies and KL (trustclip.objectives.full_kl), without any
trainer: against the plain (N, V) computation in float64, gradients (gradcheck through the recomputed chunks), and
the memory bound (no (chunk, V) block is kept for the backward pass)."""

from __future__ import annotations

import pytest
import torch

from trustclip.objectives.full_kl import full_vocab_logprobs
from trustclip.objectives.topk_kl import exact_kl, topk_kl, topk_logprobs

B, T, H, V = 3, 5, 6, 40
TEMPERATURE = 0.7


def setup(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    old_hidden = hidden + 0.3 * torch.randn(B, T, H, generator=g, dtype=dtype)
    old_weight = weight + 0.3 * torch.randn(V, H, generator=g, dtype=dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, old_hidden, old_weight, targets


def reference(hidden, weight, targets, temperature=TEMPERATURE):
    """The plain way: the whole (B, T, V) log-softmax."""
    logprobs = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    return logprobs, logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logprobs.exp() * logprobs).sum(-1)


@pytest.mark.parametrize("positions_per_chunk", [1, 2, 7, B * T])
def test_matches_the_full_logits_in_float64(positions_per_chunk):
    hidden, weight, old_hidden, old_weight, targets = setup()
    logprobs, logp, entropy = reference(hidden, weight, targets)
    old_logprobs, _, _ = reference(old_hidden, old_weight, targets)
    chunk = positions_per_chunk * V
    exact = full_vocab_logprobs(hidden, weight, targets, temperature=TEMPERATURE, old_hidden=old_hidden,
                                old_head=old_weight, chunk_elements=chunk)
    torch.testing.assert_close(exact.logp, logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(exact.entropy, entropy, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(exact.kl, exact_kl(old_logprobs, logprobs), rtol=1e-12, atol=1e-12)
    assert exact.topk is None and (exact.kl > 0).all()

    kept = full_vocab_logprobs(old_hidden, old_weight, targets, temperature=TEMPERATURE, keep_topk=8,
                               chunk_elements=chunk)
    expected = topk_logprobs(old_logprobs, 8)
    assert torch.equal(kept.topk.indices, expected.indices) and kept.kl is None
    torch.testing.assert_close(kept.topk.tail_logprob, expected.tail_logprob, rtol=1e-12, atol=1e-12)
    approx = full_vocab_logprobs(hidden, weight, targets, temperature=TEMPERATURE, old_topk=kept.topk,
                                 chunk_elements=chunk)
    torch.testing.assert_close(approx.kl, topk_kl(expected, logprobs), rtol=1e-12, atol=1e-12)
    assert (approx.kl <= exact.kl + 1e-12).all()  # the top-k KL is a lower bound


def test_a_head_module_equals_its_weight():
    hidden, weight, _, _, targets = setup(1)
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
    head.weight.data.copy_(weight)
    by_module = full_vocab_logprobs(hidden, head, targets, chunk_elements=3 * V)
    by_weight = full_vocab_logprobs(hidden, weight, targets, chunk_elements=3 * V)
    torch.testing.assert_close(by_module.logp, by_weight.logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(by_module.entropy, by_weight.entropy, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("old", ["hidden", "topk"])
def test_gradcheck_through_the_recomputed_chunks(old):
    """float64 gradcheck w.r.t. the current hidden states and head weight, of logp, entropy and the KL together,
    with chunks of two positions (each recomputed in the backward pass)."""
    hidden, weight, old_hidden, old_weight, targets = setup(2)
    hidden, weight = hidden[:2, :3].clone(), weight.clone()
    old_hidden, targets = old_hidden[:2, :3], targets[:2, :3]
    if old == "hidden":
        given = {"old_hidden": old_hidden, "old_head": old_weight}
    else:
        given = {"old_topk": full_vocab_logprobs(old_hidden, old_weight, targets, keep_topk=5).topk}
    mix = torch.randn(3, *targets.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def scalar(h, w):
        out = full_vocab_logprobs(h, w, targets, temperature=TEMPERATURE, chunk_elements=2 * V, **given)
        return (mix[0] * out.logp + mix[1] * out.entropy + mix[2] * out.kl).sum()

    assert torch.autograd.gradcheck(scalar, (hidden.requires_grad_(True), weight.requires_grad_(True)))


def test_no_block_of_logits_is_kept_for_the_backward_pass():
    hidden, weight, old_hidden, old_weight, targets = setup(4, torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    saved: list[int] = []

    def pack(x):
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = full_vocab_logprobs(hidden, weight, targets, old_hidden=old_hidden, old_head=old_weight,
                                  chunk_elements=2 * V)
    assert saved and max(saved) < V  # only each chunk's inputs: 2 positions x H, targets, pi_old's hidden states
    (out.logp.sum() + out.kl.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        reference(hidden, weight, targets)
    assert max(saved) >= B * T * V  # the plain way keeps the whole (B, T, V) block


def test_float32_logits_of_a_half_precision_head():
    hidden, weight, _, _, targets = setup(5, torch.float32)
    out = full_vocab_logprobs(hidden.bfloat16(), weight.bfloat16(), targets)
    assert out.logp.dtype == torch.float32 and out.entropy.dtype == torch.float32


def test_inconsistent_arguments_are_refused():
    hidden, weight, old_hidden, old_weight, targets = setup()
    with pytest.raises(ValueError, match=r"hidden has shape \(3, 5, 6\); expected \(3, 4\)"):
        full_vocab_logprobs(hidden, weight, targets[:, :4])
    with pytest.raises(ValueError, match="needs both old_hidden and old_head"):
        full_vocab_logprobs(hidden, weight, targets, old_hidden=old_hidden)
    with pytest.raises(ValueError, match="at most one of"):
        full_vocab_logprobs(hidden, weight, targets, old_hidden=old_hidden, old_head=old_weight, keep_topk=4)
    with pytest.raises(ValueError, match="temperature=0"):
        full_vocab_logprobs(hidden, weight, targets, temperature=0)
