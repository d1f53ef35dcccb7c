"""Calibration text: the documented corpus split, tokenization into sequences, hashes.

Split (config.CORPUS_HELDOUT_FRACTION = 0.2): calibration reads only the first 80% of
each text file's characters, evaluation only the last 20% (``split_corpus_text``), so
calibrated rotations never see evaluation text. Files ending in .xz are read with lzma.

Sequences: ``num_tokens // seq_len`` sequences of ``seq_len`` tokens, spread as evenly
as possible over the files: row j comes from file j % len(files) (interleaved, so the
first rows, which the clip search keeps, cover every file), each file's sequences cut
consecutively from the start of its calibration part. No special tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import lzma
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from vllm_oscar.config import CALIBRATION_TEXT_FRACTION, CORPUS_HELDOUT_FRACTION

#: Characters read per wanted token at first (grows until enough tokens are found).
_CHARS_PER_TOKEN_GUESS = 6


def read_text(path: str | os.PathLike[str]) -> str:
    """The whole text of ``path`` (lzma-decompressed when it ends in .xz)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"calibration text {file} does not exist.")
    if file.suffix == ".xz":
        with lzma.open(file, "rt", encoding="utf-8") as stream:
            return stream.read()
    return file.read_text(encoding="utf-8")


def split_corpus_text(text: str, heldout_fraction: float = CORPUS_HELDOUT_FRACTION) -> tuple[str, str]:
    """(calibration part, held-out evaluation part): first / last characters of ``text``."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={heldout_fraction!r} must lie in [0, 1).")
    cut = int(len(text) * (1.0 - heldout_fraction))
    return text[:cut], text[cut:]


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass
class CalibrationData:
    """Token sequences for calibration.

    Attributes:
        tokens: [N, T] int64 token ids.
        sha256: hex sha256 of ``tokens`` (int64 little-endian bytes): what the model saw.
        sources: per file: name, sha256 of the file, sequences and characters used.
    """

    tokens: torch.Tensor
    sha256: str
    sources: list[dict[str, Any]]


def _file_tokens(tokenizer: Any, text: str, needed: int, name: str, fraction: float) -> tuple[list[int], int]:
    """First ``needed`` token ids of ``text`` (tokenizing a growing prefix), and chars used."""
    chars = needed * _CHARS_PER_TOKEN_GUESS + 64
    while True:
        prefix = text[:chars]
        ids = tokenizer(prefix, add_special_tokens=False).input_ids
        truncated = chars < len(text)
        usable = ids[:-1] if truncated else ids  # the last token of a cut prefix may be partial
        if len(usable) >= needed:
            return usable[:needed], len(prefix)
        if not truncated:
            raise ValueError(
                f"calibration text {name} is too short: its first {fraction:.0%} ({len(text)} characters) "
                f"gives {len(usable)} tokens, {needed} are needed. Pass more or longer --data files, or "
                "fewer --tokens."
            )
        chars *= 2


def calibration_tokens(
    tokenizer: Any,
    paths: Sequence[str | os.PathLike[str]],
    num_tokens: int,
    seq_len: int,
    text_fraction: float = CALIBRATION_TEXT_FRACTION,
) -> CalibrationData:
    """Tokenize the calibration part of ``paths`` into [num_tokens // seq_len, seq_len] ids.

    Args:
        tokenizer: a transformers tokenizer.
        paths: text files (.txt, .xz, ...).
        num_tokens: total tokens wanted (rounded down to whole sequences; >= seq_len).
        seq_len: tokens per sequence.
        text_fraction: leading fraction of each file that may be used (default: the
            calibration split; 1.0 uses whole files).
    """
    if not paths:
        raise ValueError("no calibration text given: pass at least one --data FILE.")
    if seq_len <= 0 or num_tokens < seq_len:
        raise ValueError(f"--tokens={num_tokens} must be >= --seq-len={seq_len} > 0 (whole sequences only).")
    if not 0.0 < text_fraction <= 1.0:
        raise ValueError(f"text fraction {text_fraction!r} must lie in (0, 1].")
    sequences = num_tokens // seq_len
    rows: list[list[int]] = [[] for _ in range(sequences)]
    sources = []
    for index, path in enumerate(paths):
        targets = range(index, sequences, len(paths))
        if not targets:
            continue
        text, _ = split_corpus_text(read_text(path), 1.0 - text_fraction)
        ids, chars = _file_tokens(tokenizer, text, len(targets) * seq_len, str(path), text_fraction)
        for i, row in enumerate(targets):
            rows[row] = ids[i * seq_len:(i + 1) * seq_len]
        sources.append({"file": Path(path).name, "sha256": sha256_file(path), "sequences": len(targets),
                        "characters": chars, "text_fraction": text_fraction})
    tokens = torch.tensor(rows, dtype=torch.int64)
    digest = hashlib.sha256(tokens.numpy().astype("<i8").tobytes()).hexdigest()
    return CalibrationData(tokens, digest, sources)
