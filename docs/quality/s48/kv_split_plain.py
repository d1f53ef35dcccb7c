"""Markdown stress gap: OSCAR vs KIVI-2 with only keys or only values quantized (scratch diagnostic)."""
import sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_oscar.evaluation.methods import KVMethod
from vllm_oscar.evaluation.runner import Reference, window_metrics
from vllm_oscar.evaluation.variants import Geometry, baseline_method, file_method
from vllm_oscar.evaluation.data import heldout_sequences

class Half(KVMethod):
    def __init__(self, base, keys, values):
        self.base, self.keys, self.values = base, keys, values
        self.name = f"{base.name}-{'K' if keys else ''}{'V' if values else ''}"
    @property
    def is_exact(self): return False
    def quantizes_layer(self, layer, n): return self.base.quantizes_layer(layer, n)
    def quantize_keys(self, k, layer): return self.base.quantize_keys(k, layer) if self.keys else k.float()
    def quantize_values(self, v, layer): return self.base.quantize_values(v, layer) if self.values else v.float()
    def exact_mask(self, q, k, s, r): return KVMethod.exact_mask(self, q, k, s, r) if PLAIN else self.base.exact_mask(q, k, s, r)

PLAIN = len(sys.argv) > 3
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
model_path = "/root/.cache/vllm_oscar/SmolLM2-135M-Instruct"
tok = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa").eval()
c = model.config
geo = Geometry(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
seqs = heldout_sequences(tok, [f"../shared/data/corpora/{sys.argv[1]}.txt.xz"], 1024, 4)
ref = Reference(model, seqs, 20, 1)
oscar = file_method("rotations/SmolLM2-135M-Instruct.safetensors")
kivi = baseline_method("kivi2", geo)
for base in (kivi,):
    for keys, values in ((True, True), (True, False)):
        m = Half(base, keys, values); t = time.time()
        r = window_metrics(model, seqs, ref, m, 4, 16, 1)
        print(f"{sys.argv[1]} stress {m.name:20s} KL {r['kld']:.4f} ppl {r['ppl']:.3f} top1 {r['top1']:.3f} ({time.time()-t:.0f} s)", flush=True)
