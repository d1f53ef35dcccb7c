"""Token sequences for evaluation: the held-out part of the corpora.

Every corpus file is split by characters exactly as calibration splits it
(calibration.data.split_corpus_text, config.CORPUS_HELDOUT_FRACTION): calibration reads
only the first part, evaluation only the held-out end, so no evaluated token was seen by
calibration. Files may be plain text or .xz.
"""

from __future__ import annotations

import torch

from vllm_oscar.calibration.data import read_text, split_corpus_text


def token_sequences(tokenizer, text: str, seq_len: int, num_seqs: int) -> torch.Tensor:
    """[num_seqs, seq_len] int64: consecutive non-overlapping windows of the tokenized text.

    Raises ValueError when the text holds fewer than num_seqs * seq_len tokens.
    """
    needed = seq_len * num_seqs
    # Tokenize only as much text as needed (with margin): corpora are ~10 MB.
    chars = min(len(text), needed * 8)
    ids = tokenizer(text[:chars], add_special_tokens=False).input_ids
    if len(ids) < needed:
        raise ValueError(
            f"the text holds {len(ids)} tokens, fewer than {num_seqs} sequences x {seq_len} tokens; "
            "lower --num-seqs or --seq-len, or pass a longer file."
        )
    return torch.tensor(ids[:needed], dtype=torch.int64).reshape(num_seqs, seq_len)


def heldout_sequences(tokenizer, paths: list[str], seq_len: int, num_seqs: int) -> torch.Tensor:
    """[N, seq_len] evaluation sequences from the held-out parts, spread evenly over the files."""
    per_file = [num_seqs // len(paths) + (i < num_seqs % len(paths)) for i in range(len(paths))]
    parts = [
        token_sequences(tokenizer, split_corpus_text(read_text(p))[1], seq_len, n)
        for p, n in zip(paths, per_file)
        if n
    ]
    return torch.cat(parts)

