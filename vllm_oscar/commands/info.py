"""`vllm-oscar info FILE`: a readable summary of a rotation file (validated on load)."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="rotation file (.safetensors written by `vllm-oscar calibrate`)")
    parser.add_argument("--layers", action="store_true", help="one line per layer")


def _spectrum_share(eigenvalues: torch.Tensor, top: int) -> float:
    """Mean over heads of the share of the top eigenvalues in the trace."""
    total = eigenvalues.sum(-1).clamp(min=torch.finfo(torch.float64).tiny)
    return float((eigenvalues[..., :top].sum(-1) / total).mean())


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"vllm-oscar info: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from vllm_oscar.calibration import load_rotation_file, read_rotation_metadata
    from vllm_oscar.quant.rotation import orthogonality_error

    metadata = read_rotation_metadata(args.file)
    rotation_set = load_rotation_file(args.file)
    ident = rotation_set.identity
    extra = rotation_set.metadata
    print(f"file:       {args.file}")
    print(f"format:     {metadata['format']} v{metadata['format_version']} "
          f"(vllm_oscar {metadata.get('package_version')})")
    print(f"model:      {ident.describe()}")
    print(f"weights:    sha256 {ident.weights_sha256 or 'unknown'}")
    print(f"method:     {json.dumps(extra.get('method', {}), sort_keys=True)}")
    calibration = extra.get("calibration", {})
    if "tokens_sha256" in calibration:
        print(f"data:       {calibration.get('tokens')} tokens in {calibration.get('sequences')} x "
              f"{calibration.get('seq_len')}, tokens sha256 {calibration.get('tokens_sha256')}")
        for source in calibration.get("data", []):
            print(f"            {source['file']} (sha256 {source['sha256'][:16]}..., {source['sequences']} seqs, "
                  f"first {source['characters']} chars of the first {source['text_fraction']:.0%})")
        print(f"run:        {calibration.get('device')}, {calibration.get('model_dtype')}, seconds "
              f"{json.dumps(calibration.get('seconds', {}))}")
    clip_k, clip_v = rotation_set.clip_ratios
    search = extra.get("clip_search", {})
    print(f"clip K:     {sorted(set(clip_k))}   clip V: {sorted(set(clip_v))}")
    if "heldout_error_sum" in search:
        print(f"clip search: per_layer={search['use_per_layer']}, held-out output error "
              f"{json.dumps(search['heldout_error_sum'])}, windows {search['sink']}/{search['recent']}, "
              f"grid refit rounds {search.get('refit_iterations', 0)} (files without the key: 0, plain min/max)")
    elif search:
        print(f"clip search: {json.dumps(search)}")
    worst = max(max(orthogonality_error(l.k_rotation.double()), orthogonality_error(l.v_rotation.double()))
                for l in rotation_set.layers)
    print(f"orthogonality: max|R^T R - I| = {worst:.2e}")
    if args.layers:
        top = max(1, ident.head_dim // 8)
        print(f"{'layer':>5} {'clip_k':>7} {'clip_v':>7} {f'K top-{top} share':>15} {f'V top-{top} share':>15}")
        for index, layer in enumerate(rotation_set.layers):
            print(f"{index:>5} {layer.clip_k:>7.3f} {layer.clip_v:>7.3f} "
                  f"{_spectrum_share(layer.k_eigenvalues, top):>15.3f} "
                  f"{_spectrum_share(layer.v_eigenvalues, top):>15.3f}")
    return 0
