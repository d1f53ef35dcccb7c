"""The user's OSCAR options (additional_config["oscar"]) and the int8 key and FlashAttention prefill options'
checks."""

from __future__ import annotations

import pytest
import torch

from vllm_oscar.attention.settings import config_from_options
from vllm_oscar.config import SERVED_REFIT_ITERATIONS
from vllm_oscar.kernels import PageLayout, oscar_decode, oscar_prefill

from kernels_reference import random_paged_state


def test_defaults_and_explicit_values() -> None:
    assert config_from_options({}).int8_keys is None
    assert config_from_options({}).refit_iterations == SERVED_REFIT_ITERATIONS
    assert config_from_options({}).fold_rotations == "output"
    assert config_from_options({}).flash_prefill is None
    config = config_from_options({"int8_keys": False, "refit_iterations": [4, 1], "sink_tokens": 32,
                                  "fold_rotations": "none", "flash_prefill": False})
    assert (config.int8_keys, config.refit_iterations, config.sink_tokens, config.fold_rotations,
            config.flash_prefill) == (False, (4, 1), 32, "none", False)


@pytest.mark.parametrize("options,message", [
    ({"int8_keys": "yes"}, "int8_keys='yes' must be true or false"),
    ({"hadamard_only": 1}, "hadamard_only=1 must be true or false"),
    ({"flash_prefill": "auto"}, "flash_prefill='auto' must be true or false"),
    ({"fold_rotations": "values"}, "fold_rotations='values' must be one of"),
    ({"int8_key": True}, r"unknown OSCAR option\(s\) \['int8_key'\]"),
])
def test_bad_options_are_errors(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_options(options)


def test_int8_keys_true_on_the_cpu_path_is_an_error() -> None:
    """The torch (CPU) decode has no int8 key path: asking for it fails instead of being ignored."""
    gen = torch.Generator().manual_seed(1)
    layout = PageLayout(128, 128, 16, torch.float16)
    state = random_paged_state([40], 1, layout, 4, 8, gen)
    query = torch.randn(1, 2, 128, generator=gen).to(torch.bfloat16)
    args = (query, state.cache, state.window_k, state.window_v, layout, state.block_table, state.window_block_table,
            state.seq_lens, 4, 8, 128 ** -0.5)
    with pytest.raises(ValueError, match="int8 key path exists only in the CUDA"):
        oscar_decode(*args, int8_keys=True)
    exact = oscar_decode(*args)
    assert torch.equal(oscar_decode(*args, int8_keys=False), exact)


@pytest.mark.vllm
def test_backend_checks_int8_keys_at_start_up() -> None:
    from vllm_oscar.attention.backend import check_int8_keys

    layout = PageLayout(128, 128, 16, torch.float16)
    check_int8_keys(config_from_options({}), layout, torch.device("cpu"))
    check_int8_keys(config_from_options({"int8_keys": False}), layout, torch.device("cpu"))
    with pytest.raises(ValueError, match="int8_keys=true needs the CUDA decode"):
        check_int8_keys(config_from_options({"int8_keys": True}), layout, torch.device("cpu"))
    check_int8_keys(config_from_options({"int8_keys": True}), PageLayout(64, 64, 16), torch.device("cuda"))  # paired
    with pytest.raises(ValueError, match="head_dim 32"):
        check_int8_keys(config_from_options({"int8_keys": True}), PageLayout(32, 32, 16), torch.device("cuda"))
    with pytest.raises(ValueError, match="group_size 32"):
        check_int8_keys(config_from_options({"int8_keys": True}), PageLayout(128, 32, 16), torch.device("cuda"))


@pytest.mark.vllm
@pytest.mark.parametrize("block_size,device,user_specified,hinted", [
    (16, "cuda", False, True),    # vLLM kept another size than OSCAR's preference (other backends): suggest 64
    (32, "cuda", False, True),
    (16, "cuda", True, False),    # the user chose it
    (64, "cuda", False, False),   # OSCAR's preference: contiguous 64-position regions
    (128, "cuda", False, False),
    (16, "cpu", False, False),    # the torch path reads whole sequences
])
def test_start_up_suggests_blocks_of_64_only_where_vllm_chose_another_gpu_size(block_size, device, user_specified,
                                                                               hinted) -> None:
    from vllm_oscar.attention.backend import block_size_hint
    from vllm_oscar.config import GPU_DECODE_BLOCK_SIZE

    hint = block_size_hint(block_size, torch.device(device), user_specified)
    assert (hint is not None) == hinted
    if hinted:
        assert f"--block-size {GPU_DECODE_BLOCK_SIZE}" in hint and f"blocks of {block_size} positions" in hint


def test_flash_prefill_true_on_the_cpu_path_is_an_error() -> None:
    """The torch (CPU) prefill has no FlashAttention path: asking for it fails instead of being ignored."""
    gen = torch.Generator().manual_seed(2)
    layout = PageLayout(64, 64, 16, torch.float16)
    state = random_paged_state([12], 1, layout, 4, 8, gen)
    query = torch.randn(12, 2, 64, generator=gen).to(torch.bfloat16)
    args = (query, None, None, state.cache, state.window_k, state.window_v, layout, state.block_table,
            state.window_block_table, torch.tensor([0, 12], dtype=torch.int32), state.seq_lens, 4, 8, 0.125)
    with pytest.raises(ValueError, match="FlashAttention prefill runs only on CUDA"):
        oscar_prefill(*args, chunk_from_cache=True, flash=True)
    exact = oscar_prefill(*args, chunk_from_cache=True)
    assert torch.equal(oscar_prefill(*args, chunk_from_cache=True, flash=False), exact)


@pytest.mark.vllm
def test_backend_checks_flash_prefill_at_start_up(monkeypatch) -> None:
    from vllm_oscar.attention import backend

    layout = PageLayout(128, 128, 16, torch.float16)
    backend.check_flash_prefill(config_from_options({}), layout, torch.device("cpu"))
    backend.check_flash_prefill(config_from_options({"flash_prefill": False}), layout, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"flash_prefill=true needs FlashAttention prefill, which cannot run here "
                                         r"\(tensors on cpu, not CUDA\)"):
        backend.check_flash_prefill(config_from_options({"flash_prefill": True}), layout, torch.device("cpu"))
    monkeypatch.setattr("vllm_oscar.kernels.flash_plan.flash_device_unavailable", lambda device: None)
    backend.check_flash_prefill(config_from_options({"flash_prefill": True}), layout, torch.device("cuda"))
    with pytest.raises(ValueError, match="no recent window"):
        backend.check_flash_prefill(config_from_options({"flash_prefill": True, "recent_tokens": 0}), layout,
                                    torch.device("cuda"))



def test_speculative_decoding_is_refused_at_start_up():
    """The metadata builder refuses a speculative config with a message naming the option to remove."""
    from types import SimpleNamespace

    from vllm_oscar.attention.backend import check_no_speculative_decoding

    check_no_speculative_decoding(SimpleNamespace(speculative_config=None))
    with pytest.raises(ValueError, match="does not support speculative decoding \\(got method 'ngram'\\): remove "
                                         "--speculative-config"):
        check_no_speculative_decoding(SimpleNamespace(speculative_config=SimpleNamespace(method="ngram")))
