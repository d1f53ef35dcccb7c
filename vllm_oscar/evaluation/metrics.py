"""Quality of a method's next-token distributions against the BF16 reference.

All metrics are taken over scored positions only: positions t in [first, T - 1) of each
sequence, i.e. where the query reads quantized history (t >= sink + recent for the
standard windows) and a next token exists for perplexity.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch


@dataclasses.dataclass
class TokenStats:
    """Sums over scored positions, so several sequences add up exactly.

    Attributes:
        count: scored positions.
        kl_sum: sum of KL(P_ref || P_method) in nats.
        nll_sum: sum of -log P_method(next token).
        top1_agree: positions where argmax P_method == argmax P_ref.
    """

    count: int = 0
    kl_sum: float = 0.0
    nll_sum: float = 0.0
    top1_agree: int = 0

    def add(self, other: "TokenStats") -> None:
        self.count += other.count
        self.kl_sum += other.kl_sum
        self.nll_sum += other.nll_sum
        self.top1_agree += other.top1_agree

    def summary(self) -> dict[str, float]:
        """{'kld': mean KL (nats/token), 'ppl': exp(mean NLL), 'top1': agreement share, 'tokens'}."""
        if self.count == 0:
            raise ValueError("no scored positions: sequences are not longer than the windows.")
        return {
            "kld": self.kl_sum / self.count,
            "ppl": math.exp(self.nll_sum / self.count),
            "top1": self.top1_agree / self.count,
            "tokens": self.count,
        }


def token_stats(
    reference_logits: torch.Tensor, logits: torch.Tensor, input_ids: torch.Tensor, first: int
) -> TokenStats:
    """Compare logits at positions [first, T - 1).

    Args:
        reference_logits, logits: [B, T, V] (any float dtype; computed in float32).
        input_ids: [B, T] tokens; position t is scored against input_ids[:, t + 1].
        first: first scored position.
    """
    ref = torch.log_softmax(reference_logits[:, first:-1].float(), dim=-1)
    return log_prob_stats(ref, logits[:, first:-1], input_ids[:, first + 1 :])


def log_prob_stats(
    reference_log_probs: torch.Tensor, logits: Optional[torch.Tensor], targets: torch.Tensor
) -> TokenStats:
    """Compare at every given position (the caller slices the scored ones).

    Args:
        reference_log_probs: [B, N, V] float32 BF16 log-probabilities (log_softmax once,
            reused by every method).
        logits: [B, N, V] the method's logits at the same positions, or None for the
            reference itself (KL 0, top-1 1 exactly).
        targets: [B, N] next tokens.
    """
    ref = reference_log_probs
    targets = targets.to(ref.device)
    if logits is None:
        nll = -ref.gather(-1, targets[..., None])[..., 0]
        return TokenStats(int(nll.numel()), 0.0, float(nll.double().sum()), int(nll.numel()))
    out = torch.log_softmax(logits.float(), dim=-1)
    kl = (ref.exp() * (ref - out)).sum(dim=-1)
    nll = -out.gather(-1, targets[..., None])[..., 0]
    agree = ref.argmax(dim=-1) == out.argmax(dim=-1)
    return TokenStats(int(kl.numel()), float(kl.double().sum()), float(nll.double().sum()), int(agree.sum()))


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    length = min(a.numel(), b.numel())
    differ = (a[:length] != b[:length]).nonzero()
    return int(differ[0]) if differ.numel() else length
