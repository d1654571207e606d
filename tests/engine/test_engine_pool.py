import pytest
import torch

from kvferry.engine import KVPool, PoolConfig, PoolShapeError


def test_pool_shape_and_capacity_come_from_the_tensor():
    config = PoolConfig(
        layers=2, kv_heads=4, head_dim=8, page_size=16, num_pages=10, dtype=torch.bfloat16
    )
    pool = KVPool(config)
    assert tuple(pool.kv.shape) == (10, 2, 2, 4, 16, 8)
    assert pool.kv.is_contiguous() and pool.kv.dtype == torch.bfloat16
    assert pool.capacity_tokens == 160
    assert pool.page_bytes == config.page_bytes == 2 * 2 * 4 * 16 * 8 * 2


def test_capacity_is_measured_not_declared():
    """Capacity follows the tensor that exists, not the config that asked for it."""
    config = PoolConfig(layers=1, kv_heads=1, head_dim=4, page_size=4, num_pages=8)
    pool = KVPool(config)
    pool.kv = pool.kv[:3]  # what an allocation that came up short would look like
    assert pool.capacity_tokens == 3 * 4 < config.declared_tokens


def test_for_tokens_uses_whole_pages():
    config = PoolConfig.for_tokens(681280, page_size=16)
    assert config.num_pages == 42580 and config.declared_tokens == 681280
    assert PoolConfig.for_tokens(100, page_size=16).declared_tokens == 96
    with pytest.raises(ValueError):
        PoolConfig.for_tokens(8, page_size=16)


@pytest.mark.parametrize("bad", [dict(layers=0), dict(page_size=-1), dict(dtype=torch.int32)])
def test_config_rejects_bad_values(bad):
    args = dict(layers=1, kv_heads=1, head_dim=4, page_size=4, num_pages=2) | bad
    with pytest.raises(ValueError):
        PoolConfig(**args)


def test_from_buffer_views_without_copy():
    config = PoolConfig(
        layers=2, kv_heads=2, head_dim=4, page_size=4, num_pages=3, dtype=torch.float16
    )
    buffer = torch.zeros(config.total_bytes + 64, dtype=torch.uint8)
    pool = KVPool.from_buffer(config, buffer)
    pool.kv[1, 0, 1, 1, 2, 3] = 1.5
    assert pool.kv.data_ptr() == buffer.data_ptr()
    assert buffer.count_nonzero() > 0
    with pytest.raises(PoolShapeError):
        KVPool.from_buffer(config, torch.zeros(config.total_bytes - 1, dtype=torch.uint8))


def test_page_view_and_bounds():
    pool = KVPool(PoolConfig(layers=1, kv_heads=1, head_dim=4, page_size=4, num_pages=2))
    assert tuple(pool.page_view(1).shape) == (1, 2, 1, 4, 4)
    assert pool.page_byte_range(1) == (pool.page_bytes, pool.page_bytes)
    with pytest.raises(IndexError):
        pool.page_view(2)


def test_expandable_segment_settings_are_read():
    from kvferry.engine.pool import expandable_segments_requested as on

    assert on("expandable_segments:True") and on("max_split_size_mb:64, expandable_segments:true")
    assert not on("") and not on("expandable_segments:False") and not on("backend:native")


def test_a_cpu_pool_reports_host_allocation_and_measured_capacity():
    pool = KVPool(PoolConfig(1, 2, 8, 16, 5))
    assert pool.allocation == {"kind": "host"} and pool.capacity_tokens == 80


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA pool needs a CUDA device")
def test_a_cuda_pool_is_one_plain_allocation_with_measured_capacity():  # pragma: no cover
    pool = KVPool(PoolConfig(2, 8, 128, 16, 64, torch.bfloat16, device="cuda"))
    assert pool.kv.is_cuda and pool.capacity_tokens == 64 * 16
    assert pool.allocation["kind"] == "cuda" and not pool.allocation.get("segment_expandable")
    assert pool.allocation["segment_bytes"] >= pool.nbytes


def test_a_token_major_pool_stores_nhd_and_shows_the_model_hnd():
    """NHD storage: ``storage`` is ``[pages, layers, 2, page_size, heads, head_dim]`` and
    dense; ``kv`` views the same memory in the model's order, so a write through either
    is seen through the other; page bytes and capacity are the HND pool's."""
    from kvferry.engine.reshard import Order

    hnd = KVPool(PoolConfig(2, 3, 4, 8, 5))
    nhd = KVPool(PoolConfig(2, 3, 4, 8, 5, order=Order.NHD))
    assert tuple(nhd.storage.shape) == (5, 2, 2, 8, 3, 4) and nhd.storage.is_contiguous()
    assert tuple(nhd.kv.shape) == tuple(hnd.kv.shape) == (5, 2, 2, 3, 8, 4)
    assert nhd.kv.data_ptr() == nhd.storage.data_ptr()
    assert (nhd.page_bytes, nhd.capacity_tokens) == (hnd.page_bytes, hnd.capacity_tokens)
    nhd.kv[4, 1, 0, 2, 6, :] = torch.arange(4.0)
    assert torch.equal(nhd.storage[4, 1, 0, 6, 2, :], torch.arange(4.0))
    # token 6's heads lie next to each other in memory: one run of 3 heads x 4 values
    flat = nhd.storage.reshape(-1)
    start = nhd.storage[4, 1, 0, 6].storage_offset()
    assert torch.equal(flat[start + 8 : start + 12], torch.arange(4.0))
    assert hnd.order is Order.HND and hnd.kv is hnd.storage


def test_a_token_major_pool_over_a_buffer_is_a_view_without_copy():
    from kvferry.engine.reshard import Order

    config = PoolConfig(1, 2, 4, 4, 3, order=Order.NHD)
    buffer = torch.zeros(config.total_bytes, dtype=torch.uint8)
    pool = KVPool.from_buffer(config, buffer)
    pool.kv[2, 0, 1, 1, 3, 0] = 1.0
    assert buffer.view(torch.float32).view(config.storage_shape)[2, 0, 1, 3, 1, 0] == 1.0


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 4), (torch.bfloat16, 3)])
@pytest.mark.parametrize("laid_name, own_name", [("HND", "NHD"), ("NHD", "HND"), ("NHD", "NHD")])
def test_pages_landed_in_another_order_are_turned_into_the_pools(
    laid_name, own_name, dtype, head_dim, monkeypatch
):
    """A writer of one page size lays its pages as in its memory; the owner's
    ``laid_as`` reads its memory that way (the same bytes: what the writer checksummed),
    and ``relayout`` turns exactly the listed pages into the pool's order, after which
    the model's view holds the writer's KV. Broken: a pool that never turns them shows
    the model other values."""
    from kvferry.engine import pool as pool_module
    from kvferry.engine.reshard import Order

    monkeypatch.setattr(pool_module, "RELAYOUT_PIECE_BYTES", 1)  # a page per piece
    laid, own = Order[laid_name], Order[own_name]
    writer = KVPool(PoolConfig(2, 3, head_dim, 8, 6, dtype=dtype, order=laid))
    writer.kv.copy_(torch.randn_like(writer.kv))
    owner = KVPool(PoolConfig(2, 3, head_dim, 8, 6, dtype=dtype, order=own), zero=True)
    owner.storage.view(-1).copy_(writer.storage.view(-1))  # landed byte for byte
    assert torch.equal(owner.laid_as(laid), writer.storage)
    assert torch.equal(owner.laid_as(laid, (1, 3)), writer.laid_as(laid, (1, 3)))
    untouched = owner.kv.clone()
    owner.relayout([4, 1], laid)
    for page in range(6):
        want = writer.kv[page] if page in (1, 4) or laid is own else untouched[page]
        assert torch.equal(owner.kv[page], want), page
    if laid is not own:
        assert not torch.equal(untouched[1], writer.kv[1])  # the broken mode: never turned


def test_laid_as_and_relayout_refuse_what_the_pool_does_not_hold():
    from kvferry.engine.reshard import Order

    pool = KVPool(PoolConfig(1, 2, 4, 4, 3, order=Order.NHD))
    with pytest.raises(IndexError, match=r"heads \[1, 3\) outside the pool's 2 KV heads"):
        pool.laid_as(Order.HND, (1, 3))
    with pytest.raises(IndexError, match=r"pages outside \[0, 3\)"):
        pool.relayout([0, 3], Order.HND)


def test_the_widest_view_moves_the_same_bytes_in_fewer_elements():
    from kvferry.engine.pool import widest_view

    t = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    assert widest_view(t).dtype == torch.int64 and widest_view(t).shape == (2, 3, 2)
    odd = torch.zeros(2, 6, dtype=torch.uint8)  # 6 bytes a row: int16
    assert widest_view(odd).dtype == torch.int16
    assert widest_view(torch.zeros(2, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    shifted = torch.zeros(40, dtype=torch.uint8)[4:20]  # 16 bytes at an offset of 4: int32
    assert widest_view(shifted).dtype == torch.int32
    assert widest_view(t).view(torch.float32).data_ptr() == t.data_ptr()
