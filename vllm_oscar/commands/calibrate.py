"""`vllm-oscar calibrate`: make an OSCAR rotation file for a model, or import RotationZoo files.

    vllm-oscar calibrate --model PATH|smollm2 --data FILE [FILE ...] --out FILE
                         [--tokens N] [--seq-len N] [--device cpu|cuda] ...
    vllm-oscar calibrate --import-rotationzoo K.pt V.pt --model PATH --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from vllm_oscar.config import (
    CALIBRATION_TEXT_FRACTION,
    CLIP_RATIO_GRID,
    DEFAULT_CALIBRATION_SEQ_LEN,
    DEFAULT_CALIBRATION_TOKENS,
    DEFAULT_CLIP_RATIO_K,
    DEFAULT_CLIP_SEARCH_SEQUENCES,
    DEFAULT_RECENT_TOKENS,
    DEFAULT_SINK_TOKENS,
    DEFAULT_VALUE_FORM,
    SERVED_REFIT_ITERATIONS,
    VALUE_FORMS,
)

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help='HF model folder, a .gguf file, or "smollm2"')
    parser.add_argument("--out", required=True, help="rotation file to write (.safetensors)")
    parser.add_argument("--data", nargs="+", default=[], metavar="FILE", help="calibration text files (.txt, .xz)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS, help="calibration tokens")
    parser.add_argument("--seq-len", type=int, default=DEFAULT_CALIBRATION_SEQ_LEN, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per forward")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="auto",
                        help="model dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--model-name", default=None, help="name stored in the file (default: folder name)")
    parser.add_argument("--data-fraction", type=float, default=CALIBRATION_TEXT_FRACTION,
                        help="leading fraction of each file used (default: the calibration split; "
                             "the rest is held out for evaluation)")
    parser.add_argument("--per-layer-rotation", action="store_true",
                        help="one rotation per layer instead of per KV head (ablation)")
    parser.add_argument("--no-hadamard", action="store_true", help="R = U . P_br (ablation)")
    parser.add_argument("--no-bit-reversal", action="store_true", help="R = U . H (ablation)")
    parser.add_argument("--value-form", choices=VALUE_FORMS, default=DEFAULT_VALUE_FORM)
    parser.add_argument("--no-clip-search", action="store_true", help="store the reference clip ratios")
    parser.add_argument("--clip-sequences", type=int, default=DEFAULT_CLIP_SEARCH_SEQUENCES,
                        help="calibration sequences kept for the clip search (half select, half judge)")
    parser.add_argument("--clip-grid", type=float, nargs="+", default=list(CLIP_RATIO_GRID))
    parser.add_argument("--clip-grid-k", type=float, nargs="+", default=[DEFAULT_CLIP_RATIO_K], metavar="R",
                        help=f"key-side clip candidates (default: {DEFAULT_CLIP_RATIO_K} fixed; several values "
                             "search among them). The output-error search prefers aggressive key clips that "
                             "cost passkey retrieval (docs/QUALITY.md, 'Passkey and the grid refit')")
    parser.add_argument("--clip-sink", type=int, default=DEFAULT_SINK_TOKENS, help="BF16 sink in the clip search")
    parser.add_argument("--clip-recent", type=int, default=DEFAULT_RECENT_TOKENS,
                        help="BF16 recent window in the clip search")
    parser.add_argument("--clip-refit-iterations", type=int, nargs="+", default=list(SERVED_REFIT_ITERATIONS),
                        metavar="N", help="least-squares grid refit rounds of the quantizer the clip search "
                        "measures, one value or K V; match the served OSCAR option refit_iterations "
                        "(0 = plain min/max)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--import-rotationzoo", nargs=2, metavar=("K_PT", "V_PT"), default=None,
                        help="import published RotationZoo .pt files for --model instead of calibrating")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def _import(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from vllm_oscar.calibration import ModelIdentity, import_rotationzoo, save_rotation_file
    from vllm_oscar.calibration.model_loading import SMOLLM2_ALIAS

    if args.model == SMOLLM2_ALIAS:
        from vllm_oscar.models.smollm2 import smollm2_folder

        source = smollm2_folder()
    else:
        source = Path(args.model)
    kwargs = {"gguf_file": source.name} if source.is_file() else {}
    config = AutoConfig.from_pretrained(source.parent if source.is_file() else source, **kwargs)
    identity = ModelIdentity.from_hf_config(config,
                                            args.model_name or (source.stem if source.is_file() else source.name))
    if not identity.architecture:
        raise ValueError(f"{source}: its config names no architecture; use a model folder with config.json.")
    rotation_set = import_rotationzoo(args.import_rotationzoo[0], args.import_rotationzoo[1], identity)
    path = save_rotation_file(args.out, rotation_set)
    print(f"imported RotationZoo {args.import_rotationzoo[0]} / {args.import_rotationzoo[1]} for "
          f"{identity.describe()} -> {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"vllm-oscar calibrate: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.import_rotationzoo:
        return _import(args)
    if not args.data:
        raise ValueError("--data FILE [FILE ...] is required (or --import-rotationzoo K.pt V.pt).")
    from vllm_oscar.calibration import CalibrationOptions, calibrate, load_model, save_rotation_file

    options = CalibrationOptions(
        num_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size, text_fraction=args.data_fraction,
        per_head=not args.per_layer_rotation, use_hadamard=not args.no_hadamard,
        use_bit_reversal=not args.no_bit_reversal, value_form=args.value_form, clip_search=not args.no_clip_search,
        clip_sequences=args.clip_sequences, clip_grid=tuple(args.clip_grid), clip_sink=args.clip_sink,
        clip_key_grid=tuple(args.clip_grid_k) if args.clip_grid_k else None,
        clip_recent=args.clip_recent,
        clip_refit_iterations=(args.clip_refit_iterations[0] if len(args.clip_refit_iterations) == 1
                               else tuple(args.clip_refit_iterations)), progress=not args.quiet,
    )
    loaded = load_model(args.model, args.device, _DTYPES[args.dtype], args.model_name)
    print(f"model: {loaded.identity.describe()} from {loaded.source}")
    rotation_set = calibrate(loaded, args.data, options)
    path = save_rotation_file(args.out, rotation_set)
    calibration = rotation_set.metadata["calibration"]
    clip_k, clip_v = rotation_set.clip_ratios
    print(f"wrote {path}: {calibration['tokens']} tokens (sha256 {calibration['tokens_sha256'][:16]}...), "
          f"seconds {json.dumps(calibration['seconds'])}")
    print(f"clip ratios K: {sorted(set(clip_k))}  V: {sorted(set(clip_v))}")
    if "heldout_error_sum" in rotation_set.metadata.get("clip_search", {}):
        print(f"held-out attention-output error (sum over layers): "
              f"{json.dumps(rotation_set.metadata['clip_search']['heldout_error_sum'])}")
    return 0
