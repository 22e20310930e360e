"""Model-free tests of the vLLM integration's paged codecs and streaming attention.

These import no vLLM (the codecs and the attention are pure torch), so they run in every venv.
"""

import pytest
import torch

from kv_cache.integrations.vllm.attention import attend, attend_batch
from kv_cache.integrations.vllm.codecs import (
    CODECS, KEY_GROUP, PagedCodec, first_kv_head, read_blocks, value_rotations, write_slots,
)
from kv_cache.integrations.vllm.settings import PluginSettings
from kv_cache.kernels.paged import turn_keys

from test_paged_kernels import PRE_ROPE, frame_for, key_rope_for, written


def _fill(codec, n_tokens, bs=64, heads=3, chunks=(None,), seed=0, blocks=(5, 1, 7, 3)):
    """Write ``n_tokens`` random tokens of one sequence into ``blocks`` (in chunks of the given sizes,
    None: the rest at once); return cache, keys, values [T, H, D], block ids, rotation."""
    g = torch.Generator().manual_seed(seed)
    d = codec.head_dim
    k = torch.randn(n_tokens, heads, d, generator=g) + torch.linspace(-4, 4, d)  # per-channel offsets
    v = torch.randn(n_tokens, heads, d, generator=g)
    blk = torch.tensor(blocks)
    slots = blk[torch.arange(n_tokens) // bs] * bs + torch.arange(n_tokens) % bs
    cache = torch.zeros(max(8, max(blocks) + 1), heads, bs, codec.slot_bytes, dtype=torch.uint8)
    rot = value_rotations(codec, 3, heads)
    k, extra = written(codec.name, k, torch.arange(n_tokens), d)  # pre-RoPE codecs: keys as vLLM turns them
    start = 0
    for size in chunks:
        end = n_tokens if size is None else min(n_tokens, start + size)
        if end > start:
            part = {"rope": extra["rope"], "positions": extra["positions"][start:end]} if extra else {}
            write_slots(cache, k[start:end], v[start:end], slots[start:end], codec, rot, **part)
        start = end
    return cache, k, v, blk, rot


def _decoded(cache, blk, codec, rot, n_tokens):
    """Keys (turned to their positions for pre-RoPE codecs) and values (rotated back) ``[T, H, D]``."""
    k, v = read_blocks(cache, blk, codec)  # [nb, H, bs, D]
    h, d = k.shape[1], k.shape[-1]
    k = k.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n_tokens]
    if codec.pre_rope:
        k = turn_keys(k, 0, key_rope_for(codec.name, d))
    k = k.permute(1, 0, 2)
    v = v.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n_tokens].permute(1, 0, 2)
    if rot is not None:
        v = torch.einsum("thd,hed->the", v, rot)
    return k, v


@pytest.mark.parametrize("name, d, expected", [
    ("q8", 64, 132), ("q4d", 64, 73), ("q3d", 64, 57), ("q2d", 64, 41), ("q4", 64, 80),
    ("q4d", 128, 145), ("q8", 128, 260),
])
def test_slot_bytes(name, d, expected):
    codec = PagedCodec(name, d)
    assert codec.slot_bytes == expected
    assert sum(codec.offsets()[1:]) >= 0 and codec.offsets()[-1] == expected


@pytest.mark.parametrize("d", [64, 128])
def test_q4d_capacity_is_at_least_3_5x_bf16(d):
    assert 2 * d * 2 / PagedCodec("q4d", d).slot_bytes >= 3.5


def test_bad_codec_and_head_dim_raise():
    with pytest.raises(ValueError, match="must be one of"):
        PagedCodec("q5", 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        PagedCodec("q4d", 48)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("chunks", [(None,), (100, 1, 1, 1, 5, None), (1,) * 70])
def test_round_trip_error(name, chunks):
    codec = PagedCodec(name, 64)
    n = 70 if chunks == (1,) * 70 else 150
    cache, k, v, blk, rot = _fill(codec, n, chunks=chunks)
    kh, vh = _decoded(cache, blk, codec, rot, n)
    # Relative MSE bounds per width (keys carry +-4 channel offsets, so their relative error is small).
    bound = {"q8": 1e-4, "q4d": 1e-2, "q4": 1e-2, "q3d": 3e-2, "q2d": 1.5e-1}[name.rstrip("b")]
    vbound = {"q8": 1e-4, "q4d": 2e-2, "q4": 2e-2, "q3d": 6e-2, "q2d": 1.5e-1}[name.rstrip("b")]
    assert float((kh - k).square().mean() / k.square().mean()) < bound
    assert float((vh - v).square().mean() / v.square().mean()) < vbound


def test_channel_key_group_written_at_once_is_within_half_a_step():
    codec = PagedCodec("q4d", 64)
    cache, k, v, blk, rot = _fill(codec, KEY_GROUP, chunks=(None,))
    kh, _ = _decoded(cache, blk, codec, rot, KEY_GROUP)
    step = (k.amax(0) - k.amin(0)) / 15  # per (head, channel)
    assert bool(((kh - k).abs() <= step / 2 + 2e-3 * k.abs().amax()).all())


def test_token_by_token_keys_stay_close_to_whole_group():
    """Re-encoding a growing group costs at most a few extra half steps."""
    codec = PagedCodec("q4d", 64)
    c1, k, _, blk, rot = _fill(codec, KEY_GROUP, chunks=(None,))
    c2, _, _, _, _ = _fill(codec, KEY_GROUP, chunks=(1,) * KEY_GROUP)
    k1, _ = _decoded(c1, blk, codec, rot, KEY_GROUP)
    k2, _ = _decoded(c2, blk, codec, rot, KEY_GROUP)
    step = (k.amax(0) - k.amin(0)) / 15
    assert bool(((k2 - k).abs() <= 2.5 * step).all())
    assert float((k2 - k).square().mean()) < 3 * float((k1 - k).square().mean())


def test_blocks_are_self_contained():
    """A block's bytes decode the same wherever they sit (what prefix caching relies on)."""
    codec = PagedCodec("q4d", 64)
    cache, _, _, blk, rot = _fill(codec, 150)
    moved = torch.zeros_like(cache)
    moved[6] = cache[int(blk[1])]
    a = read_blocks(cache, blk[1:2], codec)
    b = read_blocks(moved, torch.tensor([6]), codec)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_rewrite_from_group_start_discards_old_content():
    """A preempted sequence rewritten from a group's first slot ignores what the slots held."""
    codec = PagedCodec("q4d", 64)
    cache, k, v, blk, rot = _fill(codec, 64, seed=1)
    fresh, k2, v2, _, _ = _fill(codec, 64, seed=2)
    slots = blk[0] * 64 + torch.arange(64)
    write_slots(cache, k2, v2, slots, codec, rot)
    assert torch.equal(cache[int(blk[0])], fresh[int(blk[0])])


def test_padding_slots_are_skipped():
    codec = PagedCodec("q8", 64)
    cache = torch.zeros(2, 1, 32, codec.slot_bytes, dtype=torch.uint8)
    x = torch.randn(2, 1, 64)
    write_slots(cache, x, x, torch.tensor([3, -1]), codec, None)
    assert cache[0, 0, 3].any() and not cache[0, 0, 4:].any() and not cache[1].any()


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("name", ["q8", "q4d", "q3d", "q2d", "q4", "q4db", "q3db", "q2db"])
@pytest.mark.parametrize("n_cached, nq, step", [(0, 7, 1), (1, 1, 1), (97, 1, 2), (150, 9, 1), (63, 64, 3)])
def test_attend_matches_dense_reference(name, n_cached, nq, step, kernels):
    """Both paths against softmax over the decoded cache: torch decodes each part; the kernels
    (compiled on the CPU here, or their torch reference where the build is off) read the codes."""
    codec = PagedCodec(name, 64)
    n = n_cached + nq
    cache, k, v, blk, rot = _fill(codec, n)
    kh, vh = _decoded(cache, blk, codec, rot, n)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, nq, 9, 64, generator=g)
    out = attend(q, cache, blk[None], torch.tensor([n_cached]), k[None, n_cached:], v[None, n_cached:], codec, rot,
                 0.125, step, kernels=kernels, key_rope=key_rope_for(name))
    keys = torch.cat((kh[:n_cached], k[n_cached:])).permute(1, 0, 2).repeat_interleave(3, 0)
    vals = torch.cat((vh[:n_cached], v[n_cached:])).permute(1, 0, 2).repeat_interleave(3, 0)
    mask = torch.ones(nq, n, dtype=torch.bool).tril(n_cached)
    ref = torch.nn.functional.scaled_dot_product_attention(q[0].permute(1, 0, 2), keys, vals, attn_mask=mask,
                                                           scale=0.125).permute(1, 0, 2)
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_attend_batched_decode_rows_are_independent(kernels):
    codec = PagedCodec("q4d", 64)
    c1, k1, v1, b1, rot = _fill(codec, 100, blocks=(0, 1, 2, 3), seed=3)
    c2, k2, v2, _, _ = _fill(codec, 40, blocks=(4, 5, 6, 7), seed=4)
    cache = c1.clone()
    cache[4:] = c2[4:]
    q = torch.randn(2, 1, 9, 64)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    both = attend(q, cache, table, torch.tensor([99, 39]), torch.stack((k1[99:], k2[39:])),
                  torch.stack((v1[99:], v2[39:])), codec, rot, 0.125, kernels=kernels)
    one = attend(q[1:], cache, table[1:], torch.tensor([39]), k2[None, 39:], v2[None, 39:], codec, rot, 0.125,
                 kernels=kernels)
    torch.testing.assert_close(both[1:], one, rtol=1e-5, atol=1e-6)


def _batch(codec, plan, heads=3, bs=64, seed=0):
    """A vLLM-like flat batch: request i has ``plan[i] = (cached, scheduled)`` tokens, written into
    its own blocks. Returns q [N, 3 * heads, D], cache, table, query_start, seq_lens, k/v of the
    step [N, heads, D], rotation, and each request's full keys/values [T, heads, D] (decoded)."""
    d = codec.head_dim
    nb = max(-(-(c + s) // bs) for c, s in plan)
    cache = torch.zeros(len(plan) * nb + 1, heads, bs, codec.slot_bytes, dtype=torch.uint8)
    table, ks, vs, full = [], [], [], []
    rot = None
    for i, (c, s) in enumerate(plan):
        blocks = tuple(range(1 + i * nb, 1 + (i + 1) * nb))  # block 0 stays unused
        part, k, v, blk, rot = _fill(codec, c + s, bs=bs, heads=heads, blocks=blocks, seed=seed + i)
        cache[list(blocks)] = part[list(blocks)]
        kh, vh = _decoded(cache, blk, codec, rot, c + s)
        table.append(blk)
        ks.append(k[c:])
        vs.append(v[c:])
        full.append((torch.cat((kh[:c], k[c:])), torch.cat((vh[:c], v[c:]))))
    lens = [s for _, s in plan]
    query_start = torch.tensor([0] + lens).cumsum(0)
    seq_lens = torch.tensor([c + s for c, s in plan])
    g = torch.Generator().manual_seed(seed + 99)
    q = torch.randn(int(query_start[-1]), 3 * heads, d, generator=g)
    return q, cache, torch.stack(table), query_start, seq_lens, torch.cat(ks), torch.cat(vs), rot, full


MIXED = [(99, 1), (63, 40), (0, 17), (1, 1), (150, 1), (0, 1), (64, 64)]
"""(cached, scheduled) tokens per request: decodes, prefill continuations, first chunks, a token alone."""


@pytest.mark.parametrize("kernels", [False, True], ids=["per-request", "one-call"])
@pytest.mark.parametrize("name", CODECS)
def test_attend_batch_matches_a_dense_softmax_per_request(name, kernels):
    """Every token of a mixed batch against softmax over its request's decoded cache and its own
    causal step tokens; the one compiled call (or its torch reference where the build is off) and
    the per-request path alike."""
    codec = PagedCodec(name, 64)
    q, cache, table, qs, seq, k, v, rot, full = _batch(codec, MIXED)
    out = attend_batch(q, cache, table, qs, seq, k, v, codec, rot, 0.125, kernels=kernels,
                       key_rope=key_rope_for(name))
    assert out.shape == q.shape and out.dtype == torch.float32
    for i, (c, s) in enumerate(MIXED):
        kh, vh = full[i]
        a = int(qs[i])
        keys = kh.permute(1, 0, 2).repeat_interleave(3, 0)
        vals = vh.permute(1, 0, 2).repeat_interleave(3, 0)
        mask = torch.ones(s, c + s, dtype=torch.bool).tril(c)
        ref = torch.nn.functional.scaled_dot_product_attention(q[a:a + s].permute(1, 0, 2), keys, vals,
                                                               attn_mask=mask, scale=0.125).permute(1, 0, 2)
        torch.testing.assert_close(out[a:a + s], ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["q4d", "q4db", "q8"])
def test_one_call_equals_the_per_request_path(name):
    codec = PagedCodec(name, 128)
    q, cache, table, qs, seq, k, v, rot, _ = _batch(codec, [(300, 1), (200, 64), (0, 33), (31, 1)], heads=2, seed=4)
    kw = dict(key_rope=key_rope_for(name, 128))
    one = attend_batch(q, cache, table, qs, seq, k, v, codec, rot, 0.09, kernels=True, **kw)
    each = attend_batch(q, cache, table, qs, seq, k, v, codec, rot, 0.09, kernels=False, **kw)
    torch.testing.assert_close(one, each, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["q4d", "q8"])
def test_a_prefill_chunk_over_a_long_cache_splits_into_items_and_merges(name):
    """A prefill chunk's many query rows over 700 cached tokens: the one call splits the cached
    tokens into several work items of 256 (sized by rows x tokens) and merges them on every
    thread (items of up to 64 rows, the value rotation undone per row); it equals the per-request
    path and the dense softmax."""
    codec = PagedCodec(name, 64)
    cases = [(700, 48), (650, 1), (0, 70)]
    q, cache, table, qs, seq, k, v, rot, full = _batch(codec, cases, seed=9)
    one = attend_batch(q, cache, table, qs, seq, k, v, codec, rot, 0.125, kernels=True)
    each = attend_batch(q, cache, table, qs, seq, k, v, codec, rot, 0.125, kernels=False)
    torch.testing.assert_close(one, each, rtol=1e-4, atol=1e-5)
    kh, vh = full[0]
    keys, vals = (x.permute(1, 0, 2).repeat_interleave(3, 0) for x in (kh, vh))
    mask = torch.ones(48, 748, dtype=torch.bool).tril(700)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:48].permute(1, 0, 2), keys, vals, attn_mask=mask,
                                                           scale=0.125).permute(1, 0, 2)
    torch.testing.assert_close(one[:48], ref, rtol=1e-4, atol=1e-5)


def test_one_call_reference_and_errors():
    """The torch composition (the oracle off the CPU) equals the call; bad metadata raises with
    what was expected and what came."""
    from kv_cache.integrations.vllm.blocks import slot_layout
    from kv_cache.kernels.paged_batch import attend_paged_batch, reference_attend_paged_batch

    codec = PagedCodec("q4d", 64)
    q, cache, table, qs, seq, k, v, rot, _ = _batch(codec, MIXED)
    lay = slot_layout(codec)
    got = attend_paged_batch(q, cache, table, qs, seq, k, v, lay, 0.125, rot)
    ref = reference_attend_paged_batch(q, cache, table, qs, seq, k, v, lay, 0.125, rot)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="query_start must be an int"):
        attend_paged_batch(q, cache, table, qs[:-1], seq, k, v, lay, 0.125)
    with pytest.raises(ValueError, match="seq_lens must count"):
        attend_paged_batch(q, cache, table, qs, seq - 30, k, v, lay, 0.125)
    with pytest.raises(ValueError, match="rise from"):
        attend_paged_batch(q, cache, table, qs.flip(0), seq, k, v, lay, 0.125)
    with pytest.raises(ValueError, match="k_new must be"):
        attend_paged_batch(q, cache, table, qs, seq, k[:, :2], v, lay, 0.125)
    with pytest.raises(ValueError, match="value_rotation must be"):
        attend_paged_batch(q, cache, table, qs, seq, k, v, lay, 0.125, rot[:2])
    with pytest.raises(ValueError, match="multiple of the cache's 3 kv heads"):
        attend_paged_batch(q[:, :8], cache, table, qs, seq, k, v, lay, 0.125)
    bad = table.clone()
    bad[0, 0] = 10_000
    with pytest.raises(ValueError, match="outside the cache"):
        attend_paged_batch(q, cache, bad, qs, seq, k, v, lay, 0.125)


def test_settings_parse_and_refuse():
    assert PluginSettings.from_additional_config({}) is None
    assert PluginSettings.from_additional_config({"kv_cache": {}}).codec == "q4d"
    assert PluginSettings.from_additional_config({"kv_cache": {"codec": "q8"}}).codec == "q8"
    with pytest.raises(ValueError, match="unknown keys"):
        PluginSettings.from_additional_config({"kv_cache": {"bits": 4}})
    with pytest.raises(ValueError, match="must be one of"):
        PluginSettings.from_additional_config({"kv_cache": {"codec": "fp8"}})
    with pytest.raises(ValueError, match="mapping"):
        PluginSettings.from_additional_config({"kv_cache": "q4d"})


def test_first_kv_head_follows_vllms_tensor_parallel_split():
    assert [first_kv_head(r, 2, 4) for r in range(2)] == [0, 2]  # 2 heads per rank
    assert [first_kv_head(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]  # each head on 2 ranks
    assert [first_kv_head(r, 2, 2) for r in range(2)] == [0, 1]
    assert first_kv_head(0, 1, 3) == 0
    for bad, message in (((2, 2, 4), "rank must be < world"), ((0, 2, 3), "do not split"),
                         ((0, 4, 3), "do not replicate"), ((-1, 2, 2), "rank must be an int"),
                         ((0, 0, 2), "world must be an int"), ((0, 2, 1.5), "total_kv_heads must be an int")):
        with pytest.raises(ValueError, match=message):
            first_kv_head(*bad)


@pytest.mark.parametrize("name", ["q4d", "q2d"])
def test_tensor_parallel_ranks_store_the_single_process_codes(name):
    """Each rank encodes its own heads with their model-wide rotations: the two ranks' slots are
    the single-process slots of their heads, byte for byte (a rank's local head 0 is not head 0)."""
    codec, heads, n, bs = PagedCodec(name, 64), 4, 70, 32
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(n, heads, 64, generator=g), torch.randn(n, heads, 64, generator=g)
    slots = torch.arange(n)
    whole = torch.zeros(4, heads, bs, codec.slot_bytes, dtype=torch.uint8)
    write_slots(whole, k, v, slots, codec, value_rotations(codec, 5, heads))
    for rank in range(2):
        local = slice(2 * rank, 2 * rank + 2)
        part = torch.zeros(4, 2, bs, codec.slot_bytes, dtype=torch.uint8)
        rot = value_rotations(codec, 5, 2, first_head=first_kv_head(rank, 2, heads))
        write_slots(part, k[:, local].contiguous(), v[:, local].contiguous(), slots, codec, rot)
        assert torch.equal(part, whole[:, local]), rank
    with pytest.raises(ValueError, match="first_head"):
        value_rotations(codec, 5, 2, first_head=-1)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("d", [64, 128])
def test_compiled_writer_stores_the_torch_bytes(name, d):
    """The compiled slot writer (kernels.paged.write_paged) against the torch encoder, byte for byte:
    a prefill chunk, decode steps one token at a time (each re-encodes its key group), a chunk that
    starts inside a group, bfloat16 inputs, a constant key channel."""
    from kv_cache.kernels import _select

    if _select.compiled_for((torch.zeros(1),)) is None:
        pytest.skip("the compiled kernels are not built here (KV_CACHE_KERNELS=torch or no compiler)")
    codec = PagedCodec(name, d)
    g = torch.Generator().manual_seed(11)
    n, bs, heads = 300, 64, 3
    k = (torch.randn(n, heads, d, generator=g) * 2 + torch.linspace(-4, 4, d)).bfloat16()
    v = torch.randn(n, heads, d, generator=g).bfloat16()
    k[:, :, 3] = 1.5
    slots = torch.tensor([5, 1, 7, 3, 9])[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    torch_cache = torch.zeros(10, heads, bs, codec.slot_bytes, dtype=torch.uint8)
    compiled = torch_cache.clone()
    rot = value_rotations(codec, 2, heads)
    frame = frame_for(name, d)
    for a, b in ((0, 100), (100, 101), (101, 102), (102, 150), (150, 151), (151, 300)):
        extra = {} if frame is None else {"rope": frame, "positions": torch.arange(a, b)}
        write_slots(torch_cache, k[a:b], v[a:b], slots[a:b], codec, rot, kernels=False, **extra)
        write_slots(compiled, k[a:b], v[a:b], slots[a:b], codec, rot, **extra)
    assert torch.equal(compiled, torch_cache)
    for kernels in (None, False):
        extra = {} if frame is None else {"rope": frame, "positions": torch.tensor([0])}
        with pytest.raises(ValueError, match="outside the cache's 640 slots"):
            write_slots(compiled, k[:1], v[:1], torch.tensor([640]), codec, rot, kernels=kernels, **extra)


@pytest.mark.parametrize("name", PRE_ROPE)
def test_keys_before_rope_hold_finer_steps_than_after(name):
    """Keys whose channels carry a constant offset before RoPE (Qwen2's key bias, a model's
    massive channels): after RoPE each offset turns with the position, so a 32-token group's
    per-channel range spans the circle and the codes' step widens; before RoPE it does not. The
    pre-RoPE codec's keys (turned back at read) are at least 4x closer in MSE to the model's, at
    the same bytes per slot."""
    codec, post = PagedCodec(name, 64), PagedCodec(name[:-1], 64)
    assert codec.slot_bytes == post.slot_bytes and codec.pre_rope and not post.pre_rope
    n, g = 256, torch.Generator().manual_seed(4)
    kp = torch.randn(n, 2, 64, generator=g) * 0.5 + 6 * torch.sign(torch.linspace(-1, 1, 64))  # offsets
    k, extra = written(name, kp, torch.arange(n))
    slots = torch.arange(n)
    errors = {}
    for c, kw in ((codec, extra), (post, {})):
        cache = torch.zeros(4, 2, 64, c.slot_bytes, dtype=torch.uint8)
        write_slots(cache, k, torch.randn(n, 2, 64, generator=g), slots, c, value_rotations(c, 0, 2), **kw)
        kh, _ = _decoded(cache, torch.arange(4), c, None, n)
        errors[c.name] = float((kh - k).square().mean())
    assert errors[name] * 4 < errors[post.name], errors


def test_pre_rope_codecs_refuse_to_write_without_their_frame():
    codec = PagedCodec("q4db", 64)
    cache = torch.zeros(2, 1, 32, codec.slot_bytes, dtype=torch.uint8)
    x = torch.randn(3, 1, 64)
    frame = frame_for("q4db")
    with pytest.raises(ValueError, match="stores keys before RoPE: pass the layer's rope frame"):
        write_slots(cache, x, x, torch.arange(3), codec, value_rotations(codec, 0, 1))
    for bad, message in ((torch.arange(2), r"positions must be an int \[N=3\]"),
                         (torch.arange(3).float(), "positions must be an int"),
                         (torch.tensor([0, -1, 2]), "positions must be >= 0")):
        with pytest.raises(ValueError, match=message):
            write_slots(cache, x, x, torch.arange(3), codec, value_rotations(codec, 0, 1), rope=frame, positions=bad)
    with pytest.raises(ValueError, match="pass key_rope"):
        attend(torch.randn(1, 1, 3, 64), cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]),
               x[None, :1], x[None, :1], codec, value_rotations(codec, 0, 1), 0.125)
    # padding slots drop their positions with them
    write_slots(cache, x, x, torch.tensor([0, -1, 2]), codec, value_rotations(codec, 0, 1), rope=frame,
                positions=torch.tensor([0, 1, 2]))
    alone = torch.zeros_like(cache)
    write_slots(alone, x[[0, 2]], x[[0, 2]], torch.tensor([0, 2]), codec, value_rotations(codec, 0, 1), rope=frame,
                positions=torch.tensor([0, 2]))
    assert torch.equal(cache, alone) and cache[0, 0, 2].any()
