"""truly_ppo's bounded-memory full-vocabulary KL: the top-k + tail summary of pi_old (trustclip.objectives.topk_kl)
against float64 references, its chain-rule error identity, gradients, and the trainer's chunked LM-head path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trustclip.objectives.topk_kl import exact_kl, topk_kl, topk_logprobs


def random_logprobs(seed: int, shape: tuple[int, ...], vocab: int, scale: float = 3.0) -> tuple[torch.Tensor, ...]:
    """Old and new float64 log-softmaxes, the new one a perturbation of the old (as after a few updates)."""
    g = torch.Generator().manual_seed(seed)
    old_logits = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale
    new_logits = old_logits + 0.3 * torch.randn(*shape, vocab, generator=g, dtype=torch.float64)
    return old_logits.log_softmax(-1), new_logits.log_softmax(-1)


def reference_topk_kl(old: np.ndarray, new: np.ndarray, k: int) -> np.ndarray:
    """KL between the (k + 1)-outcome distributions, built explicitly, one position at a time (float64)."""
    out = np.empty(old.shape[:-1])
    for pos in np.ndindex(*old.shape[:-1]):
        p, q = np.exp(old[pos]), np.exp(new[pos])
        top = np.argsort(-p, kind="stable")[:k]
        rest = np.setdiff1d(np.arange(p.size), top)
        p_coarse = np.append(p[top], p[rest].sum())
        q_coarse = np.append(q[top], q[rest].sum())
        out[pos] = np.sum(p_coarse * (np.log(p_coarse) - np.log(q_coarse)))
    return out


@pytest.mark.parametrize("k", [1, 3, 10, 31])
def test_topk_kl_matches_the_coarse_grained_reference(k):
    old, new = random_logprobs(0, (3, 4), vocab=32)
    got = topk_kl(topk_logprobs(old, k), new)
    expected = reference_topk_kl(old.numpy(), new.numpy(), min(k, 31))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 50), k=st.integers(1, 60),
       scale=st.sampled_from([0.1, 1.0, 5.0, 20.0]))
def test_error_is_tail_mass_times_kl_within_the_tail(seed, vocab, k, scale):
    """Chain rule: KL = KL_k + P_tail * KL(old tail / P_tail || new tail / Q_tail) >= KL_k, for any k and vocabulary;
    k >= V - 1 is exact."""
    old, new = random_logprobs(seed, (5,), vocab, scale)
    summary = topk_logprobs(old, k)
    approx, exact = topk_kl(summary, new), exact_kl(old, new)
    in_top = torch.zeros_like(old, dtype=torch.bool).scatter(-1, summary.indices, True)
    old_tail = old.masked_fill(in_top, -torch.inf)
    new_tail = new.masked_fill(in_top, -torch.inf)
    old_norm = old_tail - old_tail.logsumexp(-1, keepdim=True)
    new_norm = new_tail - new_tail.logsumexp(-1, keepdim=True)
    tail_kl = torch.where(old_norm.exp() > 0, old_norm.exp() * (old_norm - new_norm), 0.0).nansum(-1)
    error = exact - approx
    torch.testing.assert_close(error, summary.tail_logprob.exp() * tail_kl, rtol=1e-7, atol=1e-10)
    assert (error >= -1e-12).all()
    if k >= vocab - 1:
        torch.testing.assert_close(approx, exact, rtol=1e-9, atol=1e-12)


def test_tail_mass_is_accurate_when_tiny():
    """The tail is a log-sum-exp over the other tokens, not log(1 - sum of the top k) (which rounds to log 0)."""
    logits = torch.tensor([[30.0, 0.0, -1.0, -2.0]])
    summary = topk_logprobs(logits.log_softmax(-1), 1)
    expected = torch.logsumexp(torch.tensor([0.0, -1.0, -2.0]), 0) - torch.logsumexp(logits[0], 0)
    torch.testing.assert_close(summary.tail_logprob[0], expected)
    assert summary.tail_logprob[0] < -25  # float32 1 - p_top would be exactly 0 here


def test_zero_for_the_same_policy_and_finite_with_zero_probabilities():
    old, _ = random_logprobs(1, (4,), vocab=20)
    old[:, :3] = -torch.inf  # tokens the old policy never samples (e.g. masked), in and out of the top k
    summary = topk_logprobs(old, 19)
    assert torch.equal(topk_kl(summary, old), torch.zeros(4, dtype=old.dtype))
    new = old.clone().requires_grad_(True)
    topk_kl(topk_logprobs(old, 5), new).sum().backward()
    assert torch.isfinite(new.grad).all()


def test_gradient_in_the_current_policy():
    """float64 gradcheck w.r.t. the current logits (the rollback term of truly_ppo differentiates the KL)."""
    old, _ = random_logprobs(2, (2, 3), vocab=12)
    summary = topk_logprobs(old, 4)
    logits = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: topk_kl(summary, z.log_softmax(-1)), (logits,))


def test_bad_k_and_vocabulary_raise():
    with pytest.raises(ValueError, match="k=0"):
        topk_logprobs(torch.zeros(2, 5), 0)
    with pytest.raises(ValueError, match="vocabulary of at least 2"):
        topk_logprobs(torch.zeros(2, 1), 1)


# ------------------------------------------------------------------ the trainer's chunked LM-head path
def make_truly_trainer(tiny_model_path, tmp_path, storage):
    pytest.importorskip("trl")
    from datasets import Dataset

    from trustclip.integrations.trl import TrustClipGRPOConfig, TrustClipGRPOTrainer
    from trustclip.integrations.trl.compat import checkpointing_off
    from trustclip.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_path)
    args = TrustClipGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, num_iterations=2, objective="truly_ppo", temperature=0.7, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", full_kl_storage=storage, full_kl_topk=8,
        **checkpointing_off(),
    )
    dataset = Dataset.from_list([{"prompt": "Compute 1+2.\n"}] * 4)
    return TrustClipGRPOTrainer(model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                                train_dataset=dataset, processing_class=tokenizer)


def _batch(tokenizer, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = tokenizer(["Compute 1+2.\n", "Compute 33+4.\n", "Go\n"], return_tensors="pt", padding=True,
                       add_special_tokens=False)
    completion_ids = torch.randint(4, len(tokenizer), (3, 7), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 4:] = 0
    return {"prompt_ids": prompt.input_ids, "prompt_mask": prompt.attention_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask}


def _direct(model, inputs, temperature):
    """Full (B, T, V) log-softmax of the completion positions, the plain way."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    n = inputs["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -n - 1:-1]
    return torch.log_softmax(logits.float() / temperature, -1)


@pytest.mark.parametrize("storage", ["hidden", "topk"])
def test_chunked_forward_equals_the_full_logits_path(tiny_model_path, tmp_path, monkeypatch, storage):
    """Old log-probs, entropies, the KL to pi_old (exact from the stored hidden states, or KL_k from the stored top-k)
    and its gradient equal the plain (B, T, V) computation, with the LM head split into many chunks (2 positions
    each), after an update of every weight (the LM head included: pi_old's head must be a frozen copy)."""
    import trustclip.integrations.trl.trainer as module

    trainer = make_truly_trainer(tiny_model_path, tmp_path, storage)
    model = trainer.model
    inputs = _batch(trainer.processing_class)
    monkeypatch.setattr(module, "CHUNK_ELEMENTS", 2 * model.get_output_embeddings().weight.size(0))
    logps, stored = trainer._old_policy(inputs)
    with torch.no_grad():
        old_full = _direct(model, inputs, trainer.temperature)
        _, entropies, _ = trainer._full_vocab_forward(model, inputs)
    torch.testing.assert_close(logps, old_full.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropies, -(old_full.exp() * old_full).sum(-1))
    if storage == "topk":
        expected = topk_logprobs(old_full, 8)
        assert stored["old_topk_indices"].dtype == torch.int32
        assert torch.equal(stored["old_topk_indices"].long(), expected.indices)
        torch.testing.assert_close(stored["old_tail_logps"], expected.tail_logprob)
    else:
        assert stored["old_hidden_states"].shape == (3, 7, model.config.hidden_size)

    with torch.no_grad():  # a different current policy
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    _, _, kl = trainer._full_vocab_forward(model, inputs, old=stored)
    weights = torch.rand(kl.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((kl * weights).sum(), list(model.parameters()))
    new_full = _direct(model, inputs, trainer.temperature)
    reference = topk_kl(expected, new_full) if storage == "topk" else exact_kl(old_full, new_full)
    reference_grads = torch.autograd.grad((reference * weights).sum(), list(model.parameters()))
    torch.testing.assert_close(kl, reference)
    assert (kl > 0).all()
    for got, want in zip(grads, reference_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_old_log_probs_come_from_the_scoring_path(tiny_model_path, tmp_path):
    """The old pass yields the log-probs the loss recomputes (ratio exactly 1 before the first update)."""
    trainer = make_truly_trainer(tiny_model_path, tmp_path, "hidden")
    inputs = _batch(trainer.processing_class)
    logps, _ = trainer._old_policy(inputs)
    again, _, _ = trainer._full_vocab_forward(trainer.model, inputs)
    assert torch.equal(logps, again.detach())


def test_bad_storage_and_topk_name_the_value(tmp_path):
    pytest.importorskip("trl")
    from trustclip.integrations.trl import TrustClipGRPOConfig

    with pytest.raises(ValueError, match="full_kl_topk=0"):
        TrustClipGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, full_kl_topk=0)
    with pytest.raises(ValueError, match="full_kl_storage='full'"):
        TrustClipGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, full_kl_storage="full")
