"""cluster_launch's host side on CPU: the launcher's argument list, its Triton version gate and its refusals (the
launch itself needs a Hopper GPU: bench/check_kernels_gpu.py --only cluster)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from vllm_oscar.kernels import cluster_launch


def _with_defaults(x_ptr, n, A: tl.constexpr, B: tl.constexpr = 2, offset=0):
    tl.store(x_ptr + tl.arange(0, A), n + B + offset)


def _specialising_offset(x_ptr, offset=0):
    tl.store(x_ptr, offset)


# JITFunction itself: triton.jit gives interpreter functions (no parameter list) under the suite's TRITON_INTERPRET.
_kernel_with_defaults = JITFunction(_with_defaults, do_not_specialize=["offset"])
_kernel_specialising_offset = JITFunction(_specialising_offset)


def test_argument_values_follow_the_parameters_with_their_defaults() -> None:
    x = torch.zeros(4)
    assert cluster_launch.argument_values(_kernel_with_defaults, [x, 5], {"A": 4}) == [x, 5, 4, 2, 0]
    assert cluster_launch.argument_values(_kernel_with_defaults, [x, 5], {"A": 4, "B": 3, "offset": 16,
                                                                         "num_warps": 1}) == [x, 5, 4, 3, 16]
    with pytest.raises(ValueError, match="no value for parameter A"):
        cluster_launch.argument_values(_kernel_with_defaults, [x, 5], {})


def test_only_read_launchers_are_driven(monkeypatch: pytest.MonkeyPatch) -> None:
    release = ".".join(triton.__version__.split(".")[:2])
    if release in cluster_launch.LAUNCHER_TRITON:
        cluster_launch.check_triton("this test")
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    with pytest.raises(ValueError, match=r"gluon_cluster_merge=True launches clusters .* not 3\.5\.1\. Turn it off"):
        cluster_launch.check_triton("gluon_cluster_merge=True")


def test_cluster_shapes_and_offset_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="clusters of 17 CTAs"):
        cluster_launch.launch_compiled(None, (34, 1, 1), 17, [], 0, 0)
    with pytest.raises(ValueError, match=r"grid x \(24\) a multiple"):
        cluster_launch.launch_compiled(None, (24, 1, 1), 16, [], 0, 0)
    monkeypatch.setattr(triton, "__version__", f"{cluster_launch.LAUNCHER_TRITON[0]}.0")
    with pytest.raises(ValueError, match="offset must be a runtime argument in do_not_specialize"):
        cluster_launch.launch_in_clusters(_kernel_specialising_offset, (16, 1, 1), 16, [torch.zeros(1)], {}, 0,
                                          "offset")


def test_gluon_decode_takes_its_merge_offset_at_run_time() -> None:
    """gluon_decode's CLUSTER merge finds its bytes at merge_smem, known only once compiled: a runtime argument that
    Triton must not specialise (a value of 16 would otherwise compile another kernel), 0 by default."""
    gluon_decode = pytest.importorskip("vllm_oscar.kernels.gluon_decode")
    param = next(p for p in gluon_decode.int2_split_gluon_kernel.params if p.name == "merge_smem")
    assert param.do_not_specialize and not param.is_constexpr and param.default == 0
    assert gluon_decode.cluster_merge_bytes(16, 64) == 16 * 4 * (64 // 16 + 1) * 4 + 16
