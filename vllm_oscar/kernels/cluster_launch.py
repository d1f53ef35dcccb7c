"""Launch a compiled Triton / Gluon kernel in thread-block clusters, with shared memory past its own (Hopper).

Triton compiles a kernel for one CTA per program (num_ctas 1: program_id(0) is ctaid.x), but its CUDA launcher
takes the cluster size from the packed metadata (num_warps, num_ctas, shared bytes): given num_ctas = C there, it
multiplies the grid x it is passed by C and launches clusters of C CTAs along x (16: non-portable, which the launcher
enables), so that %cluster_ctarank = ctaid.x % C. The same tuple carries the dynamic shared memory, so a kernel can
be given bytes past what it allocates itself and reach them by inline PTX (cluster_ptx): ``extra_shared`` bytes at
offset ``shared_offset(compiled)`` of its dynamic shared memory. docs/notes/kernels.md "Session 45" has the facts
(checked in Triton 3.6's launcher source, the device's version).

This reaches past Triton's public API (CompiledKernel.run's argument order, CompiledKernel.metadata), so it is
limited to the Triton releases whose launcher was read (LAUNCHER_TRITON).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton

#: Triton releases (major.minor) whose CUDA launcher takes (grid, stream, function, (num_warps, num_ctas, shared),
#: launch metadata, enter hook, exit hook, every argument) and whose load_binary takes (name, binary, shared bytes,
#: device): read in the sources of 3.6 (the device's) and 3.9 (this machine's).
LAUNCHER_TRITON: tuple[str, ...] = ("3.6", "3.9")
#: Most CTAs per cluster on Hopper (16 is non-portable; Triton's launcher opts in to it).
MAX_CLUSTER: int = 16
#: Alignment of the bytes given past the kernel's own shared memory.
SHARED_ALIGN: int = 16


def check_triton(option: str) -> None:
    """Raise a clear error, naming ``option`` (what asked for a cluster launch), unless the installed Triton's
    launcher is one this module was written against."""
    release = ".".join(triton.__version__.split(".")[:2])
    if release not in LAUNCHER_TRITON:
        raise ValueError(f"{option} launches clusters through Triton's CUDA launcher directly, whose arguments were "
                         f"read for Triton {' and '.join(LAUNCHER_TRITON)}, not {triton.__version__}. Turn it off.")


def shared_offset(compiled: Any) -> int:
    """Where the extra bytes begin in the dynamic shared memory of a CompiledKernel: past its own, aligned."""
    return -(-compiled.metadata.shared // SHARED_ALIGN) * SHARED_ALIGN


@dataclasses.dataclass(frozen=True)
class _Loaded:
    """A kernel's binary loaded a second time, with the dynamic shared-memory limit its launches need."""

    module: int
    function: int
    shared: int


#: Loaded binaries by (kernel hash, total shared bytes, device).
_LOADED: dict[tuple, _Loaded] = {}


def _loaded(compiled: Any, shared: int, device: int) -> _Loaded:
    """The kernel's function handle allowed ``shared`` bytes of dynamic shared memory (Triton's load_binary sets the
    attribute above 48 KB, as it does for the kernel's own bytes)."""
    key = (compiled.hash, shared, device)
    if key not in _LOADED:
        module, function, _, _, _ = triton.runtime.driver.active.utils.load_binary(compiled.name, compiled.kernel,
                                                                                   shared, device)
        _LOADED[key] = _Loaded(module, function, shared)
    return _LOADED[key]


def argument_values(kernel: Any, args: list, constants: dict) -> list:
    """Every parameter's value in order, as the launcher takes them: the leading runtime ``args``, then each later
    parameter from ``constants`` or its default."""
    values = list(args)
    for param in kernel.params[len(args):]:
        if param.name in constants:
            values.append(constants[param.name])
        elif param.has_default:
            values.append(param.default)
        else:
            raise ValueError(f"{kernel.__name__}: no value for parameter {param.name}.")
    return values


def launch_compiled(compiled: Any, grid: tuple[int, int, int], cluster: int, values: list, extra_shared: int,
                    stream: int) -> None:
    """Launch a CompiledKernel over ``grid`` CTAs (grid x a multiple of ``cluster``) in clusters of ``cluster``
    along x, with ``extra_shared`` bytes past its own shared memory, on CUDA stream handle ``stream``; values:
    argument_values. Graph-capturable (one launch on the stream, no host sync)."""
    if not 1 <= cluster <= MAX_CLUSTER or grid[0] % cluster:
        raise ValueError(f"clusters of {cluster} CTAs need 1 <= cluster <= {MAX_CLUSTER} and grid x ({grid[0]}) a "
                         f"multiple of it.")
    shared = shared_offset(compiled) + extra_shared
    loaded = _loaded(compiled, shared, torch.cuda.current_device())
    compiled.run(grid[0] // cluster, grid[1], grid[2], stream, loaded.function,
                 (compiled.metadata.num_warps, cluster, shared), None, None, None, *values)


def launch_in_clusters(kernel: Any, grid: tuple[int, int, int], cluster: int, args: list, constants: dict,
                       extra_shared: int, offset_arg: str) -> None:
    """Compile (or find compiled) ``kernel`` for ``args`` (its leading runtime arguments) and ``constants`` (its
    later parameters and launch options, e.g. num_warps), and launch it as launch_compiled does on the current
    stream, passing shared_offset in its runtime parameter ``offset_arg`` (in do_not_specialize: its value is known
    only once compiled, so the compile sees the value in ``constants`` or the parameter's default)."""
    check_triton(f"a cluster launch of {kernel.__name__}")
    at = [param.name for param in kernel.params].index(offset_arg)
    if kernel.params[at].is_constexpr or not kernel.params[at].do_not_specialize:
        raise ValueError(f"{offset_arg} must be a runtime argument in do_not_specialize.")
    compiled = kernel.warmup(*args, grid=grid, **constants)
    values = argument_values(kernel, args, constants)
    values[at] = shared_offset(compiled)
    launch_compiled(compiled, grid, cluster, values, extra_shared, torch.cuda.current_stream().cuda_stream)
