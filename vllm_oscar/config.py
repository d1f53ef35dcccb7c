"""OSCAR configuration: every method constant is named here, once.

The numbers come from ``docs/method.md`` (the OSCAR design). Modules import
these names instead of repeating literals, so a change of default happens in one place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

# --- quantizer -------------------------------------------------------------------
#: Bits per code of the quantized body.
CODE_BITS: int = 2
#: Number of levels of a code (2 ** CODE_BITS).
NUM_LEVELS: int = 1 << CODE_BITS
#: Codes packed into one byte.
CODES_PER_BYTE: int = 8 // CODE_BITS
#: Smallest range a group may have, so the scale never becomes 0 (constant groups).
SCALE_EPS: float = 1e-6
#: Gaussian 4-level Lloyd-Max decision boundaries, in standard deviations (docs/method.md 3).
LLOYD_MAX_BOUNDARY: float = 0.9811
#: Least-squares grid refit (quant.quantizer.refit_grid): fit/assign rounds that refit each
#: group's (scale, offset) to its UNCLIPPED values, starting from the clipped min/max grid.
#: Same storage, same decode; 0 = plain (clipped) min/max. The rounds of the evaluation variants
#: (the served rounds are SERVED_REFIT_ITERATIONS). SmolLM2 held-out KL (shipped file,
#: CPU, docs/notes/quality.md): 0 rounds 0.0228, 1: 0.0138, 2: 0.0121, 3: 0.0115, 4: 0.0117.
GRID_REFIT_ITERATIONS: int = 4
#: The served (key rounds, value rounds) of the refit: OscarConfig's default, the clip
#: search's and calibrate's. Keys converge slowly under the floor (below): SmolLM2 held-out
#: KL (CPU, 4 x 1024, docs/notes/quality.md) for K/V rounds 4/4 0.0238, 6/2 0.0178, 8/2
#: 0.0150, 12/2 0.0140; stress windows 0.1095 -> 0.0738 at 8/2; passkey 17/20 at 2048 tokens
#: (4/4: 15/20) and 10/10 at 4096. Value rounds beyond 2 change nothing measurable.
SERVED_REFIT_ITERATIONS: tuple[int, int] = (8, 2)
#: Whether the refit of (keys, values) is floored: the fitted scale may not fall below the
#: clipped min/max grid's scale (quant.refit_grid(scale_floor=True)), so the grid moves
#: but never narrows. The served write quantizer (both write kernels, the clip search):
#: keys floored, values free. Issue 6 (docs/QUALITY.md, "Passkey and the grid refit"): the
#: free key refit saturates the large key coordinates; on SmolLM2 (CPU, 20 passkey trials
#: at 2048 tokens) it retrieved 0-4/20 at any key clip; floored, with key clip 0.96, 15-17/20
#: (BF16 20/20) at held-out KL 0.0214-0.0220 (free refit 0.0117, published min/max 0.0631).
REFIT_SCALE_FLOOR: tuple[bool, bool] = (True, False)
#: The refit's working array (quant.quantizer._refit) drops the groups that stopped
#: (at a fixed point) once they are a quarter of it and it holds at
#: least this many values: below, the gathers cost more than the rounds they save.
REFIT_COMPACT_MIN_VALUES: int = 65536
#: Storage dtypes allowed for per-group scale and offset, with their bit width.
SCALE_DTYPE_BITS: dict[torch.dtype, int] = {
    torch.float16: 16,
    torch.bfloat16: 16,
    torch.float32: 32,
}

# --- clipping ----------------------------------------------------------------------
#: Reference clip ratios (quantile of |x| per rotated row) for keys and values.
DEFAULT_CLIP_RATIO_K: float = 0.96
DEFAULT_CLIP_RATIO_V: float = 0.92

# --- serving layout ----------------------------------------------------------------
#: First tokens of every sequence kept in BF16 (attention sink).
DEFAULT_SINK_TOKENS: int = 64
#: Most recent tokens of every sequence kept in BF16.
DEFAULT_RECENT_TOKENS: int = 256
#: What the vLLM backend folds into the model's weights at load (vllm_oscar.attention.fold): nothing, R_V into
#: W_o (the attention output stays rotated: no un-rotation launch per layer step), or R_V into W_v and W_o.
FOLD_MODES: tuple[str, ...] = ("none", "output", "value_and_output")
DEFAULT_FOLD_MODE: str = "output"
#: Bits per element of the BF16 windows.
WINDOW_BITS: int = 16
#: max_num_seqs when OSCAR serves and the user sets none. The BF16 window stores are reserved for
#: max_num_seqs requests (~352 BF16 tokens each) inside the KV budget; vLLM's own default on an 80 GB
#: GPU, 1024, would reserve 53 GB for a Qwen3-8B (36 layers x 8 KV heads x D 128), more than its whole
#: KV budget; 256 reserves 13 GB, a quarter of it, and still lets about 256 requests of ~9K tokens share it.
DEFAULT_MAX_NUM_SEQS: int = 256

# --- names users type -----------------------------------------------------------------
#: Attention backend name (``VLLM_ATTENTION_BACKEND=OSCAR``, ``--attention-backend OSCAR``).
BACKEND_NAME: str = "OSCAR"
#: KV-cache dtype name (``--kv-cache-dtype oscar``).
KV_CACHE_DTYPE_NAME: str = "oscar"
#: Key of the OSCAR options in vLLM's ``additional_config`` (``--additional-config``).
ADDITIONAL_CONFIG_KEY: str = "oscar"
#: Environment variable that selects the backend (vLLM removed it; the plugin honours it).
ATTENTION_BACKEND_ENV: str = "VLLM_ATTENTION_BACKEND"
#: Kernel block sizes the OSCAR backend accepts: any multiple of this many tokens.
KERNEL_BLOCK_MULTIPLE: int = 16
#: Block size the GPU decode is fastest with: a 64-position tile is one contiguous (block, KV head)
#: region (H200, docs/decisions.md V22: 2-9% faster than blocks of 16 at >= 32K, batch >= 8).
#: The OSCAR backend asks vLLM for it on CUDA when the user passes no --block-size
#: (OscarAttentionBackend.get_preferred_block_size).
GPU_DECODE_BLOCK_SIZE: int = 64
#: Queries per scaled_dot_product_attention call of the CPU (plain-torch) attention: bounds its mask and score
#: memory to a chunk of the prompt, and each chunk reads only the keys up to its last query (kernels.torch_ops._attend;
#: 2 CPU threads, SmolLM2's geometry: 256 the fastest of 128-1024 at 512 and 2048 positions, 10-20% ahead of 1024).
TORCH_QUERY_CHUNK: int = 256

# --- calibration (vllm_oscar.calibration) -------------------------------------------
#: Fraction at the END of every text corpus (by characters) held out for evaluation:
#: calibration reads only the first CALIBRATION_TEXT_FRACTION of each file, evaluation
#: only the last CORPUS_HELDOUT_FRACTION (vllm_oscar.calibration.data.split_corpus_text).
CORPUS_HELDOUT_FRACTION: float = 0.2
CALIBRATION_TEXT_FRACTION: float = 1.0 - CORPUS_HELDOUT_FRACTION
#: Default calibration size: tokens of prefill and tokens per calibration sequence.
DEFAULT_CALIBRATION_TOKENS: int = 32768
DEFAULT_CALIBRATION_SEQ_LEN: int = 1024
#: Calibration sequences whose post-RoPE Q/K/V are kept for the clip-ratio search and
#: left out of the rotation statistics (half select the ratios, the other half judge
#: per-layer against per-model ratios on data neither the rotations nor the choice saw).
DEFAULT_CLIP_SEARCH_SEQUENCES: int = 4
#: Clip ratios tried by the search (1.0 = no clipping).
CLIP_RATIO_GRID: tuple[float, ...] = (0.70, 0.75, 0.80, 0.84, 0.88, 0.90, 0.92, 0.94, 0.96, 0.98, 1.0)
#: Per-layer clip ratios are kept only if they lower the held-out attention-output error
#: of one ratio pair per model by at least this relative amount.
CLIP_PER_LAYER_MIN_GAIN: float = 0.01
#: Value targets (docs/method.md 2): the paper's score-weighted output second moment
#: V^T S^T S V, and the reference code's logit-energy-weighted V^T W V.
VALUE_FORM_OUTPUT: str = "attention_output"
VALUE_FORM_LOGIT_ENERGY: str = "logit_energy"
VALUE_FORMS: tuple[str, ...] = (VALUE_FORM_OUTPUT, VALUE_FORM_LOGIT_ENERGY)
DEFAULT_VALUE_FORM: str = VALUE_FORM_OUTPUT

# --- rotation files -----------------------------------------------------------------
#: ``format`` metadata value of our safetensors rotation files, and its version.
ROTATION_FILE_FORMAT: str = "vllm_oscar.rotations"
ROTATION_FILE_VERSION: int = 1
#: Largest max|R^T R - I| accepted when loading a rotation.
ORTHOGONALITY_TOLERANCE: float = 1e-3
#: ``format_version`` values of the published RotationZoo .pt files we import.
ROTATIONZOO_VERSIONS: tuple[int, ...] = (1, 2)
#: Folder (at the repository root, installed under share/vllm_oscar/) of shipped files.
SHIPPED_ROTATIONS_DIR: str = "rotations"


def is_power_of_two(value: int) -> bool:
    """True for 1, 2, 4, 8, ...; False for 0, negatives and non-integers."""
    return isinstance(value, int) and value > 0 and (value & (value - 1)) == 0


def check_head_dim(head_dim: int) -> None:
    """Raise ValueError unless ``head_dim`` is a power of two >= CODES_PER_BYTE.

    The Hadamard factor of the rotation needs a power of two, and the packed layout
    needs head_dim divisible by the codes per byte.
    """
    if not is_power_of_two(head_dim) or head_dim < CODES_PER_BYTE:
        raise ValueError(
            f"head_dim={head_dim!r} is not supported: OSCAR needs a power of two >= "
            f"{CODES_PER_BYTE} (e.g. 64, 128 or 256) for its Hadamard rotation."
        )


def check_group_size(head_dim: int, group_size: int) -> None:
    """Raise ValueError unless ``group_size`` is a multiple of CODES_PER_BYTE dividing head_dim."""
    if (
        not isinstance(group_size, int)
        or group_size <= 0
        or head_dim % group_size != 0
        or group_size % CODES_PER_BYTE != 0
    ):
        allowed = [g for g in range(CODES_PER_BYTE, head_dim + 1, CODES_PER_BYTE) if head_dim % g == 0]
        raise ValueError(
            f"group_size={group_size!r} must divide head_dim={head_dim} and be a multiple of "
            f"{CODES_PER_BYTE}; allowed values: {allowed}."
        )


def check_clip_ratio(name: str, ratio: float) -> None:
    """Raise ValueError unless ``ratio`` lies in (0, 1] (1 means no clipping)."""
    if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name}={ratio!r} must lie in (0, 1]; 1.0 disables clipping.")


def check_refit_iterations(iterations: int) -> None:
    """Raise ValueError unless ``iterations`` is an integer >= 0 (0 = no refit)."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"refit_iterations={iterations!r} must be an integer >= 0 (0 = plain min/max grid).")


#: Refit rounds as users give them: one int for K and V, or a (K rounds, V rounds) pair.
RefitIterations = Union[int, tuple[int, int]]


def refit_pair(iterations: "RefitIterations | list[int]") -> tuple[int, int]:
    """(K rounds, V rounds) from an int (both sides) or a 2-sequence; ValueError otherwise."""
    if isinstance(iterations, (tuple, list)):
        if len(iterations) != 2:
            raise ValueError(f"refit_iterations={iterations!r}: give one integer or a [K, V] pair of integers.")
        check_refit_iterations(iterations[0])
        check_refit_iterations(iterations[1])
        return int(iterations[0]), int(iterations[1])
    check_refit_iterations(iterations)
    return iterations, iterations


def check_scale_dtype(scale_dtype: torch.dtype) -> None:
    """Raise ValueError unless ``scale_dtype`` is one of SCALE_DTYPE_BITS."""
    if scale_dtype not in SCALE_DTYPE_BITS:
        allowed = ", ".join(str(d) for d in SCALE_DTYPE_BITS)
        raise ValueError(f"scale_dtype={scale_dtype} is not supported; allowed: {allowed}.")


#: Smallest head_dim of the GPU decode's int8 key path: an int8 MMA takes K >= 32, and the kernel feeds it one code
#: plane (D / 4 channels) or, at head_dim 64, two planes paired.
INT8_MMA_MIN_HEAD_DIM: int = 64


@dataclasses.dataclass(frozen=True)
class OscarConfig:
    """What a user can choose about the OSCAR KV cache.

    Attributes:
        group_size: channels sharing one (scale, offset); None means one group per
            head vector (group = head_dim), the validated setting.
        scale_dtype: storage dtype of the per-group scale and offset.
        sink_tokens: first tokens of a sequence kept in BF16.
        recent_tokens: last tokens of a sequence kept in BF16.
        clip_ratio_k / clip_ratio_v: defaults used when a rotation file has none.
        rotation_path: a rotation file (safetensors, or RotationZoo .pt); None means
            "find the shipped file for this model".
        hadamard_only: data-free mode: no calibrated rotation, Hadamard only (lower
            quality, must be asked for explicitly).
        refit_iterations: rounds of the least-squares (scale, offset) refit of every
            written group (SERVED_REFIT_ITERATIONS = (8 key, 2 value rounds) by default: it
            lowers SmolLM2's held-out KL about 5x at the same bits); 0 = the plain clipped
            min/max grid; one integer sets both sides. The key refit is floored
            (REFIT_SCALE_FLOOR: never narrower than the clipped min/max grid), a fixed
            property of the served quantizer since issue 6: the free key refit cost
            SmolLM2 most of its passkey retrievals (docs/QUALITY.md, "Passkey and the grid
            refit"). Same storage and decode either way; only the write does more work.
        int8_keys: the GPU decode computes the key dot as an int8 MMA with the query rounded
            to int8 per head row (None: where it applies, head_dim >= INT8_MMA_MIN_HEAD_DIM (64) on
            CUDA; its cost: 1.6% of the INT2 key error in amplitude, scripts/int8_query_error.py). False:
            the bf16 query everywhere. True where it cannot apply (CPU, head_dim < 64) is an error.
        flash_prefill: large chunked-prefill calls run as FlashAttention over gathered rows
            (kernels/flash_prefill.py; None: from FLASH_PREFILL_MIN_WORK of work and FLASH_PREFILL_MIN_PROGRAMS
            programs on, where the GPU and torch run FlashAttention; docs/PERFORMANCE.md "Chunked prefill").
            False: the Triton prefill kernel always.
            True: FlashAttention for every prefill call (an error where it cannot run: CPU, compute capability
            < 8.0, a torch without FlashAttention).
        fold_rotations: one of FOLD_MODES: "output" (the default) folds R_V into the model's W_o at load
            where the model allows it (vllm_oscar.attention.fold: no un-rotation launch per layer step),
            "value_and_output" into W_v too, "none" keeps the rotations in the kernels (one launch more
            per layer step) and lets weights be reloaded in place.
    """

    group_size: Optional[int] = None
    scale_dtype: torch.dtype = torch.float16
    sink_tokens: int = DEFAULT_SINK_TOKENS
    recent_tokens: int = DEFAULT_RECENT_TOKENS
    clip_ratio_k: float = DEFAULT_CLIP_RATIO_K
    clip_ratio_v: float = DEFAULT_CLIP_RATIO_V
    rotation_path: Optional[str] = None
    hadamard_only: bool = False
    refit_iterations: RefitIterations = SERVED_REFIT_ITERATIONS
    int8_keys: Optional[bool] = None
    flash_prefill: Optional[bool] = None
    fold_rotations: str = DEFAULT_FOLD_MODE

    def __post_init__(self) -> None:
        check_scale_dtype(self.scale_dtype)
        if self.fold_rotations not in FOLD_MODES:
            raise ValueError(f"fold_rotations={self.fold_rotations!r} must be one of {FOLD_MODES}.")
        if isinstance(self.refit_iterations, (tuple, list)):  # a JSON list becomes a (K, V) tuple
            object.__setattr__(self, "refit_iterations", refit_pair(self.refit_iterations))
        else:
            refit_pair(self.refit_iterations)
        check_clip_ratio("clip_ratio_k", self.clip_ratio_k)
        check_clip_ratio("clip_ratio_v", self.clip_ratio_v)
        for name in ("sink_tokens", "recent_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0.")
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size <= 0
        ):
            raise ValueError(f"group_size={self.group_size!r} must be a positive integer or None.")

    @property
    def window_tokens(self) -> int:
        """Tokens per sequence held in BF16 (sink + recent)."""
        return self.sink_tokens + self.recent_tokens

    def resolved_group_size(self, head_dim: int) -> int:
        """The group size for a head dimension (checks that it divides head_dim)."""
        check_head_dim(head_dim)
        group = head_dim if self.group_size is None else self.group_size
        check_group_size(head_dim, group)
        return group

# --- evaluation (vllm_oscar.evaluation) ---------------------------------------------
#: Stress windows that isolate the quantizer (issue 6): few BF16 tokens per sequence.
EVAL_STRESS_SINK_TOKENS: int = 4
EVAL_STRESS_RECENT_TOKENS: int = 16
#: KIVI-2 (Liu et al. 2024): tokens per key group (per-channel scales) and channels per
#: value group (per-token scales); scale and zero in fp16.
KIVI_GROUP_SIZE: int = 32
#: vLLM's TurboQuant presets (model_executor/layers/quantization/turboquant/config.py in
#: vLLM 0.32): key Lloyd-Max bits, value uniform bits; all with norm correction.
TURBOQUANT_PRESETS: dict[str, tuple[int, int]] = {"turboquant_4bit_nc": (4, 4), "turboquant_3bit_nc": (3, 3)}
#: vLLM keeps the first and last N attention layers of a dense model unquantized for
#: every TurboQuant preset (TurboQuantConfig.get_boundary_skip_layers, n=2).
TURBOQUANT_BOUNDARY_SKIP_LAYERS: int = 2
#: Query positions per chunk of the evaluation attention (bounds its score memory).
EVAL_QUERY_CHUNK: int = 1024
