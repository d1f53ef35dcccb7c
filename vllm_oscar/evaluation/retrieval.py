"""Long-context retrieval (passkey in a generated haystack) and greedy-generation agreement.

Passkey (Mohtashami & Jaggi 2023 style): a 5-digit key is stated once at a chosen depth
of repeated filler text, the prompt ends with "What is the pass key? The pass key is",
and the answer " 12345" is scored teacher-forced in one forward pass: the retrieval
counts as correct when greedy decoding would produce every answer token (argmax at each
answer position equals the answer token). That equals generating the answer greedily,
without a decode loop.

Greedy agreement: from the same prompt, generate N tokens greedily under BF16 and under
the method (decode with a KV cache through the harness); report the common prefix.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from vllm_oscar.evaluation.harness import method_logits, use_method
from vllm_oscar.evaluation.methods import KVMethod
from vllm_oscar.evaluation.metrics import common_prefix_length

_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
_QUESTION = "\nWhat is the pass key? The pass key is"
_ANSWER = " {key}"


@dataclasses.dataclass
class PasskeyCase:
    """One haystack: token ids [T], where the answer starts, and the case's settings
    (``length`` is the requested length; the real one is within a filler sentence of it)."""

    input_ids: torch.Tensor
    answer_start: int
    length: int
    depth: float
    key: int


def passkey_case(tokenizer, length: int, depth: float, key: int) -> PasskeyCase:
    """Build a haystack of about ``length`` tokens with the key at ``depth`` in [0, 1]."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    intro, needle = encode(_INTRO), encode(_NEEDLE.format(key=key))
    question, answer = encode(_QUESTION), encode(_ANSWER.format(key=key))
    filler = encode(_FILLER)
    budget = length - len(intro) - len(needle) - len(question) - len(answer)
    if budget <= 0:
        raise ValueError(f"length={length} is too short for a passkey prompt.")
    hay = (filler * (budget // len(filler) + 1))[:budget]
    cut = int(round(depth * budget / len(filler))) * len(filler)
    ids = intro + hay[:cut] + needle + hay[cut:] + question
    return PasskeyCase(torch.tensor(ids + answer), len(ids), length, depth, key)


def passkey_correct(logits: torch.Tensor, case: PasskeyCase) -> bool:
    """True when argmax of ``logits`` [T', V] reproduces every answer token (T' <= T: the
    logits of the last T' positions, at least from answer_start - 1 on)."""
    predicted = logits[case.answer_start - 1 - (len(case.input_ids) - logits.shape[0]) : -1].argmax(dim=-1)
    return bool(torch.equal(predicted.cpu(), case.input_ids[case.answer_start :]))


def passkey_cases(tokenizer, lengths: list[int], depths: list[float], seed: int) -> list[PasskeyCase]:
    """One case per (length, depth), keys drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [passkey_case(tokenizer, n, d, rng.randrange(10000, 100000)) for n in lengths for d in depths]


def passkey_accuracy(model, cases: list[PasskeyCase], method: KVMethod, sink: int, recent: int) -> dict[str, float]:
    """{'<length>': share of depths retrieved} for each haystack length."""
    device = next(model.parameters()).device
    hits: dict[str, list[bool]] = {}
    for case in cases:
        answer_logits = method_logits(
            model, case.input_ids[None].to(device), method, sink, recent,
            keep=len(case.input_ids) - case.answer_start + 1,
        )[0]
        hits.setdefault(str(case.length), []).append(passkey_correct(answer_logits, case))
    return {length: sum(h) / len(h) for length, h in hits.items()}


@torch.no_grad()
def greedy_tokens(model, prompts: torch.Tensor, new_tokens: int, method: KVMethod, sink: int,
                  recent: int) -> torch.Tensor:
    """[B, new_tokens] greedy continuations of ``prompts`` [B, T] (equal lengths, no padding),
    decoded together with a KV cache under ``method``."""
    device = next(model.parameters()).device
    with use_method(model, method, sink, recent):
        out = model.generate(
            prompts.to(device),
            attention_mask=torch.ones_like(prompts, device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=model.config.eos_token_id,
        )
    return out[:, prompts.shape[1] :].cpu()


def greedy_agreement(
    model, prompts: torch.Tensor, reference: torch.Tensor, method: KVMethod, sink: int, recent: int
) -> float:
    """Mean common-prefix length of the method's greedy tokens with the BF16 ones [B, N]."""
    tokens = greedy_tokens(model, prompts, reference.shape[1], method, sink, recent)
    lengths = [common_prefix_length(a, b) for a, b in zip(tokens, reference)]
    return sum(lengths) / len(lengths)
