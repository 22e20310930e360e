"""Attention over the compressed cache: blocks against a plain softmax, native against reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GemmaConfig, LlamaConfig, Olmo2Config, Phi3Config

from kv_cache import H2O, CompressedCache, QuantConfig, SnapKV, StreamingLLM, compress
from kv_cache.attention.blocks import FullBlock, QuantBlock, attend_new, merge
from kv_cache.cache.storage import PackedKV
from test_cache import tiny

# --------------------------------------------------------------------------- model-free: blocks


def _plain(q, k, v, scaling, allowed):
    """float64 softmax attention: q [B, H, M, d], k/v [B, H, T, d], allowed [B, H, M, T]."""
    logits = (q.double() @ k.double().transpose(-1, -2)) * scaling
    p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    return p @ v.double(), p


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("L", [1, 5])
def test_blocks_merge_to_one_softmax(bits, L):
    """sinks | packed | residual | new, with left padding: one softmax, and its probabilities."""
    torch.manual_seed(0)
    B, H, G, d, g = 2, 2, 3, 16, 8
    q = torch.randn(B, H, G * L, d)
    sinks = [torch.randn(B, H, 3, d) for _ in range(2)]
    blk_k, blk_v = torch.randn(B, H, 40, d), torch.randn(B, H, 40, d)
    res = [torch.randn(B, H, 6, d) for _ in range(2)]
    new = [torch.randn(B, H, L, d) for _ in range(2)]
    packed = PackedKV(QuantConfig.kivi(bits=bits, group_size=g), torch.float32, d, track_groups=False)
    packed.append(blk_k, blk_v)
    deq_k, deq_v = packed.dequantize()
    blocks = [FullBlock(*sinks), QuantBlock(*packed.qblocks(), batch=B, kv_heads=H), FullBlock(*res)]
    starts = torch.tensor([[0, 0], [5, 5]])  # row 1: 5 padding slots (3 sinks + 2 packed)
    n_stat = min(L, 2)
    stat_rows = (torch.arange(G)[:, None] * L + torch.arange(L - n_stat, L)[None, :]).reshape(-1)
    parts, stats, off = [], [], 0
    for blk in blocks:
        out, lse, p = blk.attend(q, 0.3, (starts - off).clamp(0, blk.length), stat_rows)
        parts.append((out, lse))
        stats.append(p)
        off += blk.length
    out, lse, p = attend_new(q, *new, 0.3, G, None, n_stat, sum_stats=False)
    parts.append((out, lse))
    stats.append(p)
    out, lse = merge(parts)
    # reference over the concatenation
    K = torch.cat([sinks[0], deq_k, res[0], new[0]], 2)
    V = torch.cat([sinks[1], deq_v, res[1], new[1]], 2)
    T = K.shape[2]
    t = torch.arange(T)
    row_pos = torch.arange(L).repeat(G) + (T - L)
    allowed = (t[None, :] <= row_pos[:, None])[None, None] & (t >= starts[..., None])[:, :, None, :]
    ref, p_ref = _plain(q, K, V, 0.3, allowed)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    w = [torch.exp(lb[:, :, stat_rows] - lse[:, :, stat_rows]) for _, lb in parts]
    got_p = torch.cat([(ps * wi.unsqueeze(-1)) for ps, wi in zip(stats, w)], -1)
    torch.testing.assert_close(got_p.double(), p_ref[:, :, stat_rows], rtol=2e-5, atol=2e-6)


def test_new_block_sums_probabilities_chunk_by_chunk(monkeypatch):
    """With one block its probabilities are final: summed over the policy's queries per head."""
    import kv_cache.attention.blocks as blocks

    monkeypatch.setattr(blocks, "ROW_CHUNK_BYTES", 4 * 2 * 2 * 3 * 7 * 5)  # force several chunks
    torch.manual_seed(1)
    B, H, G, L, d = 2, 2, 3, 23, 8
    q, k, v = torch.randn(B, H, G * L, d), torch.randn(B, H, L, d), torch.randn(B, H, L, d)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[1, :4] = False
    out, _, colsum = attend_new(q, k, v, 0.5, G, valid, 9, sum_stats=True)
    pos = torch.arange(L).repeat(G)
    allowed = (torch.arange(L)[None, :] <= pos[:, None]) & valid[:, None, None, :]
    allowed = allowed | (torch.arange(L)[None, :] == pos[:, None])
    ref, p = _plain(q, k, v, 0.5, allowed)
    torch.testing.assert_close(out.double()[1, :, 4:], ref[1, :, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double()[0], ref[0], rtol=1e-5, atol=1e-5)
    want = p.reshape(B, H, G, L, L)[:, :, :, L - 9:].sum(3)
    torch.testing.assert_close(colsum.double(), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- native against reference

POLICIES = {
    "none": lambda: None,
    "snapkv": lambda: SnapKV(budget=40, recent_window=8),
    "h2o": lambda: H2O(budget=40),
    "streaming": lambda: StreamingLLM(budget=40, recent_window=16, sink_tokens=2),
}
TOL = {None: 1e-5, 8: 1e-3, 4: 1e-3, 2: 1e-3}
"""Stated tolerance on the logits (absolute): the same math, summed in another order; quantized
stores also see fp16 scales applied to the query instead of to the codes."""


def _decode(model, cache, ids, mask, mode, steps=12):
    logits = []
    with torch.no_grad(), compress(model, cache, attention=mode):
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out = model(nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits), [layer.kept_length() for layer in cache.layers]


@pytest.mark.parametrize("kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("bits", [None, 2, 4, 8])
def test_native_matches_reference(bits, policy, batch, kv):
    model = tiny(LlamaConfig, 4, kv)
    ids = torch.randint(3, 97, (batch, 70), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :9] = 0
    quant = None if bits is None else QuantConfig.kivi(bits=bits, group_size=8, residual_length=8)
    runs = {}
    for mode in ("reference", "native"):
        cache = CompressedCache(model.config, quant=quant, eviction=POLICIES[policy]())
        runs[mode] = _decode(model, cache, ids, mask, mode)
    (ref, kept_ref), (nat, kept_nat) = runs["reference"], runs["native"]
    assert kept_nat == kept_ref
    torch.testing.assert_close(nat, ref, rtol=0, atol=TOL[bits])


def test_native_masks_padding_kept_as_quantization_sinks(stories):
    """Left padding kept as full-precision sinks is masked: what the padding holds changes nothing.

    (The reference path refuses this setting: it cannot mask padding kept after eviction.)
    """
    model, tok = stories
    prompts = ["Once upon a time there was a little girl who loved to play in the park with her dog. One day "
               "she saw a big red ball under a tree and she ran to get it",
               "Tom had a red ball and a blue car. He liked to play with them in the garden every day"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    pad = enc.attention_mask == 0
    assert pad[1, :2].all()  # the second row's two sink slots are padding

    def make():
        return CompressedCache(model.config, quant=QuantConfig.kivi(bits=4, group_size=8, residual_length=8,
                                                               sink_tokens=2),
                               eviction=H2O(budget=24))

    first = _decode(model, make(), enc.input_ids, enc.attention_mask, "native", steps=8)[0]
    other = enc.input_ids.masked_fill(pad, 77)  # different padding content
    second = _decode(model, make(), other, enc.attention_mask, "native", steps=8)[0]
    # Attended padding would move logits by O(1); what remains (< 1e-4) is padding sharing a
    # per-channel key scale group with real tokens (KIVI groups tokens, padding included).
    torch.testing.assert_close(first, second, rtol=0, atol=5e-4)
    ids = tok(prompts[1], return_tensors="pt").input_ids  # the prefill itself matches the row alone
    alone = _decode(model, make(), ids, torch.ones_like(ids), "native", steps=0)[0]
    torch.testing.assert_close(first[0, 1], alone[0, 0], rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="reference attention path cannot mask"):
        _decode(model, make(), enc.input_ids, enc.attention_mask, "reference", steps=1)


def test_native_refuses_padding_after_tokens():
    model = tiny(LlamaConfig, 4, 2)
    ids = torch.randint(3, 97, (2, 20))
    mask = torch.ones_like(ids)
    mask[0, 7] = 0  # a hole, not left padding
    cache = CompressedCache(model.config, quant=QuantConfig.kivi(bits=4, group_size=8, residual_length=8))
    with pytest.raises(ValueError, match="left padding only"), torch.no_grad(), compress(model, cache):
        model(ids, attention_mask=mask, past_key_values=cache)


def test_attention_mode_is_validated_and_restored():
    model = tiny(LlamaConfig, 4, 2)
    cache = CompressedCache(model.config)
    with pytest.raises(ValueError, match=r"attention must be one of \['native', 'reference'\]; got 'flash'"):
        with compress(model, cache, attention="flash"):
            pass
    with pytest.raises(RuntimeError, match="boom"), compress(model, cache):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa" and not cache.native


# --------------------------------------------------------------------------- architectures


@pytest.mark.parametrize("cfg_cls", [LlamaConfig, GemmaConfig, Phi3Config, Olmo2Config])
def test_architectures_through_the_attention_interface(cfg_cls):
    """Uncompressed native attention equals sdpa over a DynamicCache; compression runs and evicts."""
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, head_dim=16, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(3, 97, (1, 40))
    with torch.no_grad():
        full = DynamicCache()
        ref = [model(ids, past_key_values=full).logits[:, -1]]
        ref.append(model(ref[0].argmax(-1, keepdim=True), past_key_values=full).logits[:, -1])
        cache = CompressedCache(model.config)
        with compress(model, cache):
            got = [model(ids, past_key_values=cache).logits[:, -1]]
            got.append(model(ref[0].argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1])
        torch.testing.assert_close(torch.stack(got), torch.stack(ref), rtol=0, atol=1e-5)
        small = CompressedCache(model.config, quant=QuantConfig.kivi(bits=4, group_size=8, residual_length=8),
                                eviction=H2O(budget=24))
        with compress(model, small):
            model(ids, past_key_values=small)
        assert [layer.kept_length() for layer in small.layers] == [24, 24]


def test_support_is_by_capability_not_by_type():
    """GPT-2 is in no list, but its attention goes through the interface: it works; an
    encoder-decoder or a config without a decoder's shape is a clear error."""
    from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel, T5Config

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=50)).eval()
    ids = torch.randint(0, 50, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids, past_key_values=DynamicCache()).logits
        cache = CompressedCache(model.config)
        with compress(model, cache):
            got = model(ids, past_key_values=cache).logits
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="'t5' is an encoder-decoder"):
        CompressedCache(T5Config(num_layers=1, d_model=32, num_heads=2))
    with pytest.raises(ValueError, match=r"lacks \['num_hidden_layers'"):
        CompressedCache(type("Cfg", (), {"model_type": "odd", "num_attention_heads": 2, "hidden_size": 8})())


@pytest.mark.parametrize("policy", ["none", "h2o"])
@pytest.mark.parametrize("layout", ["rotated", "rotated-lloyd-max-k3v2"])
def test_native_matches_reference_on_rotated_layouts(layout, policy):
    """The query is rotated once (and the output back) instead of every stored key and value."""
    model = tiny(LlamaConfig, 4, 2)
    ids = torch.randint(3, 97, (2, 70), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    quant = {
        "rotated": QuantConfig.kivi(bits=4, group_size=8, residual_length=8, rotation="hadamard"),
        "rotated-lloyd-max-k3v2": QuantConfig.kivi(bits=2, key_bits=3, group_size=8, residual_length=8,
                                              rotation="hadamard", key_grouping="token", channel_group=16,
                                              levels="lloyd_max"),
    }[layout]
    runs = {mode: _decode(model, CompressedCache(model.config, quant=quant, eviction=POLICIES[policy]()), ids, mask,
                          mode) for mode in ("reference", "native")}
    assert runs["native"][1] == runs["reference"][1]
    torch.testing.assert_close(runs["native"][0], runs["reference"][0], rtol=0, atol=1e-3)
