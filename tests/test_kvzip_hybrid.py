"""KVzip on hybrid and soft-capped models against a float64 eager oracle (math dictionary §19.3, §22).

The oracle runs the model itself in float64 with transformers' eager attention over the whole
sequence (the context followed by one repeat chunk, no cache): a test-only attention function,
registered in transformers' ``AttentionInterface`` under its own name, records every layer's
post-RoPE queries and keys and then calls the model's own ``eager_attention_forward`` (soft-capping
and sliding window included). KVzip's scores are then formed by hand from those queries and keys
and compared with what the library's reconstruction pass left in each layer.
"""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import kv_cache
from kv_cache import H2O, CompressedCache, KVzip, SnapKV
from kv_cache.cache.architecture import layer_windows
from kv_cache.attention.dense import materialize
from kv_cache.context import forward_at, reconstruct

WINDOW = 16
HYBRID = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, sliding_window=WINDOW, layer_types=HYBRID, query_pre_attn_scalar=24)
CONFIGS = {
    "gemma2": ("gemma2", dict(attn_logit_softcapping=5.0)),  # a low cap: most logits are bent by it
    "gemma3_text": ("gemma3_text", dict()),
}
ORACLE = "kv_cache_test_oracle"


class _Tok:
    """A tokenizer stand-in: the repeat prompts as fixed ids (``kv_cache.context.reconstruct`` reads ``encode``)."""

    bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [5 + (ord(c) % 200) for c in text[:12]]


def _model(name: str, **over):
    kind, extra = CONFIGS[name]
    cfg = AutoConfig.for_model(kind, **{**BASE, **extra, **over})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # widen the logits (to |s| ~ 30) so attention is far from uniform and the cap bends it
        for n, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(2.5 * (6.0 if n.endswith(("q_proj.weight", "k_proj.weight")) else 1.0))
    return model


def _capture(model, ids: torch.Tensor) -> dict:
    """``{layer: (q [1, Hq, N, d], k [1, Hkv, N, d], scaling, softcap, window)}`` float64, from one
    eager forward of ``ids`` ``[1, N]`` without a cache, in float64 (a copy of the model)."""
    seen = {}

    def record(module, query, key, value, attention_mask, **kw):
        seen[module.layer_idx] = (query, key, kw.get("scaling"), kw.get("softcap"), kw.get("sliding_window"))
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(ORACLE, record)
    AttentionMaskInterface.register(ORACLE, eager_mask)
    twin = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").double().eval()
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation(ORACLE)
    with torch.no_grad():
        twin(input_ids=ids, use_cache=False)
    return seen


def _chunks(ids: list[int], pol: KVzip, tok: _Tok) -> list[tuple[list[int], int, int, int]]:
    """``(chunk ids, sinks, start, end)`` as ``reconstruct`` feeds them (math dictionary §19.3)."""
    from kv_cache.policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT

    out, n = [], len(ids)
    for s in range(0, n, pol.chunk_size):
        e = min(n, s + pol.chunk_size)
        head = tok.encode(REPEAT_PROMPT) if s == 0 else tok.encode(CONTINUE_PROMPT) + ids[max(0, s - pol.overlap):s]
        out.append((head + ids[s:e], min(pol.sink_tokens, s), s, e))
    return out


def oracle_scores(model, ids: list[int], pol: KVzip, tok: _Tok, capped: bool = True) -> dict[int, torch.Tensor]:
    """KVzip's scores ``[1, Hkv, T]`` float64 per full-attention layer, by hand from the model's
    own float64 queries and keys: for query ``i`` of a chunk and query head ``g``, the softmax of
    ``c tanh(q.k tau / c)`` over the sinks, the repeated slots and the chunk up to ``i``; a slot's
    score is its largest probability over chunks, queries and the ``G`` heads of its KV head."""
    T = len(ids)
    full = [i for i, w in enumerate(layer_windows(model.config)) if w is None]
    best = {i: None for i in full}
    for chunk, sinks, s, e in _chunks(ids, pol, tok):
        seen = _capture(model, torch.tensor([ids + chunk]))
        for i in full:
            q, k, scaling, softcap, _ = seen[i]
            Hq, Hkv, L = q.shape[1], k.shape[1], len(chunk)
            G = Hq // Hkv
            slots = list(range(sinks)) + list(range(s, e))
            keys = torch.cat([k[:, :, slots], k[:, :, T:]], 2).repeat_interleave(G, 1)  # [1, Hq, n + L, d]
            logits = q[:, :, T:] @ keys.transpose(-1, -2) * scaling
            if capped and softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            own = torch.arange(L)
            causal = torch.cat([torch.ones(L, len(slots), dtype=torch.bool), own[None, :] <= own[:, None]], 1)
            p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)[..., sinks:len(slots)]
            chunk_best = p.amax(2).reshape(1, Hkv, G, e - s).amax(2)
            acc = torch.zeros(1, Hkv, T, dtype=torch.float64) if best[i] is None else best[i]
            acc[..., s:e] = torch.maximum(acc[..., s:e], chunk_best)
            best[i] = acc
    return best


def library_scores(model, ids: list[int], pol: KVzip, tok: _Tok) -> tuple[CompressedCache, dict[int, torch.Tensor]]:
    cache = CompressedCache(model.config, eviction=pol)
    with torch.no_grad(), kv_cache.compress(model, cache):
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        reconstruct(model, cache, torch.tensor(ids), tok, finish=False)
    return cache, {i: layer.state["kvzip"] for i, layer in enumerate(cache.layers) if layer.policy is not None}


def _context(T: int = 60) -> list[int]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(3, 512, (T,), generator=g).tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kvzip_scores_match_float64_eager_oracle(name):
    """Chunks longer than the window: the sliding layers attend the repeat chunk by positions,
    the full layers score it; every full layer's scores equal the oracle's."""
    model = _model(name)
    ids, tok = _context(), _Tok()
    pol = KVzip(budget=0.25, chunk_size=24, overlap=4)
    _, got = library_scores(model, ids, pol, tok)
    want = oracle_scores(model, ids, pol, tok)
    assert sorted(got) == sorted(want) == [1, 3]
    for i in want:
        torch.testing.assert_close(got[i].double(), want[i], atol=2e-5, rtol=2e-4, msg=f"layer {i}")
    if name == "gemma2":  # the cap matters: without it the scores are far from the model's
        plain = oracle_scores(model, ids, pol, tok, capped=False)
        assert max(float((plain[i] - want[i]).abs().max()) for i in want) > 0.05


def oracle_continuation(model, ids: list[int], n: int, capped: bool = True) -> dict[int, torch.Tensor]:
    """The continuation scores ``[1, Hkv, T]`` float64 per full-attention layer (math dictionary
    §19.7): the probabilities the context's last ``n`` queries give each slot (causal softmax of the
    capped logits over the context), summed over those queries, the largest over the ``G`` query
    heads of each KV head."""
    T = len(ids)
    seen = _capture(model, torch.tensor([ids]))
    out = {}
    for i, w in enumerate(layer_windows(model.config)):
        if w is not None:
            continue
        q, k, scaling, softcap, _ = seen[i]
        Hq, Hkv = q.shape[1], k.shape[1]
        logits = q[:, :, T - n:] @ k.repeat_interleave(Hq // Hkv, 1).transpose(-1, -2) * scaling  # [1, Hq, n, T]
        if capped and softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        causal = torch.arange(T)[None, :] <= torch.arange(T - n, T)[:, None]
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1).sum(2)  # [1, Hq, T]
        out[i] = p.reshape(1, Hkv, Hq // Hkv, T).amax(2)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_continuation_scores_match_float64_eager_oracle(name):
    """``KVzip(continuation_queries=n)`` (§19.7): the attention of the context's last ``n`` queries,
    taken by the prefill's own attention call, equals the float64 eager oracle (soft-capped on Gemma
    2), the policy scores each slot by the larger of its two scores, and neither is held after the
    eviction (the bytes held are the cache's tensors only)."""
    from kv_cache.policies.base import ScoreInputs

    model = _model(name)
    ids, tok = _context(), _Tok()
    pol = KVzip(budget=0.25, chunk_size=24, overlap=4, continuation_queries=10)
    cache, recon = library_scores(model, ids, pol, tok)
    want = oracle_continuation(model, ids, 10)
    assert sorted(want) == sorted(recon) == [1, 3]
    for i in want:
        got = cache.layers[i].state["kvzip_continuation"]
        torch.testing.assert_close(got.double(), want[i], atol=2e-5, rtol=2e-4, msg=f"layer {i}")
        inputs = ScoreInputs(shape=tuple(got.shape), keys=None, query=None, key_valid=None, scaling=1.0,
                             state=cache.layers[i].state)
        torch.testing.assert_close(pol.score(inputs), torch.maximum(recon[i].float(), got.float()))
        assert bool((got > recon[i]).any()), "the test should reach slots the repeat pass does not rank first"
    torch.testing.assert_close(  # without the option the reconstruction scores are untouched
        library_scores(model, ids, KVzip(budget=0.25, chunk_size=24, overlap=4), tok)[1][1], recon[1])
    cache.finish_reconstruction()
    assert all("kvzip_continuation" not in layer.state and "kvzip" not in layer.state for layer in cache.layers)


def test_continuation_queries_is_validated_and_hidden_at_its_default():
    for bad in (-1, 1.5, True, "96"):
        with pytest.raises(ValueError, match="continuation_queries must be an int >= 0"):
            KVzip(budget=0.25, continuation_queries=bad)
    from kv_cache.cache.serialize_state import _decode_policy, _encode_policy

    plain, with_cont = KVzip(budget=0.25), KVzip(budget=0.25, continuation_queries=96)
    assert "continuation_queries" not in repr(plain) and "continuation_queries=96" in repr(with_cont)
    assert "continuation_queries" not in _encode_policy(plain)["fields"]  # files and plan fingerprints as before
    assert _decode_policy(_encode_policy(with_cont)) == with_cont


def test_kvzip_on_softcapped_gemma2_evicts_and_decodes():
    """KVzip(budget=0.25) on Gemma 2 (soft-capped, hybrid): the model-wide budget is spent on the
    full-attention layers, which then hold different numbers of tokens per head (ragged rows
    read by positions with the cap), and decoding continues from them."""
    model = _model("gemma2")
    ids, tok = _context(80), _Tok()
    cache = CompressedCache(model.config, eviction=KVzip(budget=0.25))
    with torch.no_grad(), kv_cache.compress(model, cache):
        kv_cache.prefill(model, cache, torch.tensor([ids]), tokenizer=tok)
        out = model.generate(torch.tensor([ids + [7]]), past_key_values=cache, max_new_tokens=5, do_sample=False,
                             pad_token_id=0)
    assert out.shape[1] == len(ids) + 6
    full = [layer for layer in cache.layers if layer.window is None]
    kept = torch.stack([layer.head_lengths()[0] for layer in full]).float()  # [layers, Hkv] after 6 more tokens
    assert abs(float(kept.mean()) - 6 - 0.25 * len(ids)) <= 1.0
    assert all(layer.storage.length <= WINDOW - 1 for layer in cache.layers if layer.window is not None)


_RECORDED: dict = {}


class _RecordingSnapKV(SnapKV):
    def score(self, inputs):
        _RECORDED[inputs.layer_idx] = (inputs.attention.clone(), inputs.attention_queries)
        return super().score(inputs)


class _RecordingH2O(H2O):
    def score(self, inputs):
        _RECORDED.setdefault(inputs.layer_idx, (inputs.attention.clone(), inputs.attention_queries))
        return super().score(inputs)


@pytest.mark.parametrize("policy", [_RecordingSnapKV(budget=0.5), _RecordingH2O(budget=0.5)],
                         ids=["snapkv", "h2o"])
def test_softcapped_statistics_match_float64_eager_oracle(policy):
    """On Gemma 2's soft-capped full-attention layers the positional path hands H2O / SnapKV the
    probabilities of their queries, summed per query head: those of the model's own capped softmax."""
    model = _model("gemma2")
    ids = _context(50)
    _RECORDED.clear()
    cache = CompressedCache(model.config, eviction=policy)
    with torch.no_grad(), kv_cache.compress(model, cache):
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    seen = _capture(model, torch.tensor([ids]))
    assert sorted(_RECORDED) == [1, 3]
    T = len(ids)
    for i, (got, n) in _RECORDED.items():
        q, k, scaling, softcap, _ = seen[i]
        G = q.shape[1] // k.shape[1]
        logits = softcap * torch.tanh(q @ k.repeat_interleave(G, 1).transpose(-1, -2) * scaling / softcap)
        pos = torch.arange(T)
        p = torch.softmax(logits.masked_fill(pos[None, :] > pos[:, None], float("-inf")), -1)
        want = p[:, :, T - n:].sum(2)  # [1, Hq, T]
        assert n == (T if isinstance(policy, H2O) else policy.query_window(T, cache.layers[i].resolved_budget()[1]))
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-4, msg=f"layer {i}")
    full = [layer for layer in cache.layers if layer.window is None]
    assert all(int(layer.head_lengths().max()) == layer.resolved_budget()[1] < T for layer in full)


def _kept_slots(cache, reference: DynamicCache, T: int) -> dict[int, torch.Tensor]:
    """``{layer: [Hkv, T] bool}``: which context slots each full-attention head of ``cache`` kept,
    found by matching its keys against the uncompressed prefill's (every key is distinct)."""
    kept = {}
    for i, layer in enumerate(cache.layers):
        if layer.policy is None:
            continue
        k, _, held = materialize(layer.storage.blocks())
        ref = reference.layers[i].keys.float()[0]  # [Hkv, T, d]
        mask = torch.zeros(ref.shape[0], T, dtype=torch.bool)
        for h in range(ref.shape[0]):
            rows = k[0, h] if held is None else k[0, h][held[0, h]]
            dist = (rows[:, None] - ref[h][None]).abs().amax(-1)  # [kept, T]
            assert float(dist.min(1).values.max()) < 1e-4
            mask[h, dist.argmin(1)] = True
        kept[i] = mask
    return kept


@pytest.mark.parametrize("name", list(CONFIGS))
def test_after_kvzip_the_continuation_is_the_model_with_the_evicted_slots_masked(name):
    """After KVzip on a hybrid model, a continuation longer than the window gives the logits of the
    model itself (float64 eager, no cache) with exactly the evicted context slots hidden from the
    full-attention layers' queries: the sliding layers' window, positions and local / global RoPE
    after the repeat pass and the eviction are the model's."""
    model = _model(name)
    T, C = 70, 24  # C > WINDOW: the continuation's sliding layers go by positions
    ids, tok = _context(T + C), _Tok()
    reference = DynamicCache(config=model.config)
    cache = CompressedCache(model.config, eviction=KVzip(budget=0.5, chunk_size=32))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids[:T]]), past_key_values=reference, use_cache=True)
        with kv_cache.compress(model, cache):
            kv_cache.prefill(model, cache, torch.tensor([ids[:T]]), tokenizer=tok)
            kept = _kept_slots(cache, reference, T)
            got = forward_at(model, cache, torch.tensor([ids[T:]]), T)[0].double()
    assert sorted(kept) == [1, 3] and sum(int(m.sum()) for m in kept.values()) == round(0.5 * T) * 2 * 2
    want = _masked_logits(model, ids, T, kept)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    full = _masked_logits(model, ids, T, {})
    assert float((full - want).abs().max()) > 1e-2  # the eviction changed the answer: the test can fail


def _masked_logits(model, ids: list[int], T: int, kept: dict[int, torch.Tensor]) -> torch.Tensor:
    """float64 eager logits ``[len(ids) - T, vocab]`` of positions ``T..``, with the context slots
    not in ``kept[layer]`` (``[Hkv, T]``) hidden from those queries in each listed layer."""
    name = ORACLE + "_masked"

    def attend(module, query, key, value, attention_mask, **kw):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        m = kept.get(module.layer_idx)
        if m is not None:
            G = query.shape[1] // key.shape[1]
            mask = attention_mask.expand(1, query.shape[1], *attention_mask.shape[2:]).clone()
            hide = ~m.repeat_interleave(G, 0)[:, None, :]  # [Hq, 1, T]
            mask[0, :, T:, :T] = mask[0, :, T:, :T].masked_fill(hide, float("-inf"))
            attention_mask = mask
        return eager(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, eager_mask)
    twin = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").double().eval()
    twin.load_state_dict(model.state_dict())
    twin.set_attn_implementation(name)
    with torch.no_grad():
        return twin(input_ids=torch.tensor([ids])).logits[0, T:]


def test_memory_report_says_what_eviction_reaches_on_a_hybrid_model():
    """``1 - (1 - b) rho_f`` (math dictionary §22.8): 2 full layers of 70 tokens, 2 sliding ones of
    ``W - 1 = 15``: eviction reaches 140 / 170 = 82%, KVzip at 0.5 holds 70 + 30 of the 170."""
    model = _model("gemma3_text")
    cache = CompressedCache(model.config, eviction=KVzip(budget=0.5))
    with torch.no_grad(), kv_cache.compress(model, cache):
        kv_cache.prefill(model, cache, torch.tensor([_context(70)]), tokenizer=_Tok())
    notes = [n for n in cache.memory_report().notes if n.startswith("eviction acts on")]
    assert notes == ["eviction acts on the 2 full-attention layers only, 82% of the tokens an uncompressed cache "
                     "would hold here (the sliding layers keep their window): 100 of those 170 tokens per KV head, "
                     "summed over the layers, are held (math dictionary §22.8)"]
    assert not [n for n in CompressedCache(model.config).memory_report().notes if n.startswith("eviction acts")]
