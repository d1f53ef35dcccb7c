"""The paged INT2 block layout: plane offsets, alignment, typed views."""

import pytest
import torch

from vllm_oscar.kernels.layout import PLANES, PageLayout, page_views


@pytest.mark.parametrize("head_dim,group,block,dtype", [(128, 128, 16, torch.float16), (64, 64, 32, torch.bfloat16),
                                                        (64, 32, 16, torch.float32), (256, 64, 128, torch.float16)])
def test_planes_tile_the_region_without_overlap(head_dim, group, block, dtype) -> None:
    layout = PageLayout(head_dim, group, block, dtype)
    sizes = {"k_codes": head_dim // 4, "v_codes": head_dim // 4}
    item = torch.empty((), dtype=dtype).element_size()
    for name in PLANES[2:]:
        sizes[name] = head_dim // group * item
    end = 0
    for name in PLANES:
        assert layout.plane_offset(name) == end and end % 4 == 0
        end += block * sizes[name]
    assert end == layout.head_region_bytes == block * layout.token_bytes


def test_views_address_the_documented_bytes() -> None:
    layout = PageLayout(64, 32, 16, torch.float32)
    cache = layout.allocate(2, 3)
    views = page_views(cache, layout)
    views.v_offset[1, 2, 15, 1] = 3.0
    views.k_codes[0, 1, 4, 7] = 0xA5
    flat = cache.reshape(-1)
    region = layout.head_region_bytes
    byte = (1 * 3 + 2) * region + layout.plane_offset("v_offset") + (15 * 2 + 1) * 4
    assert flat[byte : byte + 4].view(torch.float32).item() == 3.0
    assert flat[(0 * 3 + 1) * region + 4 * 16 + 7].item() == 0xA5
    assert int((flat != 0).sum()) == 2 + 1  # 3.0f has two zero bytes and 2 non-zero; 0xA5 one


def test_layout_rejects_bad_geometry_and_caches() -> None:
    with pytest.raises(ValueError, match="head_dim=96"):
        PageLayout(96, 96, 16)
    with pytest.raises(ValueError, match="block_size=0"):
        PageLayout(64, 64, 0)
    layout = PageLayout(64, 64, 16)
    with pytest.raises(ValueError, match="cache must be uint8"):
        page_views(torch.zeros(2, 3, 10, dtype=torch.uint8), layout)
