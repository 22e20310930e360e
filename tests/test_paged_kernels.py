"""Paged attention read in place through a block table (kv_cache.kernels.paged, §28.5):
model-free checks of the layouts and the compiled kernel against the torch reference.

The caches are written by the vLLM integration's codecs (pure torch, no vLLM import), so every
slot layout the plugin uses is covered; the Triton kernel runs the same cases in
tests/test_triton_kernels.py (interpreter child).
"""

from __future__ import annotations

import pytest
import torch

from kv_cache.cache.rope_frame import RopeFrame
from kv_cache.integrations.vllm.blocks import paged_rope, slot_layout
from kv_cache.integrations.vllm.codecs import CODECS, PagedCodec, read_blocks, value_rotations, write_slots
from kv_cache.kernels import paged
from kv_cache.kernels.paged import PagedRope, SlotLayout, attend_paged, decode_slots, reference_attend_paged

PRE_ROPE = [name for name in CODECS if PagedCodec(name, 64).pre_rope]


def frame_for(name: str, d: int = 64) -> RopeFrame | None:
    """A rotary frame for the pre-RoPE codecs, a different kind per width: full ``rotate_half``
    pairs (q4db), partial rotary on interleaved pairs (q3db: a quarter of the channels), an
    attention scaling of 1.25 as YaRN's (q2db); None for the others."""
    if not PagedCodec(name, d).pre_rope:
        return None
    r, layout, scaling = {"q4db": (d, "half", 1.0), "q3db": (d // 4, "interleaved", 1.0),
                          "q2db": (d, "half", 1.25)}[name]
    return RopeFrame(1.0 / (10000.0 ** (torch.arange(0, r, 2).float() / r)), scaling, layout)


def written(name: str, k_pre: torch.Tensor, positions: torch.Tensor, d: int = 64) -> tuple[torch.Tensor, dict]:
    """The keys vLLM hands the backend (``k_pre`` turned to ``positions`` under the codec's frame,
    as they are for every codec) and the extra arguments of :func:`write_slots`."""
    frame = frame_for(name, d)
    if frame is None:
        return k_pre, {}
    k = frame.apply(k_pre.permute(1, 0, 2)[None], positions)[0].permute(1, 0, 2)
    return k, {"rope": frame, "positions": positions}


def key_rope_for(name: str, d: int = 64) -> PagedRope | None:
    frame = frame_for(name, d)
    return None if frame is None else paged_rope(frame)


def paged_case(name: str, d: int = 64, heads: int = 2, bs: int = 64, lengths=(150, 0, 33, 64), seed: int = 0):
    """A cache of 12 blocks written for requests of ``lengths`` tokens; requests 0 and 3 share
    their first block (a prefix-cache hit: request 3's tokens are request 0's first 64). Keys
    of the pre-RoPE codecs are written as vLLM hands them over (turned), under :func:`frame_for`.

    Returns ``(cache, table [R, 4] int32, lengths [R] int64, layout, q [R, H, M, D])``."""
    codec = PagedCodec(name, d)
    g = torch.Generator().manual_seed(seed)
    cache = torch.zeros(12, heads, bs, codec.slot_bytes, dtype=torch.uint8)
    table = torch.tensor([[7, 2, 9, 0], [1, 1, 1, 1], [4, 11, 0, 0], [7, 5, 5, 5]], dtype=torch.int32)
    rot = value_rotations(codec, 1, heads)
    for r, n in enumerate(lengths[:3]):
        if n == 0:
            continue
        k = torch.randn(n, heads, d, generator=g) + torch.linspace(-4, 4, d)  # per-channel offsets
        v = torch.randn(n, heads, d, generator=g)
        k[:, :, 3] = 1.5  # a constant key channel (scale 0 in every group)
        t = torch.arange(n)
        k, extra = written(name, k, t, d)
        write_slots(cache, k, v, table[r, t // bs].long() * bs + t % bs, codec, rot, **extra)
    q = torch.randn(len(lengths), heads, 5, d, generator=g)
    return cache, table[:len(lengths)], torch.tensor(lengths), slot_layout(codec), q


@pytest.mark.parametrize("name", CODECS)
def test_layout_decodes_as_the_codec(name):
    """decode_slots (the kernels' reading of a slot) equals the codec's own read_blocks."""
    cache, *_ = paged_case(name)
    codec = PagedCodec(name, 64)
    k, v = decode_slots(cache, slot_layout(codec))
    kw, vw = read_blocks(cache, torch.arange(12), codec)
    torch.testing.assert_close(k, kw, rtol=0, atol=0)
    torch.testing.assert_close(v, vw, rtol=1e-6, atol=1e-6)
    if codec.key_layout == "channel" and not codec.pre_rope:  # a constant channel (scale 0) decodes exactly
        assert bool((k[7, :, :, 3] == 1.5).all())
    elif codec.pre_rope:  # constant before RoPE: turned back, then stored, within float32 rounding
        torch.testing.assert_close(k[7, :, :, 3], torch.full_like(k[7, :, :, 3], 1.5), rtol=0, atol=1e-3)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("d", [64, 128])
def test_compiled_kernel_matches_the_reference(name, d):
    if paged._select.compiled_for((torch.zeros(1),)) is None:
        pytest.skip("the compiled kernels are not built here (KV_CACHE_KERNELS=torch or no compiler)")
    cache, table, lengths, layout, q = paged_case(name, d=d)
    rope = key_rope_for(name, d)
    out, lse = attend_paged(q, cache, table, lengths, layout, 0.1, rope)
    want_out, want_lse = reference_attend_paged(q, cache, table, lengths, layout, 0.1, rope)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and bool(torch.isneginf(lse[1]).all())
    # request 3 reads block 7, shared with request 0: the same as request 0 cut at 64 tokens
    cut, cut_lse = attend_paged(q[3:], cache, table[:1], torch.tensor([64]), layout, 0.1, rope)
    torch.testing.assert_close(out[3:], cut, rtol=0, atol=0)
    torch.testing.assert_close(lse[3:], cut_lse, rtol=0, atol=0)


def test_many_queries_and_long_rows_split_into_chunks():
    """A prefill-sized step (M = 7 x 64 queries) over 600 tokens: several work items per row."""
    if paged._select.compiled_for((torch.zeros(1),)) is None:
        pytest.skip("the compiled kernels are not built here")
    codec = PagedCodec("q4d", 64)
    g = torch.Generator().manual_seed(3)
    n, bs = 600, 32
    cache = torch.zeros(24, 2, bs, codec.slot_bytes, dtype=torch.uint8)
    table = torch.randperm(24, generator=g)[None, :19].to(torch.int32)
    t = torch.arange(n)
    write_slots(cache, torch.randn(n, 2, 64, generator=g) * 3, torch.randn(n, 2, 64, generator=g),
                table[0, t // bs].long() * bs + t % bs, codec, value_rotations(codec, 0, 2))
    q = torch.randn(1, 2, 448, 64, generator=g)
    out, lse = attend_paged(q, cache, table, torch.tensor([n]), slot_layout(codec), 0.125)
    want_out, want_lse = reference_attend_paged(q, cache, table, torch.tensor([n]), slot_layout(codec), 0.125)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_errors_name_the_allowed_and_the_received():
    cache, table, lengths, layout, q = paged_case("q4d")
    bad_table = table.clone()
    bad_table[0, 1] = 40
    for fn in (attend_paged, reference_attend_paged):
        with pytest.raises(ValueError, match="outside the cache's 12 blocks"):
            fn(q, cache, bad_table, lengths, layout, 0.1)
    with pytest.raises(ValueError, match=r"cache must be uint8 \[blocks, H, block_size, 73\]"):
        attend_paged(q, cache.float(), table, lengths, layout, 0.1)
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        attend_paged(q, cache[:, :, :48], table, lengths, layout, 0.1)
    with pytest.raises(ValueError, match=r"q must be \[R, 2, M, 64\]"):
        attend_paged(q[..., :32], cache, table, lengths, layout, 0.1)
    with pytest.raises(ValueError, match="block_table must be an int32/int64"):
        attend_paged(q, cache, table.float(), lengths, layout, 0.1)
    with pytest.raises(ValueError, match="lengths must be an int"):
        attend_paged(q, cache, table, lengths.float(), layout, 0.1)
    with pytest.raises(TypeError, match="layout must be a SlotLayout"):
        attend_paged(q, cache, table, lengths, "q4d", 0.1)
    with pytest.raises(ValueError, match="key_kind must be one of"):
        SlotLayout(64, "channel", 4, "token_int8", 8, (0, 32, 40, 104, 106))
    with pytest.raises(ValueError, match="key_bits must be one of"):
        SlotLayout(64, "channel_groups", 5, "token_int8", 8, (0, 32, 40, 104, 106))
    with pytest.raises(ValueError, match="this layout needs"):
        SlotLayout(64, "channel_groups", 4, "token_int8", 8, (0, 32, 41, 105, 107))
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        SlotLayout(48, "channel_groups", 4, "token_int8", 8, (0, 24, 30, 78, 80))
    with pytest.raises(ValueError, match="value_levels must be a float32"):
        SlotLayout(64, "channel_groups", 4, "levels_token_norm", 4, (0, 32, 40, 72, 73))


def test_lengths_past_the_table_are_clipped():
    if paged._select.compiled_for((torch.zeros(1),)) is None:
        pytest.skip("the compiled kernels are not built here")
    cache, table, lengths, layout, q = paged_case("q8", lengths=(150, 0, 33, 64))
    big = torch.tensor([10_000, 0, 33, 64])
    out, _ = attend_paged(q, cache, table, big, layout, 0.1)
    want, _ = reference_attend_paged(q, cache, table, big, layout, 0.1)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", PRE_ROPE)
@pytest.mark.parametrize("d", [64, 128])
def test_keys_before_rope_are_turned_to_their_token_index(name, d):
    """The kernels (and the reference) turn a pre-RoPE slot's key to its index in its request:
    attention over the paged codes equals attention over the decoded keys turned by the frame
    (the model's own keys, up to the codes' error), for far positions too (a request's tokens
    start at 70,000 here: its table's first blocks are never read)."""
    codec = PagedCodec(name, d)
    cache, table, lengths, layout, q = paged_case(name, d=d)
    rope = key_rope_for(name, d)
    frame = frame_for(name, d)
    want_out, want_lse = reference_attend_paged(q, cache, table, lengths, layout, 0.1, rope)
    # the reference against a dense softmax over read_blocks' keys, turned by the frame
    k, v = read_blocks(cache, table[0].long(), codec)  # [4, H, bs, D]
    k = k.permute(1, 0, 2, 3).reshape(2, -1, d)[:, :150]
    v = v.permute(1, 0, 2, 3).reshape(2, -1, d)[:, :150]
    k = frame.apply(k[None], torch.arange(150))[0]
    s = torch.einsum("hmd,htd->hmt", q[0], k) * 0.1
    torch.testing.assert_close(want_out[0], torch.softmax(s, -1) @ v, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(want_lse[0], torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    # far positions: 70,000 + t, the compiled kernel's doubling table against float32 angles
    bs, g = 64, torch.Generator().manual_seed(5)
    far = torch.zeros(1200, 2, bs, codec.slot_bytes, dtype=torch.uint8)
    t = 70_000 + torch.arange(96)
    kp = torch.randn(96, 2, d, generator=g) + torch.linspace(-3, 3, d)
    kk, extra = written(name, kp, t, d)
    blocks = torch.tensor([1100, 1101])
    write_slots(far, kk, torch.randn(96, 2, d, generator=g), blocks[(t - 70_000) // bs] * bs + t % bs, codec,
                value_rotations(codec, 0, 2), **extra)
    row = torch.zeros(1, 1096, dtype=torch.int32)
    row[0, 1093:1095] = blocks.to(torch.int32)
    lengths = torch.tensor([70_000 + 96])
    qf = torch.randn(1, 2, 3, d, generator=g)
    # only the last 96 tokens hold keys; the blocks before are all zero codes (block 0)
    got, got_lse = attend_paged(qf, far, row, lengths, layout, 0.1, rope)
    ref, ref_lse = reference_attend_paged(qf, far, row, lengths, layout, 0.1, rope)
    # (the reference's float32 angles p * w are off by up to p * 2**-24 rad there)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=2e-2 * float(ref.abs().max()))
    torch.testing.assert_close(got_lse, ref_lse, rtol=1e-4, atol=1e-4)
    assert float(ref.abs().max()) > 0


def test_paged_rope_errors_name_the_allowed_and_the_received():
    cache, table, lengths, layout, q = paged_case("q4d")
    w = torch.ones(8)
    for rope, message in ((PagedRope(w, "sideways"), "layout must be one of"),
                          (PagedRope(torch.ones(40)), r"2 <= r <= head_dim 64"),
                          (PagedRope(w.double()), "float32"),
                          (PagedRope(w * float("nan")), "finite"),
                          (PagedRope(w, "half", 0.0), "scaling must be a finite number > 0"),
                          (PagedRope(w, "half", float("inf")), "scaling must be")):
        for fn in (attend_paged, reference_attend_paged):
            with pytest.raises(ValueError, match=message):
                fn(q, cache, table, lengths, layout, 0.1, rope)
    with pytest.raises(TypeError, match="key_rope must be a PagedRope"):
        attend_paged(q, cache, table, lengths, layout, 0.1, "rope")
