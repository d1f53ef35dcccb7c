"""Calibration of OSCAR rotations from a real model, and rotation files (docs/method.md 2).

Python API (all CPU/CUDA torch; transformers is imported only by the functions that
load or run a model):

Model and data
    load_model(spec, device="cpu", dtype=None, name=None) -> LoadedModel
        spec: a HF folder, a .gguf file, or "smollm2"; .model, .tokenizer, .identity.
    ModelIdentity(architecture, num_layers, num_query_heads, num_kv_heads, head_dim,
                  name="", weights_sha256="")
        .from_hf_config(config, name) (works on vLLM's hf_config), .from_model(model, name),
        .shape_mismatches(other), .name_matches(name_or_path), .rotation_shape.
    split_corpus_text(text) -> (calibration part, held-out part): first 80% / last 20%
        of the characters (config.CORPUS_HELDOUT_FRACTION). Evaluation must use only the
        held-out part. read_text(path) reads .txt or .xz.
    calibration_tokens(tokenizer, paths, num_tokens, seq_len) -> CalibrationData
        (.tokens [N, T] int64, .sha256, .sources).

Statistics
    capture_attention(model, callback)  context manager; callback(layer_idx, q [B,Hq,T,D],
        k [B,Hkv,T,D], v [B,Hkv,T,D], out [B,T,Hq,D], scaling) for every attention call,
        post-RoPE; the model's outputs are bit-identical with and without it.
    collect_statistics(model, token_batches [N, T], identity=None, batch_size=1,
                       sample_sequences=0, exclude_samples=False) -> CalibrationStats
        float64 [L, Hkv, D, D]: .key_target (C_K pooled over the query heads of a KV
        head), .value_output (V^T S^T S V, causal softmax), .value_logit_energy
        (reference-code form); .num_tokens; .samples (Q/K/V of the first
        sample_sequences sequences; exclude_samples=True leaves them out of the sums so
        the clip search judges on data the rotations never saw, as `calibrate` does).

Rotations
    build_rotations(stats, per_head=True, use_hadamard=True, use_bit_reversal=True,
                    value_form="attention_output", clip_k=0.96, clip_v=0.92) -> RotationSet
    RotationSet: .identity, .layers[i] = LayerRotation(k_rotation [Hkv,D,D] float32,
        v_rotation [Hkv,D,D] float32, k_eigenvalues [Hkv,D] float64, v_eigenvalues,
        clip_k: float, clip_v: float), .metadata (JSON), .clip_ratios, .validate().
        Convention: rows are rotated as x_rot = x @ R (R = U . H . P_br).
    search_clip_ratios(rotation_set, stats.samples, grid=CLIP_RATIO_GRID, sink=64,
                       recent=256) -> ClipSearchResult; .apply(rotation_set) stores the
        chosen ratios (per layer if that wins on held-out sequences, else per model).
        Objective: relative attention-output error with the serving windows.
    calibrate(loaded, data_paths, CalibrationOptions(...)) -> RotationSet  (all of the above)

Files
    save_rotation_file(path, rotation_set) -> Path     (safetensors, see files.py)
    load_rotation_file(path, expected_identity=None) -> RotationSet   (validating;
        ValueError says what is wrong, what was expected and what to do)
    read_rotation_metadata(path) -> dict[str, str]
    import_rotationzoo(k_path, v_path, identity) -> RotationSet   (published .pt v1/v2)
    find_shipped_rotation(identity) -> Path | None     (rotations/ of the package)

Command line: `vllm-oscar calibrate` and `vllm-oscar info` (vllm_oscar/commands).
"""

from vllm_oscar.calibration.capture import capture_attention
from vllm_oscar.calibration.clip_search import ClipSearchResult, search_clip_ratios
from vllm_oscar.calibration.data import CalibrationData, calibration_tokens, read_text, split_corpus_text
from vllm_oscar.calibration.files import (
    find_shipped_rotation,
    load_rotation_file,
    read_rotation_metadata,
    save_rotation_file,
)
from vllm_oscar.calibration.identity import ModelIdentity
from vllm_oscar.calibration.model_loading import LoadedModel, load_model
from vllm_oscar.calibration.pipeline import CalibrationOptions, calibrate
from vllm_oscar.calibration.rotations import LayerRotation, RotationSet, build_rotations
from vllm_oscar.calibration.rotationzoo import import_rotationzoo
from vllm_oscar.calibration.statistics import ActivationSamples, CalibrationStats, collect_statistics

__all__ = [
    "ActivationSamples",
    "CalibrationData",
    "CalibrationOptions",
    "CalibrationStats",
    "ClipSearchResult",
    "LayerRotation",
    "LoadedModel",
    "ModelIdentity",
    "RotationSet",
    "build_rotations",
    "calibrate",
    "calibration_tokens",
    "capture_attention",
    "collect_statistics",
    "find_shipped_rotation",
    "import_rotationzoo",
    "load_model",
    "load_rotation_file",
    "read_rotation_metadata",
    "read_text",
    "save_rotation_file",
    "search_clip_ratios",
    "split_corpus_text",
]
