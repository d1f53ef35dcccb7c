"""Does folding R_V into the weights (vllm_oscar.attention.fold) cost SmolLM2 accuracy as vLLM serves it?

Scores held-out Brown prose with vLLM's own CPU attention (BF16 reference) and with OSCAR under each fold mode
(config.FOLD_MODES), prompt log-probabilities prefilled in 64-token chunks without prefix caching, so every scored
token past the BF16 windows reads the INT2 history of earlier chunks. Prints, per mode, the mean |log-prob gap| to
BF16 (per sequence too) and the perplexity; the fold adds one rounding of W_v / W_o in the model's dtype.

    python scripts/fold_quality.py [--sequences 8] [--dtype bfloat16] [--json OUT]

tests/test_vllm_fold.py runs the same scoring on 3 sequences with a stated bound (docs/QUALITY.md, "Folded
rotations", has a full run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from vllm_oscar.config import FOLD_MODES  # noqa: E402

CORPUS = Path(HERE).parents[1] / "shared" / "data" / "corpora" / "brown.txt.xz"
SEQ_LEN, CHUNK, FIRST_SCORED = 1024, 64, 320  # scored: positions past sink + recent (64 + 256)
#: Engine options of every scored run: chunked prefill without prefix caching.
ENGINE = {"enable_prefix_caching": False, "enable_chunked_prefill": True, "max_num_batched_tokens": CHUNK,
          "max_model_len": 2048, "block_size": 32}


def engine_configs(modes: tuple[str, ...] = FOLD_MODES) -> dict[str, dict[str, Any]]:
    """LLM options per scored run: "bf16" (vLLM's attention), then OSCAR under each fold mode."""
    return {"bf16": {}, **{mode: {"kv_cache_dtype": "oscar", "additional_config": {"oscar": {"fold_rotations": mode}}}
                           for mode in modes}}


def heldout(model: Path, sequences: int) -> list[torch.Tensor]:
    """``sequences`` held-out token sequences of SEQ_LEN from the Brown corpus."""
    from transformers import AutoTokenizer

    from vllm_oscar.evaluation.data import heldout_sequences

    if not CORPUS.is_file():
        raise FileNotFoundError(f"{CORPUS} is missing: the held-out text this script scores.")
    return heldout_sequences(AutoTokenizer.from_pretrained(model), [str(CORPUS)], SEQ_LEN, sequences)


def score(model: Path, sequences: list[torch.Tensor], configs: dict[str, dict[str, Any]], dtype: str = "bfloat16",
          inspect: Optional[Callable[[str, Any], Any]] = None) -> dict[str, dict[str, Any]]:
    """Per config: "logprobs" float64 [S, SEQ_LEN - 1 - FIRST_SCORED] (next-token log-probabilities at the scored
    positions) and "inspected": inspect(name, llm) while the engine runs (None without inspect)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from conftest import start_llm, stop_llm

    results: dict[str, dict[str, Any]] = {}
    for name, options in configs.items():
        llm = start_llm(model, dtype=dtype, **ENGINE, **options)
        try:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=ids.tolist()) for ids in sequences],
                                   SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
            inspected = inspect(name, llm) if inspect is not None else None
        finally:
            stop_llm(llm)
        logprobs = torch.stack([
            torch.tensor([entry[int(token)].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])],
                         dtype=torch.float64) for out, ids in zip(outputs, sequences)])
        results[name] = {"logprobs": logprobs[:, FIRST_SCORED:], "inspected": inspected}
    return results


def summary(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per OSCAR run: mean |log-prob gap| to "bf16" (overall and per sequence) and perplexity; bf16's perplexity."""
    bf16 = results["bf16"]["logprobs"]
    rows: dict[str, dict[str, Any]] = {"bf16": {"ppl": float(torch.exp(-bf16.mean()))}}
    for name, run in results.items():
        if name != "bf16":
            gap = (run["logprobs"] - bf16).abs()
            rows[name] = {"gap_to_bf16": float(gap.mean()), "gap_per_sequence": gap.mean(dim=1).tolist(),
                          "ppl": float(torch.exp(-run["logprobs"].mean()))}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args()
    from vllm_oscar.models.smollm2 import smollm2_folder

    model = smollm2_folder()
    rows = summary(score(model, heldout(model, args.sequences), engine_configs(), args.dtype))
    for name, row in rows.items():
        extra = (f"mean |gap| to BF16 {row['gap_to_bf16']:.4f} (per sequence "
                 f"{' '.join(f'{g:.4f}' for g in row['gap_per_sequence'])}), " if "gap_to_bf16" in row else "")
        print(f"{name:17s} {extra}ppl {row['ppl']:.4f}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"sequences": args.sequences, "dtype": args.dtype, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
