"""`vllm-oscar eval` end to end on a tiny random Llama with a tokenizer trained in the test:
every method runs, the JSON/markdown/PNG are written, bits are exact, BF16 is the reference."""

from __future__ import annotations

import json
import random

import pytest
import torch

from vllm_oscar.cli import main

HEAD_DIM, LAYERS = 16, 5
SEQ_LEN, SINK, RECENT = 64, 4, 8


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("eval")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(150)]
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(4000))
    (root / "corpus.txt").write_text(text)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(root / "model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=fast.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512,
        eos_token_id=1, pad_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(root / "model")
    return root


#: Every kind of method once (the rest are the same classes with other options: test_eval_variants).
METHODS = ["bf16", "int2-quarot", "kivi2", "turboquant_3bit_nc", "oscar-head", "oscar-head-best", "oscar-file"]


@pytest.fixture(scope="module")
def rotation_file(workdir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_oscar.calibration.data import calibration_tokens
    from vllm_oscar.calibration.files import save_rotation_file
    from vllm_oscar.calibration.rotations import build_rotations
    from vllm_oscar.calibration.statistics import collect_statistics

    model = AutoModelForCausalLM.from_pretrained(workdir / "model").eval()
    tokens = calibration_tokens(AutoTokenizer.from_pretrained(workdir / "model"), [str(workdir / "corpus.txt")],
                                128, 64)
    rotations = build_rotations(collect_statistics(model, tokens.tokens, progress=False), clip_k=0.9, clip_v=0.9)
    return save_rotation_file(workdir / "rotations.safetensors", rotations)


def test_eval_runs_and_reports_exact_bits(workdir, rotation_file) -> None:
    out = workdir / "result.json"
    argv = [
        "eval", "--model", str(workdir / "model"), "--data", str(workdir / "corpus.txt"), "--json", str(out),
        "--rotations", str(rotation_file), "--methods", *METHODS,
        "--seq-len", str(SEQ_LEN), "--num-seqs", "2", "--sink", str(SINK), "--recent", str(RECENT), "--stress",
        "--calib-tokens", "256", "--calib-seq-len", "64", "--clip-sequences", "2",
        "--passkey", "200", "--greedy-prompts", "1", "--greedy-new-tokens", "4",
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().count("\n|") == 1 + len(METHODS)  # header rule + one row each
    assert out.with_suffix(".png").stat().st_size > 10_000
    methods = doc["methods"]
    assert list(methods) == METHODS
    bf16 = methods["bf16"]
    assert bf16["kld"] == pytest.approx(0.0, abs=1e-9) and bf16["top1"] == 1.0 and bf16["bpe"] == 16.0
    scored = 2 * (SEQ_LEN - 1 - (SINK + RECENT))
    for name, m in methods.items():
        assert m["tokens"] == scored and m["stress"]["tokens"] == 2 * (SEQ_LEN - 1 - 4 - 16)
        assert set(m["passkey"]) == {"200"} and 0 <= m["greedy_prefix"] <= 4
        if name != "bf16":
            assert m["kld"] > 0 and m["ppl"] > 0
    # D = 16, fp16 scale and offset per row: 2 + 32/16 bits; KIVI: G = 32 tokens, 16-channel value groups.
    assert methods["oscar-head"]["body_bits"] == 4.0
    assert methods["kivi2"]["body_bits"] == pytest.approx(0.5 * ((2 + 32 / 32) + (2 + 32 / 16)))
    assert methods["turboquant_3bit_nc"]["body_bits"] == pytest.approx(0.5 * ((3 + 1) + (3 + 2)))
    window = SINK + RECENT
    assert methods["oscar-head"]["bpe"] == pytest.approx((4.0 * (SEQ_LEN - window) + 16 * window) / SEQ_LEN)
    # TurboQuant keeps the first and last 2 layers in BF16: of 5 layers only layer 2 is quantized.
    tq_layer = (4.5 * (SEQ_LEN - window) + 16 * window) / SEQ_LEN
    assert methods["turboquant_3bit_nc"]["bpe"] == pytest.approx((tq_layer + 4 * 16) / 5)
    assert doc["settings"]["seq_len"] == SEQ_LEN and doc["meta"]["geometry"]["head_dim"] == HEAD_DIM


def test_eval_batches_subsets_and_time_budget(workdir, rotation_file) -> None:
    """--batch-size 2 gives the batch-1 numbers; passkey/greedy run only for the methods
    asked; a spent --max-seconds still writes a JSON and table listing what was skipped."""
    common = [
        "--model", str(workdir / "model"), "--data", str(workdir / "corpus.txt"),
        "--seq-len", str(SEQ_LEN), "--num-seqs", "2", "--sink", str(SINK), "--recent", str(RECENT),
    ]
    one, two = workdir / "batch1.json", workdir / "batch2.json"
    assert main(["eval", *common, "--json", str(one), "--methods", "bf16", "kivi2", "int2-quarot"]) == 0
    assert main([
        "eval", *common, "--json", str(two), "--methods", "bf16", "kivi2", "int2-quarot", "--batch-size", "2",
        "--passkey", "200", "--passkey-methods", "bf16", "kivi2", "--greedy-prompts", "1", "--greedy-new-tokens", "3",
        "--greedy-methods", "int2-quarot",
    ]) == 0
    a, b = json.loads(one.read_text())["methods"], json.loads(two.read_text())["methods"]
    for name in a:
        assert b[name]["kld"] == pytest.approx(a[name]["kld"], rel=1e-3, abs=1e-7)
        assert b[name]["ppl"] == pytest.approx(a[name]["ppl"], rel=1e-4)
        assert "metrics" in b[name]["seconds"]
    assert [n for n in b if "passkey" in b[n]] == ["bf16", "kivi2"]
    assert [n for n in b if "greedy_prefix" in b[n]] == ["int2-quarot"]

    late = workdir / "late.json"
    assert main(["eval", *common, "--json", str(late), "--methods", "bf16", "kivi2", "--max-seconds", "0"]) == 0
    doc = json.loads(late.read_text())
    assert doc["meta"]["skipped"] == ["metrics:bf16", "metrics:kivi2"]
    assert "Not run (time budget)" in late.with_suffix(".md").read_text()
