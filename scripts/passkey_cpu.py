"""Passkey trials on CPU for rotation-file variants (issue 6): one 2048-token haystack per
depth, the same builder as `vllm-oscar eval` (evaluation.retrieval.passkey_cases).

    python3 scripts/passkey_cpu.py --methods oscar-file oscar-file-minmax --depths 20 --json out/x.json

Prints one line per trial (method, depth, key, hit, seconds) and writes the JSON after
every trial. Methods are any name of evaluation.variants (baselines, file methods).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", nargs="+", required=True)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--depths", type=int, default=20, help="depths spread evenly over 0.05..0.95")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rotations", default="rotations/SmolLM2-135M-Instruct.safetensors")
    parser.add_argument("--json", required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
    from vllm_oscar.evaluation.harness import method_logits
    from vllm_oscar.evaluation.retrieval import passkey_cases, passkey_correct
    from vllm_oscar.evaluation.runner import EvalSettings, build_methods
    from vllm_oscar.evaluation.variants import Geometry
    from vllm_oscar.models.smollm2 import smollm2_folder

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    cfg = model.config
    geometry = Geometry(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    settings = EvalSettings(model=str(folder), data=[], rotations=args.rotations)
    methods, _ = build_methods(args.methods, settings, model, tokenizer, geometry)
    count = args.depths
    depths = [round(0.05 + 0.9 * i / (count - 1), 4) for i in range(count)] if count > 1 else [0.5]
    cases = passkey_cases(tokenizer, [args.length], depths, args.seed)
    out = Path(args.json)
    doc = {"length": args.length, "depths": depths, "seed": args.seed, "rotations": args.rotations,
           "threads": torch.get_num_threads(), "methods": {}}
    for name, method in methods.items():
        rows = doc["methods"].setdefault(name, {"trials": [], "description": method.description})
        for case in cases:
            clock = time.time()
            keep = len(case.input_ids) - case.answer_start + 1
            if args.profile:
                with torch.profiler.profile() as prof:
                    logits = method_logits(model, case.input_ids[None], method, DEFAULT_SINK_TOKENS,
                                           DEFAULT_RECENT_TOKENS, keep=keep)[0]
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
            else:
                logits = method_logits(model, case.input_ids[None], method, DEFAULT_SINK_TOKENS,
                                       DEFAULT_RECENT_TOKENS, keep=keep)[0]
            hit = passkey_correct(logits, case)
            seconds = time.time() - clock
            predicted = logits[-keep:-1].argmax(-1).tolist()
            rows["trials"].append({"depth": case.depth, "key": case.key, "hit": hit, "seconds": round(seconds, 1),
                                   "predicted": tokenizer.decode(predicted)})
            rows["hits"] = sum(t["hit"] for t in rows["trials"])
            rows["n"] = len(rows["trials"])
            print(f"{name:28s} depth {case.depth:.3f} key {case.key} hit {int(hit)} {seconds:6.1f} s "
                  f"({rows['hits']}/{rows['n']}) -> {tokenizer.decode(predicted)!r}", flush=True)
            out.write_text(json.dumps(doc, indent=1))
    for name, rows in doc["methods"].items():
        print(f"{name:28s} {rows['hits']}/{rows['n']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
