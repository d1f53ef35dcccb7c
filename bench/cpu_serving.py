"""Prompt and decode speed of vLLM's CPU build with OSCAR's KV cache against its default (BF16) cache, SmolLM2-135M.

Each backend runs in its own process (one engine each, eager, no prefix caching). Per prompt length N: the time of a
fresh N-token prompt with one output token (prompt speed, tokens/s), and of another fresh N-token prompt with
DECODE_TOKENS + 1 output tokens, whose difference per token is the decode step. Best of REPEATS. Prints a table and
writes JSON:

    python bench/cpu_serving.py --json cpu_serving.json [--lengths 512 2048]
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import subprocess
import sys
import time
from pathlib import Path

#: Output tokens of the decode measurement (after the first), and timing repeats (best kept).
DECODE_TOKENS = 64
REPEATS = 2
#: Text the prompts are cut from (held-out part of the Brown corpus).
CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "corpora" / "brown.txt.xz"
BACKENDS = ("bf16", "oscar")


def _worker(backend: str, lengths: list[int]) -> None:
    """Runs in a subprocess: one engine, one JSON line per prompt length on stdout."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from vllm_oscar.models.smollm2 import smollm2_folder

    extra = {"kv_cache_dtype": "oscar"} if backend == "oscar" else {}
    llm = LLM(str(smollm2_folder()), dtype="bfloat16", max_model_len=max(lengths) + DECODE_TOKENS + 8,
              max_num_seqs=1, enforce_eager=True, enable_prefix_caching=False, seed=0, **extra)
    text = lzma.open(CORPUS, "rt", encoding="utf-8").read()
    ids = llm.get_tokenizer().encode(text[len(text) * 4 // 5:])
    llm.generate([{"prompt_token_ids": ids[:32]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    offset = 32
    for length in lengths:
        prompt_s, total_s = float("inf"), float("inf")
        for _ in range(REPEATS):
            for tokens in (1, DECODE_TOKENS + 1):
                prompt = {"prompt_token_ids": ids[offset:offset + length]}
                offset += length
                start = time.perf_counter()
                llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
                             use_tqdm=False)
                seconds = time.perf_counter() - start
                if tokens == 1:
                    prompt_s = min(prompt_s, seconds)
                else:
                    total_s = min(total_s, seconds)
        print("RESULT " + json.dumps({"backend": backend, "prompt_tokens": length,
                                      "prompt_tokens_per_s": length / prompt_s,
                                      "decode_ms_per_token": (total_s - prompt_s) / DECODE_TOKENS * 1e3}),
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.lengths)
        return 0
    rows = []
    for backend in BACKENDS:
        done = subprocess.run([sys.executable, __file__, "--worker", backend, "--lengths", *map(str, args.lengths)],
                              capture_output=True, text=True, check=False)
        found = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or len(found) != len(args.lengths):
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"the {backend} engine failed (exit status {done.returncode}).")
        rows += found
    by = {(r["backend"], r["prompt_tokens"]): r for r in rows}
    print("| prompt tokens | BF16 prompt tok/s | OSCAR prompt tok/s | BF16 decode ms/token | OSCAR decode ms/token |")
    print("|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        bf16, oscar = by[("bf16", length)], by[("oscar", length)]
        print(f"| {length} | {bf16['prompt_tokens_per_s']:.0f} | {oscar['prompt_tokens_per_s']:.0f} | "
              f"{bf16['decode_ms_per_token']:.1f} | {oscar['decode_ms_per_token']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
