"""Issue 6 sweep: which part of the served quantizer loses the passkey needle, and what it
costs in KL. For each configuration (the shipped SmolLM2 rotations with per-side clip
ratios and refit rounds), held-out KL / ppl (vllm-oscar eval's window_metrics, BF16
reference once) and 2048-token passkey trials (evaluation.retrieval.passkey_cases, depths
spread evenly over 0.05..0.95, one key per depth from seed 0).

    python3 scripts/refit_passkey_sweep.py --configs served vrefit --depths 20 \
        --json out/passkey_cpu/sweep_a.json --threads 1

Configuration syntax: an eval rotation-file method (oscar-file = as served), NAME or LABEL:key=value,... with
keys kclip, vclip (float or "file"), refit (K/V rounds, e.g. 0/4), kfloor (1: the key refit may not narrow the grid
below the clipped min/max scale, quant.refit_grid(scale_floor=True), as now served). NAME is one of PRESETS.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PRESETS = {
    "served": "kclip=file,vclip=file,refit=4/4",
    "minmax": "kclip=file,vclip=file,refit=0/0",
    "vrefit": "kclip=file,vclip=file,refit=0/4",
    "krefit": "kclip=file,vclip=file,refit=4/0",
    "k96-vrefit": "kclip=0.96,vclip=file,refit=0/4",
    "k100-vrefit": "kclip=1.0,vclip=file,refit=0/4",
    "k96-refit": "kclip=0.96,vclip=file,refit=4/4",
    "k100-refit": "kclip=1.0,vclip=file,refit=4/4",
    "k96v92-minmax": "kclip=0.96,vclip=0.92,refit=0/0",
    "k90-vrefit": "kclip=0.90,vclip=file,refit=0/4",
    "k92-vrefit": "kclip=0.92,vclip=file,refit=0/4",
    "k94-vrefit": "kclip=0.94,vclip=file,refit=0/4",
    "k96-r1": "kclip=0.96,vclip=file,refit=1/4",
    "r1": "kclip=file,vclip=file,refit=1/1",
    "r2": "kclip=file,vclip=file,refit=2/2",
    "kfloor": "kclip=file,vclip=file,refit=4/4,kfloor=1",
    "k96-kfloor": "kclip=0.96,vclip=file,refit=4/4,kfloor=1",
    "k100-kfloor": "kclip=1.0,vclip=file,refit=4/4,kfloor=1",
    "k92-kfloor": "kclip=0.92,vclip=file,refit=4/4,kfloor=1",
}


def parse(spec: str) -> tuple[str, dict]:
    label, _, body = spec.partition(":")
    if label == "bf16" or label.startswith("oscar-file"):
        return label, {}
    if not body:
        body = PRESETS[label]
    opts = dict(item.split("=") for item in body.split(","))
    return label, opts


def build(label: str, opts: dict, rotations: str):
    import dataclasses

    from vllm_oscar.calibration.files import load_rotation_file
    from vllm_oscar.evaluation.methods import RowMethod
    from vllm_oscar.evaluation.variants import _layers_from

    layers = _layers_from(load_rotation_file(rotations))
    kclip, vclip = opts.get("kclip", "file"), opts.get("vclip", "file")
    layers = [dataclasses.replace(
        spec, clip_k=spec.clip_k if kclip == "file" else float(kclip),
        clip_v=spec.clip_v if vclip == "file" else float(vclip)
    ) for spec in layers]
    rk, rv = (int(x) for x in opts.get("refit", "4/4").split("/"))
    description = f"file rotations, clip K {layers[0].clip_k} / V {layers[0].clip_v}, refit K {rk} / V {rv}"
    key_floor = opts.get("kfloor") == "1"
    if key_floor:
        description += ", key refit scale >= clipped min/max scale"
    return RowMethod(label, description, layers, refit_iterations=(rk, rv), refit_floor=(key_floor, False))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--depths", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kl-seq-len", type=int, default=1024)
    parser.add_argument("--kl-num-seqs", type=int, default=2)
    parser.add_argument("--data", default="../shared/data/corpora/brown.txt.xz")
    parser.add_argument("--rotations", default="rotations/SmolLM2-135M-Instruct.safetensors")
    parser.add_argument("--json", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_oscar.config import DEFAULT_RECENT_TOKENS as RECENT
    from vllm_oscar.config import DEFAULT_SINK_TOKENS as SINK
    from vllm_oscar.evaluation.data import heldout_sequences
    from vllm_oscar.evaluation.harness import method_logits
    from vllm_oscar.evaluation.methods import KVMethod
    from vllm_oscar.evaluation.retrieval import passkey_cases, passkey_correct
    from vllm_oscar.evaluation.runner import Reference, window_metrics
    from vllm_oscar.evaluation.variants import FILE_METHODS, file_method
    from vllm_oscar.models.smollm2 import smollm2_folder

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    count = args.depths
    depths = [round(0.05 + 0.9 * i / (count - 1), 4) for i in range(count)] if count > 1 else [0.5]
    cases = passkey_cases(tokenizer, [args.length], depths, args.seed)
    sequences = heldout_sequences(tokenizer, [args.data], args.kl_seq_len, args.kl_num_seqs)
    reference = Reference(model, sequences, SINK + RECENT, 1)
    out = Path(args.json)
    doc = {"settings": {k: v for k, v in vars(args).items()}, "depths": depths, "configs": {}}
    for spec in args.configs:
        label, opts = parse(spec)
        if label == "bf16":
            method = KVMethod()
        elif label in FILE_METHODS:  # the eval's rotation-file methods (oscar-file = as served)
            method = file_method(args.rotations, label)
        else:
            method = build(label, opts, args.rotations)
        row = doc["configs"].setdefault(label, {"spec": opts if label != "bf16" else {},
                                                "description": method.description})
        clock = time.time()
        row.update(window_metrics(model, sequences, reference, method, SINK, RECENT, 1))
        row["seconds_kl"] = round(time.time() - clock, 1)
        print(f"{label:16s} KL {row['kld']:.4f} ppl {row['ppl']:.3f} ({row['seconds_kl']} s)", flush=True)
        row["trials"] = []
        for case in cases:
            clock = time.time()
            keep = len(case.input_ids) - case.answer_start + 1
            logits = method_logits(model, case.input_ids[None], method, SINK, RECENT, keep=keep)[0]
            hit = passkey_correct(logits, case)
            answer_logits = logits[-keep:-1]
            answer = case.input_ids[case.answer_start:]
            predicted_ids = answer_logits.argmax(-1)
            predicted = tokenizer.decode(predicted_ids.tolist())
            # The first answer token is " " (digits follow one per token): its log-prob
            # margin over the best other token, and whether the digits (teacher-forced
            # after the true first token) are all right.
            first = torch.log_softmax(answer_logits[0], dim=-1)
            other = first.clone()
            other[answer[0]] = float("-inf")
            margin = float(first[answer[0]] - other.max())
            digits_ok = bool(torch.equal(predicted_ids[1:], answer[1:]))
            row["trials"].append({"depth": case.depth, "key": case.key, "hit": hit, "predicted": predicted,
                                  "first_margin": round(margin, 3), "digits_ok": digits_ok,
                                  "first_top": tokenizer.decode([int(other.argmax())]),
                                  "seconds": round(time.time() - clock, 1)})
            row["hits"], row["n"] = sum(t["hit"] for t in row["trials"]), len(row["trials"])
            row["digits_ok"] = sum(t["digits_ok"] for t in row["trials"])
            row["mean_first_margin"] = round(sum(t["first_margin"] for t in row["trials"]) / row["n"], 3)
            print(f"{label:16s} depth {case.depth:.3f} hit {int(hit)} margin {margin:+.2f} digits {int(digits_ok)} "
                  f"{row['trials'][-1]['seconds']:5.1f} s ({row['hits']}/{row['n']}) {predicted!r}", flush=True)
            out.write_text(json.dumps(doc, indent=1))
        out.write_text(json.dumps(doc, indent=1))
    for label, row in doc["configs"].items():
        print(f"{label:16s} KL {row['kld']:.4f} ppl {row['ppl']:.3f} passkey {row.get('hits')}/{row.get('n')} "
              f"digits {row.get('digits_ok')}/{row.get('n')} mean first-token margin {row.get('mean_first_margin')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
