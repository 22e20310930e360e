"""Batched selection: budgets, windows, sinks, padding, pooling, GQA (layers 1 and 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kv_cache.compression import (
    pool_scores,
    reduce_gqa,
    select_tokens,
    snapkv_scores,
    streaming_llm_indices,
    window_attention,
)


def test_per_head_topk_with_sinks_and_window():
    scores = torch.zeros(1, 2, 10)
    scores[0, 0, 4] = 5.0
    scores[0, 1, 6] = 5.0
    idx = select_tokens(scores, 5, recent_window=2, sink_tokens=2)
    assert idx[0, 0].tolist() == [0, 1, 4, 8, 9]
    assert idx[0, 1].tolist() == [0, 1, 6, 8, 9]


def test_ties_prefer_earlier_tokens():
    idx = select_tokens(torch.ones(1, 1, 8), 3, recent_window=1)
    assert idx.tolist() == [[[0, 1, 7]]]


def test_padding_is_never_selected_while_valid_tokens_remain():
    scores = torch.tensor([[[9.0, 9.0, 1.0, 2.0, 3.0, 4.0]]])
    valid = torch.tensor([[False, False, True, True, True, True]])[:, None, :]
    idx = select_tokens(scores, 3, recent_window=1, sink_tokens=1, valid=valid)
    assert idx.tolist() == [[[2, 4, 5]]]  # sink = first valid token (2), not padding
    idx = select_tokens(scores, 5, valid=valid)
    assert idx.tolist() == [[[0, 2, 3, 4, 5]]]  # only 4 valid: one padding slot fills K


def test_pool_scores_matches_avg_pool1d_and_max():
    s = torch.rand(2, 3, 17)
    ref = F.avg_pool1d(s.reshape(-1, 1, 17), 5, 1, 2).reshape(2, 3, 17)
    torch.testing.assert_close(pool_scores(s, 5, "avg"), ref)
    m = pool_scores(s, 3, "max")
    torch.testing.assert_close(m[..., 1], s[..., :3].amax(-1))
    torch.testing.assert_close(pool_scores(s, 1), s)


def test_gqa_reduction_follows_repeat_kv_layout():
    s = torch.arange(12.0).reshape(1, 6, 2)  # 6 query heads, 2 KV heads -> groups {0,1,2} {3,4,5}
    torch.testing.assert_close(reduce_gqa(s, 2, "mean"), torch.tensor([[[2.0, 3.0], [8.0, 9.0]]]))
    torch.testing.assert_close(reduce_gqa(s, 2, "max"), torch.tensor([[[4.0, 5.0], [10.0, 11.0]]]))


def test_window_attention_matches_full_causal_softmax():
    torch.manual_seed(0)
    B, Hq, Hk, T, D, w = 2, 4, 2, 12, 8, 3
    q = torch.randn(B, Hq, T, D)
    k = torch.randn(B, Hk, T, D)
    k_rep = k.repeat_interleave(Hq // Hk, dim=1)
    full = (q @ k_rep.transpose(-1, -2)) * D**-0.5
    full = full.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    got = window_attention(q[:, :, -w:], k)
    torch.testing.assert_close(got, full[:, :, -w:], rtol=1e-5, atol=1e-6)


def test_snapkv_scores_reference():
    attn = torch.rand(1, 4, 3, 9).softmax(-1)
    ref = F.avg_pool1d(attn.mean(2).reshape(-1, 1, 9), 3, 1, 1).reshape(1, 4, 9)
    ref = ref.reshape(1, 2, 2, 9).mean(2)
    torch.testing.assert_close(snapkv_scores(attn, 2, kernel_size=3), ref)


def test_streaming_llm_indices():
    assert streaming_llm_indices(10, 2, 3).tolist() == [0, 1, 7, 8, 9]
    assert streaming_llm_indices(4, 2, 3).tolist() == [0, 1, 2, 3]


def test_drop_lowest_path_equals_the_stable_sort():
    """Dropping few tokens (O(T) path) keeps exactly what the stable descending sort keeps,
    ties dropping the later token, with padding, sinks and windows."""
    from kv_cache.compression.selection import forced_mask

    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        T = int(torch.randint(1, 60, (1,), generator=g))
        k = int(torch.randint(1, T + 1, (1,), generator=g))
        s = torch.randint(0, 4, (2, 3, T), generator=g).float()  # many ties
        valid = torch.rand(2, 1, T, generator=g) > 0.2
        w = int(torch.randint(0, k + 1, (1,), generator=g))
        sk = int(torch.randint(0, k - w + 1, (1,), generator=g))
        got = select_tokens(s, k, recent_window=w, sink_tokens=sk, valid=valid)
        forced = forced_mask(valid.expand_as(s), sink_tokens=sk, recent_window=w)
        pr = torch.where(forced, float("inf"), torch.where(valid.expand_as(s), s, float("-inf")))
        ref = torch.sort(torch.sort(pr, dim=-1, descending=True, stable=True).indices[..., :k], dim=-1).values
        assert torch.equal(got, ref)


def test_dropping_one_token_matches_the_stable_sort_with_and_without_valid():
    """H2O's decoding step (drop one token per row, no padding) takes a shorter path; it keeps
    exactly what the stable descending sort keeps, ties included (the later token goes)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        T = int(torch.randint(6, 40, (1,), generator=gen))
        scores = torch.randint(0, 4, (2, 3, T), generator=gen).float()  # many ties
        window, sinks = trial % 3, trial % 2
        budget = T - 1 if trial % 2 == 0 else int(torch.randint(window + sinks + 1, T, (1,), generator=gen))
        prio = scores.clone()
        prio[..., :sinks] = float("inf")
        if window:
            prio[..., T - window:] = float("inf")
        want = torch.sort(torch.sort(prio, dim=-1, descending=True, stable=True).indices[..., :budget], dim=-1).values
        got = select_tokens(scores, budget, recent_window=window, sink_tokens=sinks)
        got_valid = select_tokens(scores, budget, recent_window=window, sink_tokens=sinks,
                                  valid=torch.ones(2, 1, T, dtype=torch.bool))
        assert torch.equal(got, want) and torch.equal(got_valid, want)
