"""A copy kernel whose warps are independent split programs (bench/copy_shapes.py's shapes 1i and 4i).

A probe of Gluon (docs/decisions.md) showed that warps sharing a ring in Gluon-allocated shared memory get CTA-wide
barriers from Triton every tile, so V56's four programs per CTA ran in lockstep. Here each warp of a CTA is its own
split program and touches shared memory only through inline PTX, which Triton's barrier analysis does not see: lane 0 of
the warp starts one bulk copy (cp.async.bulk, 1D) of a tile's whole (block, KV head) region into the warp's own stage
and arms the stage's mbarrier with its byte count, the warp's lanes wait on that mbarrier, read the tile's 512 bytes
of scale planes (ld.shared) and sync only among themselves (bar.warp.sync) before lane 0 refills the stage.

The rings lie past everything Gluon allocates: the kernel's only Gluon allocation is KEEP_PER_WARP bytes per warp at
offset 0 of the dynamic shared memory (`global_smem`), touched once by a Gluon store so that the kernel keeps it
(tests/test_copy_shapes.py: the compiled kernel's shared memory is exactly that), and raw_launch launches it with
those bytes plus the rings' (exact: no power-of-two allocation shape), which the kernel reaches by inline PTX at
raw_base. Per warp: STAGES regions, then STAGES mbarriers in 16-byte slots.

The same job as copy_split_kernel (its arguments but the cache tensor instead of TMA descriptors, its checksum per
program), so the two can be compared side by side: 1i (one warp per CTA) against copy_split_kernel's 1 says what the
bulk copy itself costs, 4i against 1i what independent programs sharing a CTA cost or save (the launch of a quarter
as many CTAs).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

#: Bytes per mbarrier (8 used): 16 keeps every warp's ring, and so every bulk copy's destination, 16-byte aligned.
BARRIER_SLOT: gl.constexpr = gl.constexpr(16)
#: Bytes per warp of the one Gluon allocation (raw_base): a power of two, as its shape must be, and a
#: multiple of 16, so that the raw bytes after it start 16-byte aligned.
KEEP_PER_WARP: gl.constexpr = gl.constexpr(32)
#: CUfunction_attribute of the dynamic shared memory a kernel may take.
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


@gluon.jit
def _lane_and_warp():
    """(lane, warp) of the calling thread, int32 scalars."""
    lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
    warp = gl.inline_asm_elementwise("{ .reg .u32 t; mov.u32 t, %tid.x; shr.u32 $0, t, 5; }", "=r", [],
                                     dtype=gl.int32, is_pure=True, pack=1)
    return lane, warp


@gluon.jit
def _shared_base():
    """The shared-window address of the dynamic shared memory (global_smem: Triton's name for it), int32."""
    return gl.inline_asm_elementwise("mov.b32 $0, global_smem;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _init_barrier(bar, lane):
    """Lane 0: mbarrier at shared address ``bar`` expecting one arrival, fenced for the copy engine; then the warp's
    lanes synced. Returns 0 (for ordering)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.s32 p, $2, 0; @p mbarrier.init.shared::cta.b64 [$1], 1; "
        "@p fence.mbarrier_init.release.cluster; fence.proxy.async.shared::cta; bar.warp.sync -1; mov.u32 $0, 0; }",
        "=r,r,r", [bar, lane], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _start_copy(dst, src, nbytes, bar, lane, live):
    """Lane 0, where live != 0: arm mbarrier ``bar`` with nbytes and start the bulk copy of nbytes from global ``src``
    (int64 address) to shared ``dst``. Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p, q; setp.eq.s32 p, $5, 0; setp.ne.s32 q, $6, 0; and.pred p, p, q; "
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$4], $3; "
        "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$2], $3, [$4]; "
        "mov.u32 $0, 0; }",
        "=r,r,l,r,r,r,r", [dst, src, nbytes, bar, lane, live], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_landed(bar, phase):
    """Every lane: wait until mbarrier ``bar`` completes ``phase`` (a bulk copy's bytes have landed). Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred done; waiting: mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; @!done bra waiting; "
        "mov.u32 $0, 0; }", "=r,r,r", [bar, phase], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _wait_groups(PENDING: gl.constexpr):
    """Every lane: wait until at most PENDING (1-3: rings of 2-4 stages) of its newest cp.async groups are in
    flight, then sync the warp's lanes (so that every lane sees every lane's landed chunks). Returns 0."""
    gl.static_assert((PENDING >= 1) & (PENDING <= 3), "rings of 2-4 stages")
    if PENDING == 1:
        done = gl.inline_asm_elementwise("cp.async.wait_group 1; bar.warp.sync -1; mov.u32 $0, 0;", "=r", [],
                                         dtype=gl.int32, is_pure=False, pack=1)
    elif PENDING == 2:
        done = gl.inline_asm_elementwise("cp.async.wait_group 2; bar.warp.sync -1; mov.u32 $0, 0;", "=r", [],
                                         dtype=gl.int32, is_pure=False, pack=1)
    else:
        done = gl.inline_asm_elementwise("cp.async.wait_group 3; bar.warp.sync -1; mov.u32 $0, 0;", "=r", [],
                                         dtype=gl.int32, is_pure=False, pack=1)
    return done


@gluon.jit
def _read_planes(planes):
    """Every lane, once the stage has landed: read its 16 bytes of the scale planes at shared ``planes`` + 16 x lane,
    sync the warp's lanes; returns the sum of the 512 bytes over the warp's lanes (int32, the same in every lane:
    copy_split_kernel's checksum of a tile)."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a, b, c, d, lo, hi, at; "
        "mov.u32 at, %laneid; mad.lo.u32 at, at, 16, $1; ld.shared.v4.u32 {a, b, c, d}, [at]; "
        "bar.warp.sync -1; "
        "and.b32 lo, a, 0x00ff00ff; shr.u32 hi, a, 8; and.b32 hi, hi, 0x00ff00ff; add.u32 at, lo, hi; "
        "and.b32 lo, b, 0x00ff00ff; shr.u32 hi, b, 8; and.b32 hi, hi, 0x00ff00ff; add.u32 at, at, lo; "
        "add.u32 at, at, hi; "
        "and.b32 lo, c, 0x00ff00ff; shr.u32 hi, c, 8; and.b32 hi, hi, 0x00ff00ff; add.u32 at, at, lo; "
        "add.u32 at, at, hi; "
        "and.b32 lo, d, 0x00ff00ff; shr.u32 hi, d, 8; and.b32 hi, hi, 0x00ff00ff; add.u32 at, at, lo; "
        "add.u32 at, at, hi; "
        "and.b32 lo, at, 0xffff; shr.u32 hi, at, 16; add.u32 at, lo, hi; "
        "redux.sync.add.u32 $0, at, 0xffffffff; }",
        "=r,r", [planes], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _start_lane_copies(dst, src, live, lane, REGION: gl.constexpr, CODES: gl.constexpr, V_PHASE: gl.constexpr):
    """Every lane, where live != 0: cp.async of its 16-byte chunks (lane + 32 k) of the REGION bytes at global ``src``
    (int64) into the stage at shared ``dst``, the key and V code lines (CODES bytes each, lines of 128 bytes, 8
    chunks) swizzled as gluon_decode's cp.async stages hold them (chunk c of line l at c ^ (l % 8) for the key codes
    (STAGED_KEYS), c ^ ((l // V_PHASE) % 8) for the V codes (STAGED_V_128: V_PHASE 2; STAGED_V_64: 1)), the scale
    planes as stored; then one commit of the lane's group (empty where not live). Returns 0."""
    for k in gl.static_range((REGION // 16 + 31) // 32):
        at = 16 * (lane + 32 * k)
        in_v = (at >= CODES) & (at < 2 * CODES)
        part = gl.where(in_v, at - CODES, at)  # offset inside the key or V code lines
        line = part // 128
        phase = gl.where(in_v, (line // V_PHASE) % 8, line % 8)
        to = gl.where(at < 2 * CODES, at - part + line * 128 + (((part % 128) // 16) ^ phase) * 16, at)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.cg.shared.global [$1], [$2], 16; mov.u32 $0, 0; }",
            "=r,r,l,r", [dst + to, src + at, ((at < REGION) & (live != 0)).to(gl.int32)], dtype=gl.int32,
            is_pure=False, pack=1)
    return gl.inline_asm_elementwise("cp.async.commit_group; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _store_lane0(ptr, value, lane):
    """Lane 0: store int32 ``value`` at global ``ptr`` (int64 address). Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.s32 p, $3, 0; @p st.global.u32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptr, value, lane], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def compute_stand_in(x, work, jitter, pid, h, i, CHAINS: gl.constexpr):
    """A stand-in for a tile's compute (program pid of KV head h at tile i, starting from the fp32 scalar x):
    ``work`` FMAs in CHAINS (1 or 4) independent dependent chains (one chain: ~2-3 ns per FMA, latency-bound; four:
    the same FMAs in a quarter of the time, issue-bound), or with jitter = 1 work x a pseudo-random factor in
    [0.5, 1.5) per program and tile (programs drifting apart as the decode's do). Returns int32 0 (never 1), which
    the caller adds to what it keeps so that the chains stay."""
    draw = ((pid * 40503 + h * 9973 + i * 65599) >> 4) & 255
    y = x + 1.0
    z = x + 2.0
    w = x + 3.0
    for _ in range((work + jitter * (work * draw // 256 - work // 2)) // CHAINS):
        x = x * 0.999 + 1.0
        if CHAINS == 4:
            y = y * 0.999 + 1.0
            z = z * 0.999 + 1.0
            w = w * 0.999 + 1.0
    return (x + y + z + w < 0.0).to(gl.int32)


@gluon.jit
def _start_tile(dst, src, bar, lane, live, REGION: gl.constexpr, LANE_COPIES: gl.constexpr, CODES: gl.constexpr,
                V_PHASE: gl.constexpr):
    """Start copying one tile's region (global ``src``, int64) into a stage at shared ``dst``: one bulk copy by lane 0
    on mbarrier ``bar``, or with LANE_COPIES every lane's swizzled cp.async chunks as one group
    (_start_lane_copies)."""
    if LANE_COPIES:
        _start_lane_copies(dst, src, live, lane, REGION, CODES, V_PHASE)
    else:
        _start_copy(dst, src, REGION, bar, lane, live)


@gluon.jit
def warp_split_checksum(bt_row, n_tiles, heads, head_base, NSPLIT, work, jitter, pid, h, lane, base,
                        STAGES: gl.constexpr, REGION: gl.constexpr, CHAINS: gl.constexpr, PLANES: gl.constexpr,
                        LANE_COPIES: gl.constexpr = False, CODES: gl.constexpr = 0, V_PHASE: gl.constexpr = 1):
    """The calling warp as split program pid of a (request, KV head h) pair: copies tiles [lo, hi) of the request's
    n_tiles blocks (block ids at bt_row, int32; the pair's regions at head_base + block x heads x REGION, int64
    address) through its own ring at shared address ``base`` (STAGES regions, then STAGES mbarriers in
    BARRIER_SLOT-byte slots), reading each landed tile's scale planes (at byte PLANES of the region); work / jitter /
    CHAINS: compute_stand_in after each tile. The copies: one bulk copy per tile, or with LANE_COPIES every lane's
    cp.async chunks into the swizzled code lines of gluon_decode's cp.async stages (CODES bytes of key codes, then
    of V codes; V_PHASE: STAGED_V_128's 2 lines per swizzle phase, or STAGED_V_64's 1). Returns the checksum of the
    plane bytes it read (int32, the same in every lane of the warp; 0 for an empty split)."""
    per_split = gl.cdiv(n_tiles, NSPLIT)
    lo = gl.minimum(pid * per_split, n_tiles)
    hi = gl.minimum(lo + per_split, n_tiles)
    bars = base + STAGES * REGION
    for s in gl.static_range(STAGES):
        _init_barrier(bars + BARRIER_SLOT * s, lane)
    for s in gl.static_range(STAGES - 1):
        blk = gl.load(bt_row + lo + s, mask=lo + s < hi, other=0)
        _start_tile(base + s * REGION, head_base + blk.to(gl.int64) * heads * REGION, bars + BARRIER_SLOT * s, lane,
                    (lo + s < hi).to(gl.int32), REGION, LANE_COPIES, CODES, V_PHASE)
    seen = lane * 0
    for i in range(lo, hi):
        stage = (i - lo) % STAGES
        refill = (stage + STAGES - 1) % STAGES  # read one tile ago, every lane synced since
        ahead = i + STAGES - 1
        blk = gl.load(bt_row + ahead, mask=ahead < hi, other=0)
        _start_tile(base + refill * REGION, head_base + blk.to(gl.int64) * heads * REGION,
                    bars + BARRIER_SLOT * refill, lane, (ahead < hi).to(gl.int32), REGION, LANE_COPIES, CODES,
                    V_PHASE)
        if LANE_COPIES:
            _wait_groups(STAGES - 1)
        else:
            _wait_landed(bars + BARRIER_SLOT * stage, ((i - lo) // STAGES) % 2)
        seen += _read_planes(base + stage * REGION + PLANES)
        if work > 0:
            seen += compute_stand_in(seen.to(gl.float32), work, jitter, pid, h, i, CHAINS)
    return seen


@gluon.jit
def raw_base(WARPS: gl.constexpr):
    """The kernel's one Gluon allocation, KEEP_PER_WARP x WARPS bytes at offset 0 of global_smem, kept by one Gluon
    store; returns the shared address right after it (int32), where the raw bytes that raw_launch adds begin (see the
    module docstring)."""
    KEEP: gl.constexpr = KEEP_PER_WARP * WARPS
    keep = gl.allocate_shared_memory(gl.int8, [KEEP], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    keep.store(gl.zeros([KEEP], gl.int8, gl.BlockedLayout([1], [32], [WARPS], [0])))
    return _shared_base() + KEEP


@gluon.jit
def copy_warps_kernel(bt_ptr, stride_bt, n_tiles, heads, out_ptr, cache_ptr, NSPLIT, work, jitter,
                      STAGES: gl.constexpr, REGION: gl.constexpr, WARPS: gl.constexpr, CHAINS: gl.constexpr,
                      PLANES: gl.constexpr, LANE_COPIES: gl.constexpr, CODES: gl.constexpr, V_PHASE: gl.constexpr):
    """Grid (B, Hkv, cdiv(NSPLIT, WARPS)), WARPS warps per CTA: warp w of CTA c is split program p = c x WARPS + w
    (none past NSPLIT) of (b, h) and copies its split of the request's n_tiles blocks (block ids in bt_ptr [B,
    >= n_tiles] int32, row stride stride_bt) from cache_ptr [blocks, heads, REGION] uint8 (warp_split_checksum, whose
    LANE_COPIES / CODES / V_PHASE choose and shape the copies).
    Stores the checksum of the plane bytes it read (as 32-bit words), [B, Hkv, NSPLIT] int32 at out_ptr. Launched by
    raw_launch with ring_bytes of raw shared memory."""
    rings = raw_base(WARPS)
    b = gl.program_id(0)
    h = gl.program_id(1)
    lane, warp = _lane_and_warp()
    pid = gl.program_id(2) * WARPS + warp
    base = rings + warp * (STAGES * (REGION + BARRIER_SLOT))
    seen = warp_split_checksum(bt_ptr + b.to(gl.int64) * stride_bt, n_tiles, heads,
                               cache_ptr.to(gl.int64, bitcast=True) + h.to(gl.int64) * REGION, NSPLIT, work, jitter,
                               pid, h, lane, base, STAGES, REGION, CHAINS, PLANES, LANE_COPIES, CODES, V_PHASE)
    if pid < NSPLIT:
        slot = out_ptr.to(gl.int64, bitcast=True) + 4 * ((b * gl.num_programs(1) + h) * NSPLIT + pid).to(gl.int64)
        _store_lane0(slot, seen, lane)


def lane_copy_destination(at: int, codes: int, v_phase: int) -> int:
    """Where _start_lane_copies puts the 16-byte chunk at byte ``at`` of a region (its arithmetic, in Python, for
    tests/test_copy_shapes.py to hold against Gluon's own layouts of the staged code lines)."""
    in_v = codes <= at < 2 * codes
    part = at - codes if in_v else at
    line = part // 128
    phase = (line // v_phase) % 8 if in_v else line % 8
    return at - part + line * 128 + (((part % 128) // 16) ^ phase) * 16 if at < 2 * codes else at


def add_stand_in_arguments(parser, work: list[int], chains: list[int], jitter: list[int], note: str = "") -> None:
    """--work / --chains / --jitter: the values of compute_stand_in's work, CHAINS and jitter a script sweeps (with
    these defaults); note: what the help of --work adds (which shapes take the stand-in)."""
    parser.add_argument("--work", type=int, nargs="+", default=work,
                        help=f"{note}FMAs of a compute stand-in after each tile lands (0 = none)")
    parser.add_argument("--chains", type=int, nargs="+", default=chains, choices=(1, 4),
                        help="the stand-in's FMAs in 1 dependent chain (latency-bound) or 4 (issue-bound)")
    parser.add_argument("--jitter", type=int, nargs="+", default=jitter, choices=(0, 1),
                        help="1 = the stand-in's length varies per program and tile by a factor in [0.5, 1.5)")


def printed_when_compiled(kernel, constants: dict) -> list[str]:
    """The lines a Gluon kernel taking only constexprs prints while it is traced (gl.static_print), compiled for
    sm_90 without a GPU and without Triton's cache (a cached kernel is not traced again)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    source = GluonASTSource(fn=kernel, signature={name: "constexpr" for name in names},
                            constexprs={(names.index(k),): v for k, v in constants.items()})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), triton.knobs.compilation.scope():
        triton.knobs.compilation.always_compile = True
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    return printed.getvalue().splitlines()


@gluon.jit
def _staged_line_layouts(KEYS: gl.constexpr, V_128: gl.constexpr, V_64: gl.constexpr):
    """Prints (gl.static_print) the shared linear layouts of gluon_decode's staged code lines."""
    gl.static_print("LAYOUT keys_128", gl.to_linear_layout(KEYS, [16, 128]))
    gl.static_print("LAYOUT v_128", gl.to_linear_layout(V_128, [16, 64]))
    gl.static_print("LAYOUT keys_64", gl.to_linear_layout(KEYS, [8, 128]))
    gl.static_print("LAYOUT v_64", gl.to_linear_layout(V_64, [8, 64]))


def staged_line_layouts() -> dict[str, list[list[int]]]:
    """{part: offset bases} of gluon_decode's staged code lines (key codes as [lines, 128] uint8, V codes as [lines,
    64] int16, at head_dim 128 and 64): bit i of an element's offset in the stage XORs its (line, column) with base
    i (Gluon's SharedLinearLayout)."""
    from vllm_oscar.kernels import gluon_decode

    lines = printed_when_compiled(_staged_line_layouts, dict(KEYS=gluon_decode.STAGED_KEYS,
                                                             V_128=gluon_decode.STAGED_V_128,
                                                             V_64=gluon_decode.STAGED_V_64))
    return {line.split()[1]: json.loads(line.split("offset_bases=")[1].split(", block_bases")[0])
            for line in lines if line.startswith("LAYOUT ")}


def ring_bytes(warps: int, stages: int, region: int) -> int:
    """copy_warps_kernel's raw shared memory: per warp, its stages' regions and their mbarriers."""
    return warps * stages * (region + BARRIER_SLOT.value)


def allow_shared(function: int, nbytes: int) -> None:
    """Let a loaded kernel take nbytes of dynamic shared memory (above 48 KB the driver asks for it explicitly)."""
    status = ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(
        ctypes.c_void_p(function), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes))
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute(max dynamic shared memory = {nbytes}) failed with CUresult {status}")


def raw_launch(kernel, grid: tuple[int, int, int], args: list, constants: dict, raw_bytes: int, cluster: int = 1):
    """A launcher of a Gluon kernel that uses raw_base over ``grid`` CTAs, with raw_bytes of shared memory past its
    own, in clusters of ``cluster`` CTAs along grid x (1: none; grid x a multiple of it). The kernel is compiled for
    one CTA per program (num_ctas 1: program_id(0) is ctaid.x, and %cluster_ctarank = ctaid.x % cluster); Triton's
    launcher, given num_ctas = cluster in the packed metadata, multiplies the grid x it is passed (grid x / cluster)
    by it and sets the cluster dimension (16: non-portable, enabled). args: the kernel's leading non-constexpr
    arguments; constants: its constexprs and num_warps. Returns a no-argument callable (graph-capturable: it
    launches on the current stream)."""
    values = args + [constants[name] for name in kernel.arg_names[len(args):]]  # the launcher skips constexprs
    compiled = kernel.warmup(*args, grid=grid, **constants)
    compiled._init_handles()
    shared = compiled.metadata.shared + raw_bytes
    allow_shared(compiled.function, shared)
    packed = (compiled.metadata.num_warps, cluster, shared)
    x, y, z = grid

    def launch() -> None:
        compiled.run(x // cluster, y, z, torch.cuda.current_stream().cuda_stream, compiled.function, packed, None,
                     None, None, *values)

    return launch
