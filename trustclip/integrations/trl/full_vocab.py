"""truly_ppo's forward of a transformers causal LM: per completion token, the log-prob, the entropy and the
full-vocabulary KL(pi_old || pi) (`trustclip.objectives.full_kl`, fed with the final hidden states that predict the
completion and the LM head), and what to keep of pi_old per token in the generation batch (`full_kl_storage`):
its final hidden states plus its LM head (exact KL), or its top-k log-probs and tail mass."""

from __future__ import annotations

import copy
from typing import Any

import torch

from trustclip.objectives.full_kl import CHUNK_ELEMENTS, Head, full_vocab_logprobs
from trustclip.objectives.topk_kl import TopKLogProbs
from trustclip.precision import unwrap_peft

# Keys of what the generation batch keeps of pi_old per completion token (split per micro-batch like every (B, ...)
# tensor), per `full_kl_storage`.
HIDDEN_KEYS = ("old_hidden_states",)
TOPK_KEYS = ("old_topk_indices", "old_topk_logps", "old_tail_logps")


def prompt_and_completion(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) of prompt and completion side by side, as the policy reads them."""
    return (torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1))


def row_slices(inputs: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """`inputs` cut into consecutive slices of `size` completions (the tensors the forward reads)."""
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    total = inputs["completion_ids"].size(0)
    return [{key: inputs[key][start:start + size] for key in keys} for start in range(0, total, size)]


def causal_lm(model: Any, unwrap: Any) -> Any:
    """The transformers model inside the accelerate / PEFT wrappers (PEFT injects its adapters in place)."""
    inner = unwrap(model)
    return unwrap_peft(inner)


def completion_hidden_states(model: Any, lm: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             completion_length: int, autocast: Any) -> torch.Tensor:
    """(B, T, H) final hidden states that predict the last `completion_length` tokens of `input_ids`.

    `model` is called as a whole (DDP / PEFT wrappers see their forward) with `logits_to_keep=1`, so no (B, L, V)
    logits are made; a hook on `lm`'s backbone catches the hidden states. Raises ValueError for LM heads with logit
    soft-capping or scaling, which the chunked KL does not apply."""
    config = lm.config.get_text_config()
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", 1.0) not in (None, 1.0):
        raise ValueError("truly_ppo's chunked full-vocabulary KL supports plain LM heads (no logit softcapping or "
                         f"scaling); model {config.model_type!r} has them")
    captured: list[torch.Tensor] = []
    hook = lm.base_model.register_forward_hook(lambda _module, _args, out: captured.append(out[0]))
    try:
        with autocast():
            model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1, use_cache=False)
    finally:
        hook.remove()
    return captured[-1][:, -completion_length - 1:-1]


def head_operand(head: torch.nn.Module) -> Head:
    """The LM head as `full_vocab_logprobs` takes it: its weight when it is a plain bias-free linear map, else the
    module (e.g. with adapters on the head)."""
    return head.weight if type(head) is torch.nn.Linear and head.bias is None else head


class FullVocabForward:
    """The forward of `model` on a batch of prompts + completions, through `full_vocab_logprobs`; keeps pi_old's LM
    head per mode ("train" / "eval") when pi_old is stored as hidden states. `unwrap` and `autocast` are the
    accelerator's."""

    def __init__(self, storage: str, topk: int, temperature: float, unwrap: Any, autocast: Any) -> None:
        self.keys = TOPK_KEYS if storage == "topk" else HIDDEN_KEYS
        self.topk, self.temperature, self.unwrap, self.autocast = topk, temperature, unwrap, autocast
        self.old_heads: dict[str, torch.nn.Module] = {}

    def keep_head(self, model: Any, mode: str) -> None:
        """Keep the LM head of the policy that just scored a generation batch as pi_old's (hidden-state storage)."""
        if self.keys == HIDDEN_KEYS:  # the live head when it does not train (e.g. LoRA elsewhere), else a frozen copy
            head = causal_lm(model, self.unwrap).get_output_embeddings()
            trains = any(p.requires_grad for p in head.parameters())
            self.old_heads[mode] = copy.deepcopy(head).requires_grad_(False) if trains else head

    def __call__(self, model: Any, inputs: dict[str, Any], *, mode: str, old: dict[str, torch.Tensor] | None = None,
                 keep: bool = False, chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(log-prob, entropy, third) per completion token, at the sampling temperature; the third item is, with `old`
        (what `keep` returned for pi_old), KL(pi_old || pi) per token; with `keep`, what to keep of this policy (a
        dict of `keys`); else None."""
        lm = causal_lm(model, self.unwrap)
        completion = inputs["completion_ids"]
        hidden = completion_hidden_states(model, lm, *prompt_and_completion(inputs), completion.size(1), self.autocast)
        topk = self.keys == TOPK_KEYS
        if keep:  # this policy is pi_old: nothing to compare it with
            given = {"keep_topk": self.topk} if topk else {}
        elif old is None:
            given = {}
        elif topk:  # KL_k from pi_old's top-k log-probs and tail mass
            given = {"old_topk": TopKLogProbs(*(old[key] for key in TOPK_KEYS))}
        else:  # pi_old's logits from its final hidden states, through its LM head: the exact KL
            given = {"old_hidden": old[HIDDEN_KEYS[0]], "old_head": head_operand(self.old_heads[mode])}
        out = full_vocab_logprobs(hidden, head_operand(lm.get_output_embeddings()), completion,
                                  temperature=self.temperature, chunk_elements=chunk_elements, **given)
        if keep and topk:
            kept = [out.topk.indices.to(torch.int32), out.topk.logprobs, out.topk.tail_logprob]
            return out.logp, out.entropy, dict(zip(TOPK_KEYS, kept, strict=True))
        if keep:
            return out.logp, out.entropy, {HIDDEN_KEYS[0]: hidden.detach()}
        return out.logp, out.entropy, out.kl
