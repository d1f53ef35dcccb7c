"""Would an int8 query cost accuracy in the decode kernel's key path? (docs/decisions.md, lead 4.)

An int8 MMA for the K side would take the 2-bit codes as int8 (one LOP3 per 4 codes instead
of LOP3 + 2 PRMT per 4) but needs the rotated query as int8 too. This script measures, on
real SmolLM2-135M-Instruct activations (held-out Brown text), the attention-output error
that a per-row absmax int8 query adds, next to the error of bf16 queries (what the kernel
does now) and the error of the INT2 keys themselves (the served key quantizer: the shipped
rotation file's key rotation and clip, floored grid refit). Values stay exact, every query
attends causally to every earlier key (no BF16 windows), so only the key path is measured.

    python3 scripts/int8_query_error.py --seqs 2 --seq-len 1024 --threads 2

Prints, per layer and overall: relative L2 error of the attention output of
  q_bf16 vs q_fp32 (keys INT2), q_int8 vs q_fp32 (keys INT2), INT2 keys vs exact keys (q fp32).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from vllm_oscar.calibration.capture import capture_attention  # noqa: E402
from vllm_oscar.calibration.data import read_text, split_corpus_text  # noqa: E402
from vllm_oscar.calibration.files import load_rotation_file  # noqa: E402
from vllm_oscar.calibration.model_loading import load_model  # noqa: E402
from vllm_oscar.config import GRID_REFIT_ITERATIONS, REFIT_SCALE_FLOOR  # noqa: E402
from vllm_oscar.quant import fake_quantize  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROTATIONS = os.path.join(HERE, "..", "rotations", "SmolLM2-135M-Instruct.safetensors")
CORPUS = os.path.join(HERE, "..", "..", "shared", "data", "corpora", "brown.txt.xz")
INT8_MAX = 127.0


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric absmax int8 fake quantization of [..., D] (round to nearest)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / INT8_MAX
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX) * scale


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [Hq, T, D], k/v [Hkv, T, D] float64 -> [Hq, T, D] (GQA by head repetition)."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    logits = q @ k.transpose(-1, -2) * scaling
    t = q.shape[1]
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2")
    rotations = load_rotation_file(ROTATIONS)
    _, heldout = split_corpus_text(read_text(CORPUS))
    ids = loaded.tokenizer(heldout)["input_ids"][: args.seqs * args.seq_len]
    batch = torch.tensor(ids).reshape(args.seqs, args.seq_len)
    sums = {"bf16": [0.0, 0.0], "int8": [0.0, 0.0], "int2": [0.0, 0.0]}
    per_layer: dict[int, dict[str, float]] = {}

    def on_layer(layer: int, query, key, value, output, scaling: float) -> None:
        rot = rotations.layers[layer]
        r = rot.k_rotation.double()  # [Hkv, D, D]
        group = query.shape[1] // key.shape[1]
        errors = {name: [] for name in sums}
        for b in range(query.shape[0]):
            k_rot = torch.einsum("htd,hde->hte", key[b].double(), r)
            q_rot = torch.einsum("htd,hde->hte", query[b].double(), r.repeat_interleave(group, dim=0))
            k_int2 = fake_quantize(k_rot.float(), rot.clip_k, k_rot.shape[-1], refit_iterations=GRID_REFIT_ITERATIONS,
                                   refit_floor=REFIT_SCALE_FLOOR[0]).double()
            v = value[b].double()
            ref = causal_attention(q_rot, k_int2, v, scaling)
            exact = causal_attention(q_rot, k_rot, v, scaling)
            bf16 = causal_attention(q_rot.to(torch.bfloat16).double(), k_int2, v, scaling)
            int8 = causal_attention(int8_rows(q_rot), k_int2, v, scaling)
            for name, got, want in (("bf16", bf16, ref), ("int8", int8, ref), ("int2", ref, exact)):
                sums[name][0] += float((got - want).norm() ** 2)
                sums[name][1] += float(want.norm() ** 2)
                errors[name].append(rel(got, want))
        per_layer[layer] = {name: sum(e) / len(e) for name, e in errors.items()}

    with torch.no_grad(), capture_attention(loaded.model, on_layer):
        loaded.model(batch)
    print(f"{'layer':>5} {'bf16 q':>10} {'int8 q':>10} {'INT2 keys':>10}")
    for layer in sorted(per_layer):
        e = per_layer[layer]
        print(f"{layer:>5} {e['bf16']:10.2e} {e['int8']:10.2e} {e['int2']:10.2e}")
    total = {name: (s[0] / s[1]) ** 0.5 for name, s in sums.items()}
    print(f"{'all':>5} {total['bf16']:10.2e} {total['int8']:10.2e} {total['int2']:10.2e}")
    print(f"int8 / bf16 query error: {total['int8'] / total['bf16']:.1f}x; "
          f"int8 query error / INT2 key error: {total['int8'] / total['int2']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
