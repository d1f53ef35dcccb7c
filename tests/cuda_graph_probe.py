"""Worker-side count of vLLM's full CUDA graphs: captured, and replayed since ``install``.

    llm.collective_rpc(install)          # in the worker: counts replays of every torch.cuda.CUDAGraph
    ...generate...
    (counts,) = llm.collective_rpc(counts)

A full graph is one that vLLM's ``CUDAGraphWrapper`` with runtime mode FULL captured (the
whole model forward, attention included); PIECEWISE graphs (the pieces between attention
calls of compiled models) are counted apart. Shipped to the worker by value (cloudpickle).
"""

from __future__ import annotations

from typing import Any


def _graphs(mode_name: str) -> list[Any]:
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    return [entry.cudagraph for wrapper in list(CUDAGraphWrapper._all_instances)
            if wrapper.runtime_mode.name == mode_name
            for entry in wrapper.concrete_cudagraph_entries.values() if entry.cudagraph is not None]


def install(worker: Any) -> int:
    """Count replays per graph from now on; returns the number of full graphs captured so far."""
    import torch

    replays: dict[int, int] = {}
    worker._oscar_graph_replays = replays
    graph_class = torch.cuda.CUDAGraph
    original = getattr(graph_class, "_oscar_original_replay", graph_class.replay)

    def replay(self, *args, **kwargs):
        replays[id(self)] = replays.get(id(self), 0) + 1
        return original(self, *args, **kwargs)

    graph_class._oscar_original_replay = original
    graph_class.replay = replay
    return len(_graphs("FULL"))


def counts(worker: Any) -> dict[str, int]:
    """Full and piecewise graphs captured, and their replays since ``install``."""
    replays = getattr(worker, "_oscar_graph_replays", {})
    full, piecewise = _graphs("FULL"), _graphs("PIECEWISE")
    return {"full_captured": len(full), "full_replays": sum(replays.get(id(g), 0) for g in full),
            "piecewise_captured": len(piecewise),
            "piecewise_replays": sum(replays.get(id(g), 0) for g in piecewise)}
