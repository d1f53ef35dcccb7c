"""Fixed-address device tensors for the window plan of each step (what full CUDA graphs need).

A CUDA graph replays its kernels with the tensor addresses they were captured with. vLLM keeps
its own step inputs (block table, sequence lengths, slot mapping) in persistent buffers; the
window plan that OSCAR adds (window_store.WindowPlan) must live in persistent buffers too, so
the metadata builder writes each step's plan into the same two tensors:

    table         int32 [max_requests, max_blocks]  the window block table; -1 where no entry
    slots         int64 [max_tokens]                the window slot mapping; -1 past the step's tokens
    serial_write  int32 [1]                         1 when the step's attention may read an INT2 code the
                                                    step writes (WindowPlan.newest_read_bf16 False), so
                                                    a captured decode writes INT2 before it, 0 beside it

Rows and slots past the step's own are kept at -1, so the padding rows and tokens of a graph
captured for a larger batch read nothing and write no BF16 copy. No vLLM import.
"""

from __future__ import annotations

import torch

from vllm_oscar.attention.window_store import WindowPlan


class WindowPlanBuffers:
    """The persistent window block table and window slot mapping of one metadata builder."""

    def __init__(self, max_requests: int, max_tokens: int, device: torch.device) -> None:
        if max_requests <= 0 or max_tokens <= 0:
            raise ValueError(f"WindowPlanBuffers needs max_requests > 0 and max_tokens > 0; got {max_requests}, "
                             f"{max_tokens}.")
        self.max_requests = max_requests
        self.device = torch.device(device)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=self.device)
        self.serial_write = torch.ones(1, dtype=torch.int32, device=self.device)
        self.table: torch.Tensor | None = None  # allocated at the first step: its width is the block table's
        self._rows_set = 0  # table rows [0, _rows_set) may hold entries of an earlier step
        self._slots_set = 0  # slots [0, _slots_set) may hold slots of an earlier step

    def load(self, plan: WindowPlan, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one step's plan (and its serial_write flag); return its (window block table [B, max_blocks],
        window slot mapping [num_tokens]) as views of the buffers. num_tokens >= the plan's tokens: the step's token
        count including any CUDA-graph padding, whose slots are -1."""
        rows, width = plan.table_shape
        planned = plan.window_slot_mapping.numel()
        if self.table is None:
            self.table = torch.full((self.max_requests, width), -1, dtype=torch.int32, device=self.device)
        if width != self.table.shape[1]:
            raise ValueError(f"the block table width changed from {self.table.shape[1]} to {width} between steps; "
                             "OSCAR's window table must keep one width (and address) for CUDA graphs.")
        if rows > self.max_requests or not planned <= num_tokens <= self.slots.numel():
            raise ValueError(f"step of {rows} requests and {num_tokens} tokens ({planned} planned) exceeds the window "
                             f"plan buffers ({self.max_requests} requests, {self.slots.numel()} tokens: "
                             "max_num_seqs and max_num_batched_tokens).")
        self.table[: max(rows, self._rows_set)].fill_(-1)
        entries = plan.table_entries.to(self.device)
        self.table[entries[0], entries[1]] = entries[2].to(torch.int32)
        self.slots[:planned].copy_(plan.window_slot_mapping)
        self.slots[planned: max(num_tokens, self._slots_set)].fill_(-1)
        self.serial_write.fill_(0 if plan.newest_read_bf16 else 1)
        self._rows_set, self._slots_set = rows, planned
        return self.table[:rows], self.slots[:num_tokens]
