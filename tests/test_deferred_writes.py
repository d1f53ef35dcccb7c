"""When captured decode steps may leave their side-stream INT2 writes to the end of the forward
(vllm_oscar.attention.deferred_writes.deferral_blocker), on vLLM's own CompilationConfig objects.

A deferred write reads the layer's key and value after the attention op returns. The caching allocator keeps
them (record_stream); an Inductor graph that contains the attention op may hand their buffer to a later op of
the same graph. So deferral needs the attention op outside Inductor graphs: no compilation, or vLLM's
Dynamo-level split at the attention op (its default), or Dynamo with its "eager" backend."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import CompilationConfig, CompilationMode  # noqa: E402

from vllm_oscar.attention.deferred_writes import ATTENTION_OP, deferral_blocker  # noqa: E402


def _config(**fields) -> CompilationConfig:
    config = CompilationConfig()
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def test_vllms_piecewise_split_and_no_inductor_allow_deferral():
    assert deferral_blocker(_config(mode=CompilationMode.NONE, splitting_ops=[])) is None
    assert deferral_blocker(_config(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager", splitting_ops=[])) is None
    split = [ATTENTION_OP, "vllm::unified_mla_attention_with_output"]
    assert deferral_blocker(_config(mode=CompilationMode.VLLM_COMPILE, splitting_ops=split,
                                    use_inductor_graph_partition=False)) is None


@pytest.mark.parametrize("fields, named", [
    (dict(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[ATTENTION_OP], use_inductor_graph_partition=True),
     "use_inductor_graph_partition"),
    (dict(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[], use_inductor_graph_partition=False), "splitting_ops"),
    (dict(mode=CompilationMode.VLLM_COMPILE, splitting_ops=None, use_inductor_graph_partition=False),
     "splitting_ops"),
    (dict(mode=CompilationMode.STOCK_TORCH_COMPILE, backend="inductor", splitting_ops=[ATTENTION_OP]),
     "STOCK_TORCH_COMPILE"),
])
def test_attention_inside_an_inductor_graph_blocks_deferral_and_says_why(fields, named):
    reason = deferral_blocker(_config(**fields))
    assert reason is not None and named in reason
