"""One `bench decode` cell set up for timing gluon_decode's kernel by parts: the served decode's case (blocks of 64,
as many layers as `bench decode` uses), its launch plan, the partial buffers, and launches of the Gluon kernel and of
the whole decode call per layer."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Optional

import torch

from vllm_oscar.config import DEFAULT_RECENT_TOKENS, DEFAULT_SINK_TOKENS
from vllm_oscar.kernels import PageLayout, triton_ops
from vllm_oscar.kernels.benchmark import GEOMETRIES, OscarCase, layers_for, make_oscar_case

#: Cache blocks of the served decode on CUDA (gluon_decode's tile).
BLOCK_SIZE = 64
#: Returned by gluon_case where the plan runs int2_split_kernel instead.
NOT_GLUON = "gluon_decode's kernel does not run in this case (triton_ops.gluon_pays)"


@dataclasses.dataclass
class GluonCase:
    """A decode cell and its plan. part: [B, Hq, plan.total, D] fp32 and lse: [B, Hq, plan.total] fp32, the
    partials every launch writes; outs: one [B, Hq, D] output per layer."""

    case: OscarCase
    plan: object
    config: triton_ops.AttentionConfig
    layers: int
    length: int
    part: torch.Tensor
    lse: torch.Tensor
    outs: list[torch.Tensor]
    sink: int = DEFAULT_SINK_TOKENS
    recent: int = DEFAULT_RECENT_TOKENS

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.case.query.shape[-1])

    def kernel(self, i: int, programs: int, nsplit: int, seq_lens: Optional[torch.Tensor] = None,
               kernel=None) -> None:
        """Layer i's Gluon kernel over grid axis 2 = programs, the first nsplit of them split programs; kernel: a
        variant with the same arguments (default: triton_ops' gluon_decode kernel)."""
        c = self.case
        args = triton_ops._split_args(c.query, c.caches[i], c.window_k[i], c.window_v[i], c.block_table,
                                      c.window_block_table, c.seq_lens if seq_lens is None else seq_lens, self.part,
                                      self.lse, self.sink, self.recent, self.scale,
                                      triton_ops._gluon_descriptors(c.caches[i], c.layout, self.plan.gluon_tma))
        batch, hkv = c.block_table.shape[0], c.caches[i].shape[1]
        (kernel or triton_ops._gluon_kernel())[(batch, hkv, programs)](*args, nsplit, **self.plan.split_consts)

    def decode(self, i: int) -> None:
        """Layer i's whole decode call (split kernel and merge), as served."""
        c = self.case
        triton_ops.oscar_decode(c.query, c.caches[i], c.window_k[i], c.window_v[i], c.layout, c.block_table,
                                c.window_block_table, c.seq_lens, self.sink, self.recent, self.scale,
                                out=self.outs[i], max_seq_len=self.length, config=self.config)


def gluon_case(geometry: str, length: int, batch: int, device: torch.device) -> Optional[GluonCase]:
    """The cell's case and plan (seeded as `bench decode` seeds it), or None where the plan is not gluon_decode's."""
    hq, hkv, dim = GEOMETRIES[geometry]
    layers = layers_for(batch * hkv * length * PageLayout(dim, dim, BLOCK_SIZE, torch.float16).token_bytes)
    case = make_oscar_case(batch, length, hq, hkv, dim, BLOCK_SIZE, layers, device,
                           torch.Generator(device=device).manual_seed(length * 131 + batch))
    config = dataclasses.replace(triton_ops.DEFAULT_DECODE, cuda_graph=True)
    plan = triton_ops._cached_plan(case.query, case.caches[0], case.window_k[0], case.window_v[0], case.layout,
                                   case.block_table, case.window_block_table, case.seq_lens, DEFAULT_SINK_TOKENS,
                                   DEFAULT_RECENT_TOKENS, 1.0 / math.sqrt(dim), length, config)
    if not (plan.split_int2 and plan.gluon_splits):
        return None
    part = torch.empty(batch, hq, plan.total, dim, dtype=torch.float32, device=device)
    lse = torch.empty(batch, hq, plan.total, dtype=torch.float32, device=device)
    return GluonCase(case, plan, config, layers, length, part, lse, [torch.empty_like(case.query)
                                                                     for _ in range(layers)])


def write_rows(path: Optional[str], rows: list[dict]) -> None:
    """The rows as JSON at path (nothing without one), with the device's name and the command line."""
    if path:
        with open(path, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "argv": sys.argv, "rows": rows}, handle, indent=1)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """--reps (graph replays per timing) and --json (where write_rows writes)."""
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", metavar="OUT", help="also write the rows to this JSON file")


def finish(path: Optional[str], rows: list[dict], failures: list[str], failure: str) -> int:
    """The script's exit status after writing its rows (write_rows): 0, or 1 with ``failure`` and the failed cases
    on stderr where there are any."""
    write_rows(path, rows)
    if failures:
        print(f"{failure}: {'; '.join(failures)}", file=sys.stderr)
        return 1
    return 0


def cuda_device(refusal: str) -> torch.device:
    """The CUDA device, or exit with ``refusal`` (what the script times and that no GPU is visible)."""
    if not torch.cuda.is_available():
        raise SystemExit(refusal)
    return torch.device("cuda")
