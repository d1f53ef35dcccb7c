"""Inline-PTX pieces of a split-K merge inside a Hopper thread-block cluster, for Gluon kernels (sm_90+).

Gluon lowers no cross-CTA reduction (docs/notes/kernels.md "Session 44"), so the programs of one cluster exchange
their partials through distributed shared memory by PTX: each owner CTA initialises an mbarrier that expects the
bytes its peers will push, publishes it to the cluster (fence.mbarrier_init + a relaxed cluster arrive at the
kernel's start), and after their work the peers write their partials' elements straight into the owners' shared
memory with st.async, each write completing 4 bytes of the owner's mbarrier; every owner then waits on its own
mbarrier and merges locally. No GPU-scope fence and no second cluster barrier (docs/notes/kernels.md "Session 45").

The shared-memory bytes these helpers address lie past everything Gluon allocates (cluster_launch gives the kernel
that room at a runtime offset); addresses are 32-bit shared-window addresses (int32 tensors or scalars).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

#: Tries of an mbarrier wait before the kernel traps: at >= ~50 ns a try, >= ~3 ms, far past the microseconds that
#: the slowest program of a cluster keeps its peers waiting; a push lost or miscounted then ends the launch with an
#: error instead of hanging the GPU.
WAIT_TRIES: gl.constexpr = gl.constexpr(1 << 16)
#: Bytes of declared_shared_base's allocation (one per lane of a warp).
KEEP_BYTES: gl.constexpr = gl.constexpr(32)


@gluon.jit
def lane_id():
    """The calling thread's lane in its warp, an int32 scalar."""
    return gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def shared_base():
    """The shared-window address of the kernel's dynamic shared memory (global_smem: Triton's name for it), int32.
    Triton declares global_smem only in kernels that allocate shared memory: see declared_shared_base. Not pure, so
    that a kernel asking for it again after a loop gets it anew (one instruction) instead of a register held
    across the loop."""
    return gl.inline_asm_elementwise("mov.b32 $0, global_smem;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def declared_shared_base():
    """shared_base in a kernel of one warp that may allocate no shared memory of its own: a KEEP_BYTES Gluon
    allocation, kept by one store, makes Triton declare global_smem (and counts in the compiled kernel's
    metadata.shared, so bytes addressed past that stay clear of it)."""
    keep = gl.allocate_shared_memory(gl.int8, [KEEP_BYTES], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    keep.store(gl.zeros([KEEP_BYTES], gl.int8, gl.BlockedLayout([1], [32], [1], [0])))
    return shared_base()


@gluon.jit
def init_receiver(bar, nbytes, leader):
    """Where ``leader`` is true (one thread of the CTA): the mbarrier at shared ``bar`` expecting one arrival,
    fenced for the cluster, and that arrival made with ``nbytes`` of transactions expected (the peers' pushes
    complete them). Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p mbarrier.init.shared::cta.b64 [$1], 1; "
        "@p fence.mbarrier_init.release.cluster; @p mbarrier.arrive.expect_tx.shared::cta.b64 _, [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,r,r,r", [bar, nbytes, leader.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def cluster_arrive_relaxed():
    """Every thread: arrive on the cluster barrier without ordering (the mbarrier inits before it are published by
    init_receiver's fence.mbarrier_init)."""
    gl.inline_asm_elementwise("barrier.cluster.arrive.relaxed.aligned; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def cluster_wait():
    """Every thread: wait until every thread of the cluster has arrived (so every owner's mbarrier is initialised)."""
    gl.inline_asm_elementwise("barrier.cluster.wait.acquire.aligned; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def push_f32(address, value, bar, rank, live):
    """Elementwise, where live != 0: write fp32 ``value`` into shared ``address`` of CTA ``rank`` of the cluster,
    completing 4 bytes of that CTA's mbarrier at shared ``bar`` (st.async: no fence, no wait). Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 a, m; setp.ne.s32 p, $5, 0; @p mapa.shared::cluster.u32 a, $1, $4; "
        "@p mapa.shared::cluster.u32 m, $3, $4; "
        "@p st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [a], $2, [m]; mov.u32 $0, 0; }",
        "=r,r,f,r,r,r", [address, value, bar, rank, live], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def wait_phase(bar):
    """Every thread: wait until the mbarrier at shared ``bar`` completes its phase 0, acquiring at cluster scope what
    the peers' pushes wrote, or trap after WAIT_TRIES tries. Returns 0."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred done; .reg .u32 n; mov.u32 n, 0; "
        "waiting: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [$1], 0; @done bra landed; "
        "add.u32 n, n, 1; setp.lt.u32 done, n, $2; @done bra waiting; trap; landed: mov.u32 $0, 0; }",
        "=r,r,r", [bar, WAIT_TRIES], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def load_shared_f32(address, live, other):
    """Elementwise: the fp32 at this CTA's shared ``address`` where live != 0, else ``other`` (nothing read)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.b32 $0, $3; @p ld.shared.f32 $0, [$1]; }",
        "=f,r,r,f", [address, live, other], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def merge_slots(values, lse):
    """The exact log-sum-exp merge of [S, C] partial values weighted by 2^lse ([S, C]; -inf: an empty slot, weight
    0) over axis 0: [C] fp32, 0 where every slot is empty."""
    top = gl.max(lse, axis=0)
    weight = gl.exp2(lse - gl.where(top == float("-inf"), 0.0, top)[None, :])
    total = gl.sum(weight, axis=0)
    return gl.sum(values * weight, axis=0) / gl.where(total > 0.0, total, 1.0)
