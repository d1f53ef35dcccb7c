"""Worker-side consistency check of the BF16 window store (issue 5), for the end-to-end tests.

Every BF16 row that OSCAR attention reads must be the copy of the token whose INT2 row sits at
the same position of the paged cache. The check assigns the copy to the STORED grid of that
INT2 row (code = clamp(round((x - offset) / scale), 0, 3) with the row's own scale and offset,
the assign step of the write quantizer) and compares with the stored codes: the same token
differs only where the copy's bf16 rounding crosses a decision boundary; a stale copy (a freed
and rewritten block, a wrong physical-block mapping after preemption or a prefix hit) holds
another token and disagrees on most codes. This holds for any batch composition and chunking,
so unlike greedy identity it is not blurred by vLLM's CPU GEMMs, which are not batch invariant
(docs/design.md); and unlike re-running the write quantizer it does not depend on the grid
refit, whose floored key rounds can land on another (equally valid) grid after a bf16-sized
change of the input (seen with 8 key rounds: up to 23% of a row's codes).

    llm.collective_rpc(install)            # wraps oscar_decode / oscar_prefill as attention.step calls them
    ...generate...
    (report,) = llm.collective_rpc(report)

ROW_MISMATCH = 0.2 separates the two cases; tests/test_window_check.py measures both sides.
"""

from __future__ import annotations

from typing import Any

#: A read BF16 row whose K codes on the stored grid differ from the stored codes in more than
#: this share of (head, dim) entries is counted as stale.
ROW_MISMATCH = 0.2


def install(worker: Any) -> int:
    """Wrap the attention calls of ``worker`` with the check; returns the OSCAR layers found."""
    import torch

    import vllm_oscar.attention.step as backend
    from vllm_oscar.kernels.layout import page_views
    from vllm_oscar.quant import unpack_codes

    context = worker.vllm_config.compilation_config.static_forward_context
    # OSCAR impls have a window store attribute; the store itself is allocated at their first forward.
    layers = sum(hasattr(getattr(layer, "impl", None), "window_k") for layer in context.values())
    stats = {"rows": 0, "stale": 0, "worst_mismatch": 0.0, "calls": 0}
    worker._oscar_window_check = stats

    def check(cache, window_k, layout, block_table, window_block_table, seq_lens, sink, recent, firsts):
        views = page_views(cache, layout)
        bs, hkv = layout.block_size, cache.shape[1]
        for request, (length, first) in enumerate(zip(seq_lens.tolist(), firsts)):
            num_blocks = -(-length // bs)
            windows = window_block_table[request, :num_blocks].long().cpu()
            s = torch.arange(length)
            # positions some query of this step reads in BF16 (the read rule of torch_ops._attend)
            read = ((s < sink) | (s > first - recent)) & (windows >= 0).repeat_interleave(bs)[:length]
            positions = s[read]
            if positions.numel() == 0:
                continue
            blocks = block_table[request, :num_blocks].long()
            def at_positions(plane: torch.Tensor) -> torch.Tensor:  # [nb, Hkv, bs, W] -> [Hkv, n, W]
                flat = plane[blocks].transpose(0, 1).reshape(hkv, num_blocks * bs, -1)
                return flat[:, positions.to(flat.device)]

            stored = unpack_codes(at_positions(views.k_codes))  # [Hkv, n, D]
            scale = at_positions(views.k_scale).float()  # [Hkv, n, groups]
            offset = at_positions(views.k_offset).float()
            rows = window_k[windows.clamp(min=0).to(window_k.device)].reshape(num_blocks * bs, hkv, -1)
            rows = rows[positions.to(rows.device)].to(torch.float32).transpose(0, 1)  # [Hkv, n, D]
            grouped = rows.reshape(*rows.shape[:2], layout.groups, layout.group_size)
            on_grid = ((grouped - offset[..., None]) / scale[..., None]).round().clamp(0, 3).reshape(rows.shape)
            mismatch = (on_grid != stored.float()).float().mean(dim=(0, 2))
            stats["rows"] += int(positions.numel())
            stats["stale"] += int((mismatch > ROW_MISMATCH).sum())
            stats["worst_mismatch"] = max(stats["worst_mismatch"], float(mismatch.max()))
        stats["calls"] += 1

    decode, prefill = backend.oscar_decode, backend.oscar_prefill

    def checked_decode(q, cache, wk, wv, layout, bt, wbt, seq_lens, sink, recent, scale, **kw):
        check(cache, wk, layout, bt, wbt, seq_lens, sink, recent, [n - 1 for n in seq_lens.tolist()])
        return decode(q, cache, wk, wv, layout, bt, wbt, seq_lens, sink, recent, scale, **kw)

    def checked_prefill(q, k, v, cache, wk, wv, layout, bt, wbt, qsl, seq_lens, sink, recent, scale, **kw):
        starts = qsl.tolist()
        firsts = [n - (starts[i + 1] - starts[i]) for i, n in enumerate(seq_lens.tolist())]
        check(cache, wk, layout, bt, wbt, seq_lens, sink, recent, firsts)
        return prefill(q, k, v, cache, wk, wv, layout, bt, wbt, qsl, seq_lens, sink, recent, scale, **kw)

    backend.oscar_decode, backend.oscar_prefill = checked_decode, checked_prefill
    return layers


def report(worker: Any) -> dict[str, Any]:
    """Rows checked, stale rows, the worst per-row code mismatch, checked calls."""
    return dict(getattr(worker, "_oscar_window_check", {}))
