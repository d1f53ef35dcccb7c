"""Quality of a method's next-token distributions against the BF16 reference.

All metrics are taken over scored positions only: positions t in [first, T - 1) of each
sequence, i.e. where the query reads quantized history (t >= sink + recent for the
standard windows) and a next token exists for perplexity.
"""

from __future__ import annotations

import dataclasses
import math

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
    out = torch.log_softmax(logits[:, first:-1].float(), dim=-1)
    targets = input_ids[:, first + 1 :].to(out.device)
    kl = (ref.exp() * (ref - out)).sum(dim=-1)
    nll = -out.gather(-1, targets[..., None])[..., 0]
    agree = ref.argmax(dim=-1) == out.argmax(dim=-1)
    return TokenStats(int(kl.numel()), float(kl.double().sum()), float(nll.double().sum()), int(agree.sum()))


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    length = min(a.numel(), b.numel())
    differ = (a[:length] != b[:length]).nonzero()
    return int(differ[0]) if differ.numel() else length
