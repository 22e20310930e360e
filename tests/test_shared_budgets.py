"""Shared budgets (Ada-KV / KVzip), ragged per-head storage, KVzip's reconstruction pass, sessions.

Layers: model-free (selection, ragged block, reconstruction scores against plain softmax), then
the tiny real model (stories260K) across policies x scopes x quantization, then errors.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kv_cache import H2O, CompressedCache, CompressedContext, KVzip, QuantConfig, SnapKV, StreamingLLM, compress, prefill
from kv_cache.attention.blocks import FullBlock, QuantBlock, RaggedBlock, merge, reconstruction_scores
from kv_cache.cache.packed import PackedKV
from kv_cache.cache.packed_ragged import PackedRaggedStorage
from kv_cache.compression.global_budget import select_global
from kv_cache.eval.accounting import walked_nbytes

# --------------------------------------------------------------------------- model-free: selection


def _brute_force(scores, budget, floor, valid, forced):
    """Reference: floors first (each row's best), forced always, then the best of the rest."""
    keep = []
    for s, v, f in zip(scores, valid, forced):
        k = torch.zeros_like(v)
        for r in range(s.shape[0]):
            idx = [t for t in sorted(range(s.shape[1]), key=lambda t: (-(float("inf") if f[r, t] else s[r, t]), t))
                   if v[r, t]][:floor]
            k[r, idx] = True
        keep.append(k | (f & v))
    rest = budget - sum(int(k.sum()) for k in keep)
    cand = sorted(((float(s[r, t]), -i, -r, -t, i, r, t) for i, (s, v, k) in enumerate(zip(scores, valid, keep))
                   for r in range(s.shape[0]) for t in range(s.shape[1]) if v[r, t] and not k[r, t]), reverse=True)
    for *_, i, r, t in cand[:max(rest, 0)]:
        keep[i][r, t] = True
    return keep


@pytest.mark.parametrize("floor", [0, 2])
@pytest.mark.parametrize("budget", [0, 7, 20, 1000])
def test_select_global_matches_brute_force(floor, budget):
    g = torch.Generator().manual_seed(budget + floor)
    scores = [torch.rand(3, 9, generator=g), torch.rand(2, 5, generator=g)]
    valid = [torch.rand(3, 9, generator=g) > 0.2, torch.ones(2, 5, dtype=torch.bool)]
    forced = [torch.zeros(3, 9, dtype=torch.bool), torch.zeros(2, 5, dtype=torch.bool)]
    forced[0][0, 0] = valid[0][0, 0]
    n_forced = int(forced[0].sum())
    need = n_forced + sum(min(floor, int(v.sum(-1)[r])) for v in valid for r in range(v.shape[0]))
    if need > budget:
        with pytest.raises(ValueError, match="shared budget"):
            select_global(scores, budget, floor=floor, valid=valid, forced=forced)
        return
    got = select_global(scores, budget, floor=floor, valid=valid, forced=forced)
    ref = _brute_force(scores, budget, floor, valid, forced)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    total_valid = sum(int(v.sum()) for v in valid)
    assert sum(int(k.sum()) for k in got) == min(budget, total_valid)  # a budget above the tokens keeps all
    assert all(not bool((k & ~v).any()) for k, v in zip(got, valid))  # padding never kept


def test_select_global_errors():
    with pytest.raises(ValueError, match="at least one"):
        select_global([], 3)
    with pytest.raises(ValueError, match="NaN"):
        select_global([torch.tensor([[0.1, float("nan")]])], 1)
    with pytest.raises(TypeError, match="floating point"):
        select_global([torch.tensor([[1, 2]])], 1)
    with pytest.raises(ValueError, match=r"\[rows, tokens\]"):
        select_global([torch.rand(4)], 1)
    with pytest.raises(TypeError, match="bool tensor"):
        select_global([torch.rand(2, 3)], 1, valid=[torch.ones(2, 3)])
    with pytest.raises(ValueError, match="budget"):
        select_global([torch.rand(2, 3)], -1)
    # constant scores: ties break by row then position, deterministically
    keep = select_global([torch.zeros(2, 4)], 3)[0]
    assert keep.tolist() == [[True, True, True, False], [False] * 4]


# --------------------------------------------------------------------------- model-free: ragged attention


@pytest.mark.parametrize("quantized", [False, True])
def test_ragged_block_is_one_softmax_per_row(quantized):
    """Each row attends to its own tokens only; statistics come back right-aligned."""
    torch.manual_seed(0)
    B, H, G, M, d = 2, 2, 2, 3, 16
    q = torch.randn(B, H, G * M, d)
    rows, refs, lengths = [], [], []
    for r in range(B * H):
        n = 8 + 8 * r
        k, v = torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
        if quantized:
            pk = PackedKV(QuantConfig.kivi(bits=8, group_size=8), torch.float32, d, track_groups=False)
            pk.append(k, v)
            k, v = pk.dequantize()
            rows.append([QuantBlock(*pk.qblocks(), batch=1, kv_heads=1)])
        else:
            rows.append([FullBlock(k[:, :, :3], v[:, :, :3]), FullBlock(k[:, :, 3:], v[:, :, 3:])])
        refs.append((k, v))
        lengths.append(n)
    blk = RaggedBlock(rows, B, H, lengths)
    L = blk.length
    starts = torch.tensor([[L - lengths[0] + 2, L - lengths[1]], [L - lengths[2], L - lengths[3] + 1]])
    stat_rows = torch.arange(G * M)
    out, lse, p = blk.attend(q, 0.25, starts, stat_rows)
    for r, (k, v) in enumerate(refs):
        b, h = divmod(r, H)
        skip = int(starts[b, h]) - (L - lengths[r])
        logits = (q[b, h].double() @ k[0, 0, skip:].double().T) * 0.25
        pr = torch.softmax(logits, -1)
        torch.testing.assert_close(out[b, h].double(), pr @ v[0, 0, skip:].double(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse[b, h].double(), torch.logsumexp(logits, -1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(p[b, h, :, L - lengths[r] + skip:].double(), pr, rtol=1e-4, atol=1e-4)
        assert float(p[b, h, :, :L - lengths[r] + skip].abs().sum()) == 0.0  # virtual padding: no probability
    # and it merges with another block like any block
    merged, _ = merge([(out, lse), (out, lse)])
    torch.testing.assert_close(merged, out)


def test_reconstruction_scores_match_plain_softmax():
    torch.manual_seed(1)
    B, H, G, L, T, d = 1, 2, 3, 5, 12, 8
    q = torch.randn(B, H, G * L, d)
    stored, new = torch.randn(B, H, T, d), torch.randn(B, H, L, d)
    sinks, start, end = 2, 6, 10
    got = reconstruction_scores(q, stored, new, 0.4, G, sinks, start, end)
    ref = torch.zeros(B, H, end - start, dtype=torch.float64)
    for h in range(H):
        keys = torch.cat([stored[0, h, :sinks], stored[0, h, start:end], new[0, h]]).double()
        for g in range(G):
            for i in range(L):
                qi = q[0, h, g * L + i].double()
                s = (keys @ qi) * 0.4
                s[sinks + (end - start) + i + 1:] = float("-inf")  # causal inside the chunk
                p = torch.softmax(s, 0)[sinks:sinks + end - start]
                ref[0, h] = torch.maximum(ref[0, h], p)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the tiny real model


def _ids(tok, n=160):
    text = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
            "One day she found a red ball under a big tree. ") * 8
    return tok(text, return_tensors="pt").input_ids[:, :n]


def _next_logits(model, cache, ids, question):
    with compress(model, cache), cache.session(), torch.no_grad():
        out = model(input_ids=question, past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(ids.shape[1], ids.shape[1] + question.shape[1])[None])
    return out.logits[0, -1]


QUANTS = {"none": None, "q4": QuantConfig.kivi(bits=4, group_size=16, residual_length=16),
          "q4htl": QuantConfig.kivi(bits=4, group_size=16, residual_length=16, rotation="hadamard", key_grouping="token",
                               levels="lloyd_max", channel_group=64)}
POLICIES = {
    "snapkv-layer": lambda: SnapKV(budget=0.4, recent_window=8, scope="layer"),
    "snapkv-model": lambda: SnapKV(budget=0.4, recent_window=8, scope="model"),
    "h2o-layer": lambda: H2O(budget=0.6, scope="layer"),
    "h2o-model": lambda: H2O(budget=0.6, scope="model"),
    "kvzip-model": lambda: KVzip(budget=0.3, chunk_size=64),
    "kvzip-layer": lambda: KVzip(budget=0.3, scope="layer"),
    "kvzip-head": lambda: KVzip(budget=0.3, scope="head"),
}


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_shared_budget_matrix(stories, quant, policy):
    """Every policy x scope x layout: the budget is met on average, memory is the tokens kept
    (every byte walked), each head holds its own tokens, and a question can be asked twice."""
    model, tok = stories
    ids = _ids(tok)
    pol = POLICIES[policy]()
    cache = CompressedCache(model.config, quant=QUANTS[quant], eviction=pol)
    logits, stats = prefill(model, cache, ids, tokenizer=tok)
    assert logits.shape[:2] == ids.shape and cache.get_seq_length() == ids.shape[1]  # the repeat pass left no trace
    per_head = torch.stack([layer.head_lengths() for layer in cache.layers])  # [layers, b, heads]
    budget = pol.budget_tokens(0, ids.shape[1])
    if pol.scope == "head":
        assert bool((per_head == budget).all())
    elif pol.scope == "layer":
        assert bool((per_head.sum(-1) <= budget * per_head.shape[-1]).all())
    else:
        assert int(per_head.sum()) <= budget * per_head.numel()
    if pol.scope != "head" and policy != "h2o-layer":
        assert len(set(per_head.flatten().tolist())) > 1  # heads really differ ...
        assert any(isinstance(layer.storage, PackedRaggedStorage) for layer in cache.layers)
    report = cache.memory_report()
    assert report.total_bytes == walked_nbytes(cache)  # ... and only the kept tokens are held
    assert report.elements_kept == 2 * cache.head_dim * int(per_head.sum())
    if stats.reconstruction_tokens:
        assert stats.cost_ratio > 1.0
    q = tok(" Lily found a", return_tensors="pt", add_special_tokens=False).input_ids
    first = _next_logits(model, cache, ids, q)
    assert cache.get_seq_length() == ids.shape[1] and cache.memory_report().total_bytes == report.total_bytes
    torch.testing.assert_close(_next_logits(model, cache, ids, q), first)  # the same context every time


def test_full_precision_rows_hold_exactly_the_kept_tokens(stories):
    """A ragged layer's rows are the original keys at the kept positions, nothing else."""
    model, tok = stories
    ids = _ids(tok)
    full = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full, use_cache=True)
    cache = CompressedCache(model.config, eviction=SnapKV(budget=0.4, recent_window=8, scope="layer"))
    prefill(model, cache, ids)
    layer = cache.layers[2]
    st = layer.storage
    assert isinstance(st, PackedRaggedStorage) and st.packed is None and st.fp_keys.shape[:2] == (1, 1)
    assert st.fp_keys.shape[2] == sum(st.fp_len) == int(layer.head_lengths().sum())  # one buffer, no padding
    ref = full.layers[2].keys
    first = 0
    for r, n in enumerate(st.fp_len):
        k = st.fp_keys[0, 0, first:first + n]
        first += n
        # each kept key is one of the head's original keys, in order
        d = torch.cdist(k, ref[0, r], compute_mode="donot_use_mm_for_euclid_dist")
        pos = d.argmin(-1)
        assert torch.allclose(d.min(-1).values, torch.zeros(k.shape[0]), atol=1e-5)
        assert bool((pos[1:] > pos[:-1]).all())


def test_kvzip_keeping_everything_equals_the_full_cache(stories):
    """The reconstruction pass leaves no trace: with nothing to evict, answers equal the full cache's."""
    model, tok = stories
    ids = _ids(tok, 120)
    q = tok(" The ball was", return_tensors="pt", add_special_tokens=False).input_ids
    full = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=full, use_cache=True)
        ref = model(input_ids=q, past_key_values=full, use_cache=True).logits[0, -1]
    cache = CompressedCache(model.config, eviction=KVzip(budget=1.0, chunk_size=50))
    prefill(model, cache, ids, tokenizer=tok)
    assert cache.memory_report().tokens_kept == ids.shape[1]
    torch.testing.assert_close(_next_logits(model, cache, ids, q), ref, rtol=1e-4, atol=1e-4)


def test_prefill_last_only_forms_the_last_logits_alone(stories):
    """``prefill(..., last_only=True)``: the last position's logits, equal to the full pass's last
    row, and the same cache (KVzip keeps the same tokens)."""
    model, tok = stories
    ids = _ids(tok, 120)
    caches, logits = [], []
    for last_only in (False, True):
        cache = CompressedCache(model.config, eviction=KVzip(budget=0.5, chunk_size=50))
        out, _ = prefill(model, cache, ids, tokenizer=tok, last_only=last_only)
        caches.append(cache)
        logits.append(out)
    assert logits[1].shape == (1, 1, logits[0].shape[-1])
    torch.testing.assert_close(logits[1][:, 0], logits[0][:, -1], rtol=1e-5, atol=1e-5)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.head_lengths(), b.head_lengths())


def test_kvzip_scores_every_context_token_once_chunked(stories):
    """Chunks cover the context: every stored slot but the unrepeated BOS gets a score."""
    model, tok = stories
    ids = _ids(tok, 130)
    cache = CompressedCache(model.config, eviction=KVzip(budget=1.0, chunk_size=40))
    with compress(model, cache), torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        from kv_cache.context import reconstruct

        layer = cache.layers[0]
        seen = []
        orig = layer.observe_reconstruction

        def spy(scores):
            seen.append(layer.reconstructing[1:])
            orig(scores)

        layer.observe_reconstruction = spy
        try:
            fed = reconstruct(model, cache, ids[0], tok)
        finally:
            del layer.observe_reconstruction
    first = 1 if int(ids[0, 0]) == tok.bos_token_id else 0
    assert seen == [(s, min(130, s + 40)) for s in range(first, 130, 40)]
    assert fed > 130 - first and cache.get_seq_length() == 130


def _greedy_in_session(model, cache, context_tokens, question, n, eos):
    """Reference for ``CompressedContext.ask``: greedy tokens read through ``cache`` in a session,
    the model called directly at the positions after the context (no ``forward_at``, no
    ``generate_tokens``)."""
    out = []
    with compress(model, cache), cache.session(), torch.no_grad():
        pos = torch.arange(context_tokens, context_tokens + question.shape[1])[None]
        logits = model(input_ids=question, position_ids=pos, past_key_values=cache, use_cache=True).logits[0, -1]
        for step in range(n):
            t = int(logits.argmax())
            if t in eos:
                break
            out.append(t)
            if step + 1 < n:
                pos = torch.tensor([[context_tokens + question.shape[1] + step]])
                logits = model(input_ids=torch.tensor([[t]]), position_ids=pos, past_key_values=cache,
                               use_cache=True).logits[0, -1]
    return out


def test_session_drops_the_question_and_counts_its_tail(stories):
    """A question asked in a session is held (and counted) while it runs, then dropped: the
    context's length and bytes come back, and the answers asked after it are those of a context
    built and compressed separately that was never asked anything, decoded greedily by calling
    the model directly."""
    model, tok = stories
    ids = _ids(tok)

    def compressed():
        return CompressedCache(model.config, quant=QUANTS["q4"], eviction=SnapKV(budget=0.5, recent_window=8,
                                                                                  scope="layer"))

    cache = compressed()
    prefill(model, cache, ids)
    before = cache.memory_report().total_bytes
    q = tok(" Lily found a", return_tensors="pt", add_special_tokens=False).input_ids
    with compress(model, cache), cache.session(), torch.no_grad():
        model(input_ids=q, past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == ids.shape[1] + q.shape[1]
        assert cache.memory_report().total_bytes > before  # the question's tail is held and counted
        assert cache.memory_report().total_bytes == walked_nbytes(cache)
    assert cache.get_seq_length() == ids.shape[1] and cache.memory_report().total_bytes == before
    ctx = CompressedContext(model, tok, cache, ids.shape[1])
    fresh = compressed()
    prefill(model, fresh, ids)
    want = _greedy_in_session(model, fresh, ids.shape[1], q, 6, {tok.eos_token_id})
    assert len(want) >= 3  # an answer of some length, not an immediate end of text
    # the first ask follows the question asked above, the second follows the first
    for _ in range(2):
        assert ctx.ask(" Lily found a", max_new_tokens=6) == tok.decode(want, skip_special_tokens=True)


def test_generate_over_a_ragged_cache(stories):
    """After a shared-budget compression, model.generate decodes over ragged heads (H2O keeps evicting)."""
    model, tok = stories
    ids = _ids(tok, 100)
    cache = CompressedCache(model.config, eviction=H2O(budget=48, scope="layer"))
    with compress(model, cache), torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
    assert out.shape[1] == 112
    per_head = torch.stack([layer.head_lengths() for layer in cache.layers])
    assert bool((per_head.sum(-1) <= 48 * per_head.shape[-1]).all())


# --------------------------------------------------------------------------- errors: never a silent no-op


def test_kvzip_without_its_pass_raises(stories):
    model, tok = stories
    ids = _ids(tok, 80)
    cache = CompressedCache(model.config, eviction=KVzip(budget=0.3))
    with compress(model, cache), torch.no_grad(), pytest.raises(RuntimeError, match="kv_cache.prefill"):
        model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="tokenizer"):
        prefill(model, CompressedCache(model.config, eviction=KVzip(budget=0.3)), ids)
    with pytest.raises(ValueError, match="batch 1"):
        prefill(model, CompressedCache(model.config, eviction=KVzip(budget=0.3)), ids.repeat(2, 1), tokenizer=tok)


def test_shared_budgets_need_the_native_attention(stories):
    model, tok = stories
    ids = _ids(tok, 80)
    for pol in (SnapKV(budget=0.5, recent_window=8, scope="layer"), KVzip(budget=0.5, scope="head")):
        cache = CompressedCache(model.config, eviction=pol)
        with compress(model, cache, attention="reference"), torch.no_grad(), \
                pytest.raises(RuntimeError, match="native"):
            model(input_ids=ids, past_key_values=cache, use_cache=True)


def test_bad_scopes_and_inputs():
    with pytest.raises(ValueError, match=r"scope must be one of \['head', 'layer', 'model'\]; got 'all'"):
        SnapKV(scope="all")
    with pytest.raises(ValueError, match="head_floor"):
        H2O(head_floor=1.5)
    with pytest.raises(ValueError, match="scope='head'"):
        StreamingLLM(budget=64, scope="layer")
    with pytest.raises(ValueError, match="chunk_size"):
        KVzip(chunk_size=0)


def test_prefill_and_session_errors(stories):
    model, tok = stories
    cache = CompressedCache(model.config)
    with pytest.raises(RuntimeError, match="prefilled context"):
        with cache.session():
            pass
    with pytest.raises(ValueError, match="integer tensor"):
        prefill(model, cache, torch.rand(1, 4))
    with pytest.raises(ValueError, match="no token"):
        prefill(model, cache, torch.zeros(1, 0, dtype=torch.long))
    ids = _ids(tok, 40)
    prefill(model, cache, ids)
    with pytest.raises(ValueError, match="empty cache"):
        prefill(model, cache, ids)
    with pytest.raises(TypeError, match="CompressedCache"):
        prefill(model, DynamicCache(), ids)


@pytest.mark.parametrize("quant", ["none", "q4"])
def test_left_padded_batch_equals_each_row_alone(stories, quant):
    """A shared budget on a left-padded batch keeps, per row, what the row alone would keep."""
    model, tok = stories
    texts = ["Once upon a time there was a little girl named Lily. She loved to play outside in the park. " * 3,
             "Tom had a big red ball. He liked to kick it far away. " * 2]
    q = tok(" She", return_tensors="pt", add_special_tokens=False).input_ids
    alone = []
    for t in texts:
        ids = tok(t, return_tensors="pt").input_ids
        cache = CompressedCache(model.config, quant=QUANTS[quant],
                                eviction=SnapKV(budget=40, recent_window=8, scope="layer"))
        prefill(model, cache, ids)
        alone.append(_next_logits(model, cache, ids, q))
    batch = tok(texts, return_tensors="pt", padding=True)
    cache = CompressedCache(model.config, quant=QUANTS[quant], eviction=SnapKV(budget=40, recent_window=8, scope="layer"))
    prefill(model, cache, batch.input_ids, attention_mask=batch.attention_mask)
    T = batch.input_ids.shape[1]
    mask = torch.cat([batch.attention_mask, torch.ones(2, q.shape[1], dtype=torch.long)], 1)
    with compress(model, cache), cache.session(), torch.no_grad():
        out = model(input_ids=q.repeat(2, 1), attention_mask=mask, past_key_values=cache, use_cache=True)
    # quantization groups of the padded row span its padding, so only the unpadded row is exact there
    for r in (range(2) if quant == "none" else [0]):
        torch.testing.assert_close(out.logits[r, -1], alone[r], rtol=2e-3, atol=2e-3)
    assert int(batch.attention_mask[1].sum()) < T  # row 1 was padded
