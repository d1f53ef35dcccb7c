"""The named methods of the evaluation table, built for one model.

Baselines need only the model's geometry. OSCAR variants need calibration statistics
(vllm_oscar.calibration.collect_statistics on calibration text) or a rotation file.

Names (``--methods``):
    bf16                 unquantized K/V
    int2-naive           per-token INT2, one fp16 (scale, offset) per row, no rotation
    int2-quarot          QuaRot: Hadamard rotation, then the same INT2
    int2-hadamard-clip   Hadamard + the reference clip ratios (0.96 / 0.92)
    kivi2                KIVI-2, group 32
    turboquant_4bit_nc / turboquant_3bit_nc   vLLM's TurboQuant presets
    oscar-file           OSCAR from --rotations FILE as the vLLM backend serves it with default
                         options: the file's rotations and clip ratios, and the write quantizer of
                         OscarConfig (least-squares grid refit, refit_iterations = 4)
                         (since issue 6: keys floored, config.REFIT_SCALE_FLOOR)
    oscar-file-refit     ... with the free refit on K and V (no floor)
    oscar-file-minmax    ... with the plain clipped min/max grid on K and V (refit_iterations = 0)
    oscar-file-vrefit    ... min/max keys, refit values (refit_iterations = (0, 4))
    oscar-file-krefit    ... free key refit, min/max values ((4, 0))
    oscar-file-k84-refit   ... key clip 0.84 instead of the file's, free refit on K and V (the
                         quantizer served before issue 6; the file then stored V clip 1.0)
    oscar-file-k84-minmax  ... key clip 0.84, min/max grid (the served default before the refit)
    oscar-file-r1 / -r2 / -r3  ... the served quantizer (file clips, keys floored) with 1 / 2 / 3
                         refit rounds on K and V instead of 4 (fewer rounds: a cheaper write kernel)
    oscar-file-k1v2 / -k4v2 / -k4v1 / -k4v0  ... the same with 1 key / 2 value rounds, or 4 key
                         rounds and 2 / 1 / 0 (min/max) value rounds
    oscar-file-k6v2 / -k8v2 / -k8v4 / -k12v2  ... the same with more key rounds than served
                         (6 / 8 / 8 / 12 key, 2 / 2 / 4 / 2 value rounds)
    oscar-head           OSCAR as published: per-head R = U.H.P_br, paper value form, 0.96 / 0.92
    oscar-head-vlogit    ... reference-code value form (logit-energy weighted)
    oscar-layer          ... one rotation per layer (head-averaged targets)
    oscar-head-noH       ... without the Hadamard factor (ablation)
    oscar-head-lm        ... Lloyd-Max levels on every write (K and V)
    oscar-head-clip      ... clip ratios searched per model / per layer (calibration.search_clip_ratios)
    oscar-head-center    ... calibrated per-(layer, head) K/V means removed before quantization
    oscar-head-refit     ... least-squares (scale, offset) refit per row (quant.quantize_rows)
    oscar-head-center-refit  ... centering + refit (reference clip ratios as the starting grid)
    oscar-head-best      ... clip search + centering + refit
    int2-hadamard-refit  Hadamard + refit (is the gain the basis or the quantizer?)
    int2-hadamard-served Hadamard + the quantizer the backend serves (clips 0.96 / 0.92, floored
                         key refit, SERVED_REFIT_ITERATIONS): what the calibrated basis buys as served
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from vllm_oscar.config import (
    DEFAULT_CLIP_RATIO_K,
    DEFAULT_CLIP_RATIO_V,
    GRID_REFIT_ITERATIONS,
    KIVI_GROUP_SIZE,
    REFIT_SCALE_FLOOR,
    SERVED_REFIT_ITERATIONS,
    TURBOQUANT_PRESETS,
    VALUE_FORM_LOGIT_ENERGY,
    VALUE_FORM_OUTPUT,
    OscarConfig,
    refit_pair,
)
from vllm_oscar.evaluation.baselines import KiviMethod, TurboQuantMethod
from vllm_oscar.evaluation.methods import (
    KVMethod,
    LayerRotations,
    RowMethod,
    hadamard_layers,
    identity_layers,
)

BASELINES = (
    "bf16", "int2-naive", "int2-quarot", "int2-hadamard-clip", "int2-hadamard-refit", "int2-hadamard-served", "kivi2",
    *TURBOQUANT_PRESETS,
)
OSCAR_VARIANTS = (
    "oscar-head", "oscar-head-vlogit", "oscar-layer", "oscar-head-noH", "oscar-head-lm",
    "oscar-head-clip", "oscar-head-center", "oscar-head-refit", "oscar-head-center-refit", "oscar-head-best",
)
#: Rotation-file methods: name -> (refit rounds (K, V), or None = OscarConfig's default;
#: refit floors (K, V), or None = the served config.REFIT_SCALE_FLOOR; key clip ratio
#: overriding the file's, or None; what it is). Issue 6 (docs/QUALITY.md, "Passkey and the
#: grid refit"): which side's refit, which floor and which key clip cost retrieval; -r1/-r2/-r3/
#: -k1v2/-k4v2/-k4v1/-k4v0/-k6v2/-k8v2/-k8v4/-k12v2: how many refit rounds the served quantizer
#: needs (docs/notes/quality.md).
_FREE = (False, False)
_R = GRID_REFIT_ITERATIONS
FILE_VARIANTS: dict[str, tuple[Optional[tuple[int, int]], Optional[tuple[bool, bool]], Optional[float], str]] = {
    "oscar-file": (None, None, None, "as served by default"),
    "oscar-file-refit": ((_R, _R), _FREE, None, "free refit on K and V"),
    "oscar-file-minmax": ((0, 0), _FREE, None, "clipped min/max grid on K and V"),
    "oscar-file-vrefit": ((0, _R), _FREE, None, "min/max keys, refit values"),
    "oscar-file-krefit": ((_R, 0), _FREE, None, "free key refit, min/max values"),
    "oscar-file-k84-refit": ((_R, _R), _FREE, 0.84,
                             "key clip 0.84, free refit on K and V: the quantizer served before issue 6 "
                             "(its file: V clip 1.0)"),
    "oscar-file-k84-minmax": ((0, 0), _FREE, 0.84, "key clip 0.84, min/max grid: the default before the refit"),
    # Fewer refit rounds than served (the write kernel's cost grows with them); floors and
    # clips as served (None), only the rounds differ.
    "oscar-file-r1": ((1, 1), None, None, "served quantizer with 1 refit round on K and V"),
    "oscar-file-r2": ((2, 2), None, None, "served quantizer with 2 refit rounds on K and V"),
    "oscar-file-r3": ((3, 3), None, None, "served quantizer with 3 refit rounds on K and V"),
    "oscar-file-k1v2": ((1, 2), None, None, "served quantizer with 1 key / 2 value refit rounds"),
    "oscar-file-k4v2": ((4, 2), None, None, "served quantizer with 4 key / 2 value refit rounds"),
    "oscar-file-k4v1": ((4, 1), None, None, "served quantizer with 4 key / 1 value refit rounds"),
    "oscar-file-k4v0": ((4, 0), None, None, "served quantizer with 4 key refit rounds, min/max values"),
    # More key rounds than served (is the floored key refit converged at 4?).
    "oscar-file-k6v2": ((6, 2), None, None, "served quantizer with 6 key / 2 value refit rounds"),
    "oscar-file-k8v2": ((8, 2), None, None, "served quantizer with 8 key / 2 value refit rounds"),
    "oscar-file-k8v4": ((8, 4), None, None, "served quantizer with 8 key / 4 value refit rounds"),
    "oscar-file-k12v2": ((12, 2), None, None, "served quantizer with 12 key / 2 value refit rounds"),
}
FILE_METHODS = tuple(FILE_VARIANTS)
ALL_METHODS = (*BASELINES, *FILE_METHODS, *OSCAR_VARIANTS)


@dataclasses.dataclass
class Geometry:
    """What the methods need to know about the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def _layers_from(rotation_set, means: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> list[LayerRotations]:
    """LayerRotations from a calibration RotationSet (clip ratios as stored)."""
    return [
        LayerRotations(
            layer.k_rotation.float(), layer.v_rotation.float(), layer.clip_k, layer.clip_v,
            *(means[i] if means is not None else (None, None)),
        )
        for i, layer in enumerate(rotation_set.layers)
    ]


def sample_means(stats) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key mean, value mean), each [Hkv, D] float32, from the calibration samples."""
    if stats.samples is None:
        raise ValueError("centering needs calibration samples: collect_statistics(sample_sequences >= 1).")
    return [
        (k.mean(dim=(0, 1)).float(), v.mean(dim=(0, 1)).float())
        for k, v in zip(stats.samples.key, stats.samples.value)
    ]


def baseline_method(name: str, geometry: Geometry) -> KVMethod:
    """A method that needs no calibration."""
    g = geometry
    if name == "bf16":
        return KVMethod()
    if name == "int2-naive":
        return RowMethod(name, "per-token INT2, fp16 scale/offset per row, no rotation", identity_layers(g.num_layers))
    if name == "int2-quarot":
        return RowMethod(name, "QuaRot-INT2: Hadamard, per-token INT2",
                         hadamard_layers(g.num_layers, g.num_kv_heads, g.head_dim))
    if name == "int2-hadamard-clip":
        layers = hadamard_layers(g.num_layers, g.num_kv_heads, g.head_dim, DEFAULT_CLIP_RATIO_K, DEFAULT_CLIP_RATIO_V)
        return RowMethod(name, "Hadamard + clip 0.96/0.92, per-token INT2", layers)
    if name == "int2-hadamard-refit":
        layers = hadamard_layers(g.num_layers, g.num_kv_heads, g.head_dim, DEFAULT_CLIP_RATIO_K, DEFAULT_CLIP_RATIO_V)
        return RowMethod(name, "Hadamard + least-squares grid refit, per-token INT2", layers,
                         refit_iterations=GRID_REFIT_ITERATIONS)
    if name == "int2-hadamard-served":
        layers = hadamard_layers(g.num_layers, g.num_kv_heads, g.head_dim, DEFAULT_CLIP_RATIO_K, DEFAULT_CLIP_RATIO_V)
        return RowMethod(name, "Hadamard + the served quantizer (floored key refit), per-token INT2", layers,
                         refit_iterations=SERVED_REFIT_ITERATIONS, refit_floor=REFIT_SCALE_FLOOR)
    if name == "kivi2":
        return KiviMethod(KIVI_GROUP_SIZE)
    if name in TURBOQUANT_PRESETS:
        key_bits, value_bits = TURBOQUANT_PRESETS[name]
        return TurboQuantMethod(name, key_bits, value_bits)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(ALL_METHODS)}.")


def _samples_on(samples, device: torch.device):
    """The calibration samples moved to ``device`` (the clip search runs where they are)."""
    move = lambda tensors: [t.to(device) for t in tensors]  # noqa: E731
    return dataclasses.replace(samples, query=move(samples.query), key=move(samples.key), value=move(samples.value))


def oscar_methods(
    names: list[str], stats, device: torch.device, sink: int, recent: int, progress: bool = True
) -> dict[str, KVMethod]:
    """Build the requested OSCAR variants from calibration statistics (see module doc).

    ``device``: where the clip search runs (the model's device: minutes on a CPU);
    ``sink`` / ``recent``: the windows the clip search optimises for.
    """
    from vllm_oscar.calibration.clip_search import search_clip_ratios
    from vllm_oscar.calibration.rotations import build_rotations

    cache: dict[str, object] = {}

    def rotations(key: str, builder: Callable[[], object]):
        if key not in cache:
            cache[key] = builder()
        return cache[key]

    head = lambda: rotations("head", lambda: build_rotations(stats, value_form=VALUE_FORM_OUTPUT))  # noqa: E731
    clipped = lambda: rotations(  # noqa: E731
        "clip",
        lambda: search_clip_ratios(
            head(), _samples_on(stats.samples, device), sink=sink, recent=recent, progress=progress
        ).apply(head()),
    )
    built: dict[str, KVMethod] = {}
    for name in names:
        if name == "oscar-head":
            built[name] = RowMethod(name, "OSCAR per-head, paper value form, clip 0.96/0.92", _layers_from(head()))
        elif name == "oscar-head-vlogit":
            rs = rotations("vlogit", lambda: build_rotations(stats, value_form=VALUE_FORM_LOGIT_ENERGY))
            built[name] = RowMethod(name, "OSCAR per-head, reference-code value form", _layers_from(rs))
        elif name == "oscar-layer":
            rs = rotations("layer", lambda: build_rotations(stats, per_head=False))
            built[name] = RowMethod(name, "OSCAR one rotation per layer", _layers_from(rs))
        elif name == "oscar-head-noH":
            rs = rotations("noH", lambda: build_rotations(stats, use_hadamard=False))
            built[name] = RowMethod(name, "OSCAR per-head without Hadamard", _layers_from(rs))
        elif name == "oscar-head-lm":
            built[name] = RowMethod(name, "OSCAR per-head, Lloyd-Max levels on K and V", _layers_from(head()),
                                    lloyd_max=True)
        elif name == "oscar-head-clip":
            built[name] = RowMethod(name, "OSCAR per-head, searched clip ratios", _layers_from(clipped()))
        elif name == "oscar-head-center":
            built[name] = RowMethod(name, "OSCAR per-head, K/V mean centering",
                                    _layers_from(head(), sample_means(stats)))
        elif name == "oscar-head-refit":
            built[name] = RowMethod(
                name, "OSCAR per-head, least-squares grid refit", _layers_from(head()),
                refit_iterations=GRID_REFIT_ITERATIONS,
            )
        elif name == "oscar-head-center-refit":
            built[name] = RowMethod(
                name, "OSCAR per-head, K/V centering + least-squares grid refit",
                _layers_from(head(), sample_means(stats)), refit_iterations=GRID_REFIT_ITERATIONS,
            )
        elif name == "oscar-head-best":
            built[name] = RowMethod(
                name, "OSCAR per-head, searched clips + centering + refit",
                _layers_from(clipped(), sample_means(stats)), refit_iterations=GRID_REFIT_ITERATIONS,
            )
        else:
            raise ValueError(f"{name!r} is not an OSCAR variant; known: {', '.join(OSCAR_VARIANTS)}.")
    return built


def file_method(path: str, name: str = "oscar-file") -> KVMethod:
    """OSCAR from a rotation file (rotations and clip ratios as stored) with the write
    quantizer of ``name`` (FILE_VARIANTS): "oscar-file" = what the backend serves with
    default options (OscarConfig().refit_iterations, config.REFIT_SCALE_FLOOR), the others
    fixed (K, V) refit rounds and floors and optionally a key clip ratio in place of the file's."""
    from vllm_oscar.calibration.files import load_rotation_file

    if name not in FILE_VARIANTS:
        raise ValueError(f"{name!r} is not a rotation-file method; known: {', '.join(FILE_METHODS)}.")
    rounds, floor, clip_k, what = FILE_VARIANTS[name]
    refit = refit_pair(OscarConfig().refit_iterations if rounds is None else rounds)
    floor = REFIT_SCALE_FLOOR if floor is None else floor
    layers = _layers_from(load_rotation_file(path))
    if clip_k is not None:
        layers = [dataclasses.replace(layer, clip_k=clip_k) for layer in layers]
    sides = "; ".join(
        f"{side} " + (("floored " if floored else "") + f"refit {n} rounds" if n else "min/max")
        for side, n, floored in zip("KV", refit, floor)
    )
    return RowMethod(name, f"OSCAR from {path} ({what}: {sides})", layers,
                     refit_iterations=refit if refit[0] != refit[1] else refit[0], refit_floor=floor)
