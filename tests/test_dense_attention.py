"""Model-free checks of the positional path (math dictionary §22): sliding windows, soft-capping,
padding and learned sinks against a float64 softmax over explicit masks."""

from __future__ import annotations

import pytest
import torch

from kv_cache.attention.dense import apply_learned_sinks, attend_positions


def _oracle(q, k, v, scaling, G, q_pos, k_pos, window, softcap, valid, sinks=None):
    B, H, M, d = q.shape
    L = q_pos.numel()
    qq = q.double().reshape(B, H, G, L, d)
    s = torch.einsum("bhgld,bhtd->bhglt", qq, k.double()) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    mask = seen[None, None, None].expand_as(s).clone()
    if valid is not None:
        mask &= valid[:, :, None, None, :] | (k_pos[None, :] == q_pos[:, None])[None, None, None]
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        col = sinks.double().reshape(1, H, G, 1, 1).expand(B, H, G, L, 1)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("bhglt,bhtd->bhgld", p, v.double()).reshape(B, H, M, -1)


@pytest.mark.parametrize("window", [None, 1, 5, 64])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_positions_matches_explicit_masks(window, softcap, dtype, monkeypatch):
    from kv_cache.attention import dense

    monkeypatch.setattr(dense, "CHUNK_BYTES", 4096)  # several query chunks, each with its own key slice
    g = torch.Generator().manual_seed(0)
    B, H, G, S, L, d = 2, 2, 3, 9, 7, 16
    q = torch.randn(B, H, G * L, d, generator=g).to(dtype)
    k = torch.randn(B, H, S + L, d, generator=g).to(dtype)
    v = torch.randn(B, H, S + L, d, generator=g).to(dtype)
    k_pos = torch.arange(100, 100 + S + L)
    q_pos = k_pos[S:]
    valid = torch.ones(B, H, S + L, dtype=torch.bool)
    valid[1, :, :4] = False  # left padding of row 1
    out, lse = attend_positions(q, k, v, 0.3, G, q_pos, k_pos, window=window, softcap=softcap, key_valid=valid)
    assert out.dtype == torch.float32 and lse.shape == (B, H, G * L)
    want = _oracle(q, k, v, 0.3, G, q_pos, k_pos, window, softcap, valid)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_learned_sinks_equal_one_more_logit():
    g = torch.Generator().manual_seed(1)
    B, H, G, L, d = 1, 2, 2, 5, 8
    q = torch.randn(B, H, G * L, d, generator=g)
    k, v = torch.randn(B, H, L, d, generator=g), torch.randn(B, H, L, d, generator=g)
    pos = torch.arange(L)
    sinks = torch.randn(H * G, generator=g)
    out, lse = attend_positions(q, k, v, 0.5, G, pos, pos)
    got, _ = apply_learned_sinks(out, lse, sinks, H)
    want = _oracle(q, k, v, 0.5, G, pos, pos, None, None, None, sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="learned sinks: 3 values for 2 KV heads"):
        apply_learned_sinks(out, lse, torch.zeros(3), H)


def test_wrong_shapes_are_refused():
    q = torch.zeros(1, 1, 6, 4)
    with pytest.raises(ValueError, match=r"q has 6 rows; expected group \(4\) x positions \(2\)"):
        attend_positions(q, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 1.0, 4, torch.arange(2), torch.arange(2))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("n_stat", [1, 4, 7])
def test_observed_sums_are_the_last_queries_probabilities(window, softcap, n_stat, monkeypatch):
    """``attend_positions_observed``: the output of ``attend_positions`` and, per query head, the
    probabilities of the last ``n`` queries summed over them (the same capped, windowed softmax)."""
    from kv_cache.attention import dense
    from kv_cache.attention.dense import attend_positions_observed

    monkeypatch.setattr(dense, "CHUNK_BYTES", 4096)  # several query chunks: the sums span them
    g = torch.Generator().manual_seed(2)
    B, H, G, S, L, d = 2, 2, 3, 9, 7, 16
    q = torch.randn(B, H, G * L, d, generator=g) * 2
    k, v = torch.randn(B, H, S + L, d, generator=g), torch.randn(B, H, S + L, d, generator=g)
    k_pos = torch.arange(S + L)
    q_pos = k_pos[S:]
    valid = torch.ones(B, H, S + L, dtype=torch.bool)
    valid[1, :, :4] = False
    out, lse, attn = attend_positions_observed(q, k, v, 0.3, G, q_pos, k_pos, n_stat, window=window,
                                               softcap=softcap, key_valid=valid)
    plain, _ = attend_positions(q, k, v, 0.3, G, q_pos, k_pos, window=window, softcap=softcap, key_valid=valid)
    torch.testing.assert_close(out, plain)
    # the oracle's probabilities: its output against the identity as values
    eye = torch.eye(S + L, dtype=torch.float64).expand(B, H, S + L, S + L)
    p = _oracle(q, k, eye, 0.3, G, q_pos, k_pos, window, softcap, valid).reshape(B, H, G, L, S + L)
    want = p[:, :, :, L - n_stat:].sum(3).reshape(B, H * G, S + L)
    assert attn.shape == (B, H * G, S + L) and attn.dtype == torch.float32
    torch.testing.assert_close(attn.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"stat_queries must be an int in \[1, 7\].*got 0"):
        attend_positions_observed(q, k, v, 0.3, G, q_pos, k_pos, 0)
