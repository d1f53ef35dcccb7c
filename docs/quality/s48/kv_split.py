"""Stress-window error of OSCAR (shipped SmolLM2 file, served quantizer) and KIVI-2 with keys and values, keys only or
values only quantized, on the held-out part of one corpus (docs/QUALITY.md, "By kind of text").

    PYTHONPATH=. OMP_NUM_THREADS=1 python docs/quality/s48/kv_split.py node_md            # each method's own windows
    PYTHONPATH=. OMP_NUM_THREADS=1 python docs/quality/s48/kv_split.py node_md --plain    # KIVI-2 without its residual
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_oscar.evaluation.data import heldout_sequences
from vllm_oscar.evaluation.methods import KVMethod
from vllm_oscar.evaluation.runner import Reference, window_metrics
from vllm_oscar.evaluation.variants import Geometry, baseline_method, file_method
from vllm_oscar.models.smollm2 import smollm2_folder


class OneSide(KVMethod):
    """``base`` with only its keys and / or values quantized; ``plain``: the sink / recent windows read exactly,
    whatever else ``base`` keeps exact (KIVI-2's residual key group)."""

    def __init__(self, base: KVMethod, keys: bool, values: bool, plain: bool) -> None:
        self.base, self.keys, self.values, self.plain = base, keys, values, plain
        self.name = f"{base.name}-{'K' if keys else ''}{'V' if values else ''}"

    @property
    def is_exact(self) -> bool:
        return False

    def quantizes_layer(self, layer, num_layers):
        return self.base.quantizes_layer(layer, num_layers)

    def quantize_keys(self, keys, layer):
        return self.base.quantize_keys(keys, layer) if self.keys else keys.float()

    def quantize_values(self, values, layer):
        return self.base.quantize_values(values, layer) if self.values else values.float()

    def exact_mask(self, query_pos, key_pos, sink, recent):
        if self.plain:
            return KVMethod.exact_mask(self, query_pos, key_pos, sink, recent)
        return self.base.exact_mask(query_pos, key_pos, sink, recent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", help="name under ../shared/data/corpora, e.g. node_md")
    parser.add_argument("--plain", action="store_true", help="KIVI-2 only, read with the plain windows")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--recent", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = model.config
    geometry = Geometry(config.num_hidden_layers, config.num_key_value_heads,
                        config.hidden_size // config.num_attention_heads)
    sequences = heldout_sequences(tokenizer, [f"../shared/data/corpora/{args.corpus}.txt.xz"], 1024, args.seqs)
    reference = Reference(model, sequences, args.sink + args.recent, 1)
    kivi = baseline_method("kivi2", geometry)
    bases = [kivi] if args.plain else [file_method("rotations/SmolLM2-135M-Instruct.safetensors"), kivi]
    for base in bases:
        for keys, values in ((True, True), (True, False), (False, True)):
            method = OneSide(base, keys, values, args.plain)
            start = time.time()
            result = window_metrics(model, sequences, reference, method, args.sink, args.recent, 1)
            print(f"{args.corpus} stress {method.name:20s} KL {result['kld']:.4f} ppl {result['ppl']:.3f} "
                  f"top1 {result['top1']:.3f} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
