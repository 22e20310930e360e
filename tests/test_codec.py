"""The storage codec of ``.kvc`` files (kv_cache.codec, math dictionary §27).

Model-free: the transform, the allocation, the entropy coder, the basis file. Tiny model
(stories260K, a basis fitted here): save -> load -> ask through the codec, the byte target, the
version-2 files, and hostile payloads (re-hashed, so only the codec's own checks stand between
them and a large allocation)."""

from __future__ import annotations

import hashlib
import math
import json
import struct

import numpy as np
import pytest
import torch

from kv_cache import CompressedCache, CompressedContext, KVzip, QuantConfig, SnapKV
from kv_cache.cache import serialize
from kv_cache.cache.serialize import load_cache, read_info, save_cache
from kv_cache.codec import CodecBasisError, CodecSettings, load_basis, save_basis
from kv_cache.codec import ans
from kv_cache.codec.allocation import MAX_SYMBOL, allocate, laplace_bits, rd_table
from kv_cache.plan.codec_calibration import fit_codec_basis
from kv_cache.codec.transform import accumulate_moments, fit_basis, from_components, query_metric, to_components
from kv_cache.compression.scorer_file import model_identity

DOC = "One day, Tom went to the shop with his mom. He wanted a red car and a blue ball. " * 5
CALIB = "Once upon a time there was a little girl named Lily. She liked to play with her ball in the park. " * 40


# ------------------------------------------------------------------------------- model-free
def test_basis_is_orthonormal_sorted_and_inverts_exactly():
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(16, 16, generator=g)
    x = torch.randn(500, 16, generator=g) @ mix + 5.0
    mu, U, lam = fit_basis(accumulate_moments(x[:250], accumulate_moments(x[250:])))
    assert torch.allclose(U.T @ U, torch.eye(16), atol=1e-5)
    assert (lam[:-1] >= lam[1:]).all() and (lam >= 0).all()
    assert torch.allclose(mu, x.mean(0), atol=1e-4)
    c = to_components(x, mu, U)
    assert torch.allclose(from_components(c, mu, U), x, atol=1e-4)
    assert torch.allclose(c.var(0, unbiased=False), lam, rtol=1e-3, atol=1e-3)  # the variances are the components'


def test_query_metric_turns_key_error_into_logit_error():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4000, 8, generator=g, dtype=torch.float64) * torch.tensor([5, 3, 1, 1, .5, .2, .1, .1]).double()
    a = query_metric(q.T @ q, q.shape[0]).double()
    delta = torch.randn(8, generator=g, dtype=torch.float64)
    assert torch.allclose((q @ delta).pow(2).mean(), (delta @ a).pow(2).sum(), rtol=1e-6)
    x = torch.randn(300, 8, generator=g)
    mu, U, lam = fit_basis(accumulate_moments(x), a.float())
    inv = torch.linalg.inv(a).float()
    c = to_components(x, mu, U, a.float())
    assert torch.allclose(from_components(c, mu, U, inv), x, atol=1e-4)  # exact inverse pair
    assert torch.allclose(c.var(0, unbiased=False), lam, rtol=1e-3, atol=1e-3)  # PCA after the metric
    with pytest.raises(ValueError, match="at least one query"):
        query_metric(torch.zeros(8, 8), 0)


def test_moments_refuse_bad_input():
    with pytest.raises(ValueError, match=r"\[N, d\]"):
        accumulate_moments(torch.zeros(3))
    with pytest.raises(ValueError, match="NaN or Inf"):
        accumulate_moments(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="at least 2 vectors"):
        fit_basis(accumulate_moments(torch.ones(1, 4)))
    mu, U, lam = fit_basis(accumulate_moments(torch.ones(10, 4)))  # constant channels: zero variances
    assert torch.equal(lam, torch.zeros(4)) and torch.allclose(U.T @ U, torch.eye(4), atol=1e-6)


def test_laplace_bits_match_a_normalised_distribution():
    q = torch.arange(-400, 401).float()[None]
    for b in (0.05, 0.7, 3.0, 40.0):
        p = torch.pow(2.0, -laplace_bits(q, torch.tensor([[b]])))
        assert abs(float(p.sum()) - 1) < 1e-3


def test_allocation_meets_the_budget_and_more_budget_means_less_error():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 200, generator=g) * torch.logspace(1, -2, 32)[:, None]
    rate, dist, _ = rd_table(x)
    assert torch.allclose(dist[:, 0], x.pow(2).sum(-1))  # skip: the row's energy
    assert rate[:, 0].eq(0).all()
    last = float("inf")
    for budget in (0, 500, 2000, 8000, 30000):
        c = allocate(rate, dist, budget)
        assert float(rate.gather(1, c[:, None]).sum()) <= budget
        d = float(dist.gather(1, c[:, None]).sum())
        assert d <= last
        last = d
    assert allocate(rate, dist, 0).eq(0).all()
    big = allocate(rate, dist, 1e9)
    assert (big > 0).all()  # everything coded when bits are free
    with pytest.raises(ValueError, match="finite number of bits"):
        allocate(rate, dist, -1)
    with pytest.raises(ValueError, match=r"\[rows, T\]"):
        rd_table(torch.zeros(5))


@pytest.mark.parametrize("coder", ans.CODERS)
def test_ans_roundtrip_and_damaged_streams(coder):
    rng = np.random.default_rng(0)
    scales = ans.snap_scale(rng.uniform(0.05, 50, 5000))
    sym = np.clip(np.round(rng.laplace(0, scales)), -MAX_SYMBOL, MAX_SYMBOL).astype(np.int32)
    sym[:3] = [MAX_SYMBOL, -MAX_SYMBOL, 0]  # the ends of the support, under small scales
    words = ans.encode(sym, scales, coder)
    assert np.array_equal(ans.decode(words, scales, coder), sym)
    for bad in (np.concatenate([words, words[:2]]), np.concatenate([words, [7, 9, 11]])):
        try:  # words left over, or decoded into other symbols (the file's sha256 of its symbols catches those)
            assert not np.array_equal(ans.decode(bad, scales, coder), sym)
        except ans.CodecStreamError:
            pass
    short = words[:-3]  # ANS has no check of its own: a cut stream decodes to as many other symbols, or fails
    try:
        assert ans.decode(short, scales, coder).shape == sym.shape
    except ans.CodecStreamError:
        pass
    with pytest.raises(ans.CodecStreamError, match="finite"):
        ans.decode(words, np.full(5000, np.nan), coder)
    with pytest.raises(ValueError, match="symbols must be in"):
        ans.encode(np.array([MAX_SYMBOL + 1], np.int32), np.array([1.0]), coder)
    assert ans.decode(ans.encode(np.zeros(0, np.int32), np.zeros(0), coder), np.zeros(0), coder).size == 0
    with pytest.raises(ValueError, match="coder must be one of"):
        ans.encode(sym, scales, "huffman")


def test_ans_table_coder_scale_grid():
    """Scales snap to 2^(l/8) (float16, as stored), stay in range, and a stream whose scales are off
    the grid is refused; the table coder costs within 0.1% of the per-symbol Laplace model."""
    got = ans.snap_scale(np.array([0.0, 0.02, 1.0, 1.05, 3e4]))
    assert got[0] >= 0.02 and got[1] >= 0.02 and got[2] == 1.0 and got[4] == ans.MAX_SCALE
    assert abs(np.log2(got[3]) * 8 - round(np.log2(got[3]) * 8)) < 0.01
    assert np.array_equal(ans.snap_scale(got), got)  # idempotent
    with pytest.raises(ans.CodecStreamError, match="scale grid"):
        ans.decode(np.zeros(4, np.uint32), np.full(10, 1.05), "table")
    with pytest.raises(ans.CodecStreamError, match=r"in \[0.02"):
        ans.decode(np.zeros(4, np.uint32), np.full(10, 1e5), "table")
    rng = np.random.default_rng(1)
    scales = np.repeat(ans.snap_scale(rng.uniform(0.1, 100, 50)), 2000)
    sym = np.clip(np.round(rng.laplace(0, scales)), -MAX_SYMBOL, MAX_SYMBOL).astype(np.int32)
    table, laplace = (ans.encode(sym, scales, c).size for c in ("table", "laplace"))
    assert abs(table / laplace - 1) < 1e-3, (table, laplace)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="exact_sinks must be an int"):
        CodecSettings(exact_sinks=-1)
    with pytest.raises(ValueError, match="key_weight"):
        CodecSettings(key_weight=float("nan"))


# ------------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def basis_path(stories, tmp_path_factory):
    model, tok = stories
    layers, info = fit_codec_basis(model, tok, [("calib.txt", CALIB)], tokens=1024, window=256)
    path = tmp_path_factory.mktemp("codec") / "stories.safetensors"
    save_basis(path, layers, model_identity(model), info)
    return path


@pytest.fixture(scope="module")
def basis(basis_path):
    return load_basis(basis_path)


def test_calibration_refuses_moby_dick(stories):
    with pytest.raises(ValueError, match="held out"):
        fit_codec_basis(*stories, [("pg2701.txt", CALIB)], tokens=1024, window=256)


def test_basis_holds_the_query_metric(basis):
    layer = basis.layers[0]
    assert layer.k_metric is not None and layer.k_metric.shape == layer.k_basis.shape
    assert torch.allclose(layer.k_metric[0] @ layer.k_inverse[0], torch.eye(layer.k_basis.shape[-1]), atol=1e-4)
    assert basis.layers[0].metric("v") == (None, None)


def test_basis_file_checks(basis, stories, tmp_path):
    data = bytearray(open(basis.path, "rb").read())
    data[-5] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    with pytest.raises(CodecBasisError, match="corrupted: tensor"):
        load_basis(bad)
    other = dict(model_identity(stories[0]), weights_sha256="0" * 64)
    with pytest.raises(CodecBasisError, match="fitted on another model.*calibrate-codec"):
        basis.check_identity(other)


def _layer_errors(a, b):
    out = []
    def kv(storage):  # KVzip's ragged heads: their full-precision tokens one after another
        return (storage.fp_keys, storage.fp_values) if hasattr(storage, "fp_keys") else storage.read()

    for la, lb in zip(a.cache.layers, b.cache.layers):
        ka, va = kv(la.storage)
        kb, vb = kv(lb.storage)
        out.append(max(float((ka - kb).norm() / ka.norm()), float((va - vb).norm() / va.norm())))
    return out


@pytest.mark.parametrize("eviction", [None, KVzip(budget=0.3)], ids=["full", "kvzip"])
def test_roundtrip_through_the_codec(stories, basis, tmp_path, eviction):
    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=eviction)
    answer = ctx.ask("What did Tom want?", max_new_tokens=10)
    plain = ctx.save(tmp_path / "plain.kvc")
    fine = ctx.save(tmp_path / "fine.kvc", codec=basis)
    loaded = CompressedContext.load(tmp_path / "fine.kvc", model, tok, codec=basis)
    assert max(_layer_errors(ctx, loaded)) < 5e-3  # finest steps: close to exact
    assert loaded.ask("What did Tom want?", max_new_tokens=10) == answer
    assert fine < plain
    # a byte target: the whole file fits it, and read_info reports the ratio against fp16
    fp16 = read_info(tmp_path / "plain.kvc")["fp16_bytes"]
    n = ctx.save(tmp_path / "r.kvc", file_ratio=2.0, codec=basis)
    info = read_info(tmp_path / "r.kvc")
    assert n == info["file_bytes"] <= fp16 / 2 and info["file_ratio"] >= 2.0
    assert info["codec"]["basis"] == basis.fingerprint
    coarse = CompressedContext.load(tmp_path / "r.kvc", model, tok, codec=basis)
    assert coarse.context_tokens == ctx.context_tokens
    assert coarse.cache.get_seq_length() == ctx.cache.get_seq_length()
    assert max(_layer_errors(ctx, coarse)) < 0.5
    assert coarse.ask("What did Tom want?", max_new_tokens=4)  # answers


@pytest.fixture(scope="module")
def prerope_basis(stories, tmp_path_factory):
    model, tok = stories
    layers, info = fit_codec_basis(model, tok, [("calib.txt", CALIB)], tokens=1024, window=256, keys_before_rope=True)
    path = tmp_path_factory.mktemp("codec") / "stories_prerope.safetensors"
    save_basis(path, layers, model_identity(model), info)
    return load_basis(path)


@pytest.mark.parametrize("eviction", [None, KVzip(budget=0.3), SnapKV(budget=0.4)], ids=["full", "kvzip", "snapkv"])
def test_keys_coded_before_rope_come_back_at_their_positions(stories, prerope_basis, basis, tmp_path, eviction):
    """A basis fitted on keys before RoPE (§27.6): each coded key is turned back by its arrival
    index before its components are taken, and turned again after decoding. At the finest steps
    the keys come back (exact: a wrong position would turn them by a wrong angle); the kept
    tokens' positions travel in the file (the context tracks them: full precision with an
    eviction), so KVzip's ragged heads and their tail and SnapKV's equal heads decode in place."""
    model, tok = stories
    assert prerope_basis.keys_before_rope and not basis.keys_before_rope
    ctx = CompressedContext.build(model, tok, DOC, eviction=eviction)
    assert all(layer.track_arrivals == (eviction is not None) for layer in ctx.cache.layers)
    answer = ctx.ask("What did Tom want?", max_new_tokens=10)
    ctx.save(tmp_path / "fine.kvc", codec=prerope_basis)
    loaded = CompressedContext.load(tmp_path / "fine.kvc", model, tok, codec=prerope_basis)
    assert max(_layer_errors(ctx, loaded)) < 5e-3
    assert loaded.ask("What did Tom want?", max_new_tokens=10) == answer
    with pytest.raises(ValueError, match="coded with basis"):
        CompressedContext.load(tmp_path / "fine.kvc", model, tok, codec=basis)
    # at a byte target the keys before RoPE hold no worse than after it (the same bytes)
    n = ctx.save(tmp_path / "b.kvc", file_ratio=3.0, codec=prerope_basis)
    m = ctx.save(tmp_path / "a.kvc", file_ratio=3.0, codec=basis)
    before = CompressedContext.load(tmp_path / "b.kvc", model, tok, codec=prerope_basis)
    after = CompressedContext.load(tmp_path / "a.kvc", model, tok, codec=basis)
    assert abs(n - m) < 0.02 * m
    assert max(_layer_errors(ctx, before)) < 0.5 and max(_layer_errors(ctx, after)) < 0.5


def test_keys_before_rope_need_the_kept_positions(stories, prerope_basis, tmp_path):
    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.3), track_positions=False)
    with pytest.raises(ValueError, match="kept no positions.*track_positions=True"):
        ctx.save(tmp_path / "x.kvc", codec=prerope_basis)
    with pytest.raises(TypeError, match="track_positions must be True or False"):
        CompressedCache(model.config, track_positions="yes")


def test_basis_for_model_prefers_keys_before_rope(stories, basis, prerope_basis):
    from pathlib import Path

    from kv_cache.codec import basis_for_model

    dirs = [Path(basis.path).parent, Path(prerope_basis.path).parent]
    assert basis_for_model(stories[0], dirs).fingerprint == prerope_basis.fingerprint
    assert basis_for_model(stories[0], dirs, keys_before_rope=False).fingerprint == basis.fingerprint


def test_kvzap_kept_tokens_go_through_the_codec(stories, basis, tmp_path):
    # the stored tokens are the ones KVzap keeps (a scorer fitted here on a text that is not evaluated)
    from pathlib import Path

    from kv_cache import KVzap
    from kv_cache.compression.scorer_file import save_scorer
    from kv_cache.plan.scorer_training import fit_scorer

    model, tok = stories
    scorer = fit_scorer(model, tok, Path(__file__).read_text(), tokens=600, window=200, max_tokens_per_window=150)
    path = save_scorer(tmp_path / "stories_kvzap.safetensors", scorer)
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzap(budget=0.3, scorer=str(path), decoding=False))
    held = [layer.kept_length() for layer in ctx.cache.layers]
    assert max(held) < ctx.context_tokens  # KVzap evicted
    ctx.save(tmp_path / "z.kvc", file_ratio=4.0, codec=basis)
    info = read_info(tmp_path / "z.kvc")
    assert info["file_ratio"] >= 4.0 and info["codec"]["basis"] == basis.fingerprint
    loaded = CompressedContext.load(tmp_path / "z.kvc", model, tok, codec=basis)
    assert [layer.kept_length() for layer in loaded.cache.layers] == held
    assert loaded.cache.get_seq_length() == ctx.cache.get_seq_length()
    # a 27 KB file on the tiny model: the codec's step search moves a whole step for a few header
    # bytes (the eviction check's figures, 16 bytes, take the worst layer from 0.46 to 0.53)
    assert max(_layer_errors(ctx, loaded)) < 0.6
    assert loaded.ask("What did Tom want?", max_new_tokens=4)


def test_codec_errors_say_how_to_fix(stories, basis, tmp_path):
    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.3))
    ctx.save(tmp_path / "c.kvc", codec=basis)
    with pytest.raises(ValueError, match="neither shipped nor in .KV_CACHE_HOME/codecs.*calibrate-codec"):
        CompressedContext.load(tmp_path / "c.kvc", model, tok)
    with pytest.raises(ValueError, match="cannot hold this context.*smaller eviction budget"):
        ctx.save(tmp_path / "x.kvc", file_ratio=1000, codec=basis)
    for bad in (0.5, float("inf"), float("nan"), True, "20"):
        with pytest.raises(ValueError, match="file_ratio must be a finite number >= 1"):
            ctx.save(tmp_path / "x.kvc", file_ratio=bad, codec=basis)
    with pytest.raises(ValueError, match="no codec basis is shipped.*calibrate-codec"):
        ctx.save(tmp_path / "x.kvc", file_ratio=4)  # stories260K ships none
    q = CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4))
    with pytest.raises(ValueError, match="no full-precision K/V to code.*quant=None"):
        q.save(tmp_path / "q.kvc", codec=basis)
    with pytest.raises(ValueError, match="need codec="):
        save_cache(ctx.cache, tmp_path / "y.kvc", file_bytes=1000)


# ------------------------------------------------------------------------------- files
def _rewrite(path, out, edit_header=None, edit_tensors=None, version=None):
    """Rewrite a kv_cache file with its header / tensors edited and every hash recomputed (what a
    hostile writer does): only the loader's own checks stand in the way."""
    from safetensors.torch import load, save

    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + n])["__metadata__"]
    header = json.loads(meta["kv_cache"])
    tensors = dict(load(data))
    if edit_tensors:
        edit_tensors(tensors)
    if edit_header:
        edit_header(header)
    header["tensors"] = {k: serialize._tensor_digest(t) for k, t in sorted(tensors.items())}
    text = json.dumps(header, sort_keys=True, separators=(",", ":"))
    meta = {**meta, "kv_cache": text, "kv_cache_sha256": hashlib.sha256(text.encode()).hexdigest()}
    if version is not None:
        meta["format_version"] = version
    open(out, "wb").write(save(tensors, metadata=meta))


def test_version_2_files_still_load(stories, tmp_path):
    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.3))
    ctx.save(tmp_path / "v3.kvc")
    _rewrite(tmp_path / "v3.kvc", tmp_path / "v2.kvc", edit_header=lambda h: h.pop("fp16_bytes"), version="2")
    old = CompressedContext.load(tmp_path / "v2.kvc", model, tok)
    assert old.ask("What did Tom want?", max_new_tokens=8) == ctx.ask("What did Tom want?", max_new_tokens=8)
    assert "file_ratio" not in read_info(tmp_path / "v2.kvc")


def _stream(tensors):
    return next(k for k in tensors if k.endswith("tc_stream"))


def _off_grid(tensors):
    name = next(k for k in tensors if k.endswith("tc_scale") and (tensors[k] > 0).any())
    i = tuple(torch.nonzero(tensors[name] > 0)[0].tolist())
    tensors[name][i] = float(tensors[name][i]) * 1.04  # between two levels of 2^(l/8)


def test_codec_version_1_files_still_load(stories, basis, tmp_path):
    """A file whose streams use the per-symbol Laplace coder (codec record version 1, what the
    first release of the codec wrote) loads to exactly what the same payload coded with the
    tables (version 2) does."""
    from safetensors.torch import load, save

    from kv_cache.codec import decode_state, encode_state

    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.3))
    ctx.save(tmp_path / "ok.kvc", file_ratio=1.5, codec=basis)
    data = open(tmp_path / "ok.kvc", "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + n])["__metadata__"]
    header = json.loads(meta["kv_cache"])
    from kv_cache.cache.report import kv_geometry

    g = kv_geometry(model.config)
    geo = dict(tokens_seen=header["tokens_seen"], layers=g.layers, kv_heads=g.kv_heads, head_dim=g.head_dim)
    decoded = decode_state(dict(load(data)), header["codec"], basis, **geo)
    settings = CodecSettings(**header["codec"]["settings"])
    files = {}
    for version in (1, 2):
        tensors, record = encode_state(decoded, header["layers"], basis, lambda t, r: 0, None, settings, version=version)
        assert record["version"] == version
        h = {**header, "codec": record, "tensors": {k: serialize._tensor_digest(t) for k, t in sorted(tensors.items())}}
        text = json.dumps(h, sort_keys=True, separators=(",", ":"))
        m = {**meta, "kv_cache": text, "kv_cache_sha256": hashlib.sha256(text.encode()).hexdigest()}
        open(tmp_path / f"v{version}.kvc", "wb").write(save(tensors, metadata=m))
        files[version] = CompressedContext.load(tmp_path / f"v{version}.kvc", model, tok, codec=basis)
        assert files[version].context_tokens == ctx.context_tokens
    assert max(_layer_errors(files[1], files[2])) == 0.0
    assert (tmp_path / "v2.kvc").stat().st_size <= (tmp_path / "v1.kvc").stat().st_size * 1.005
    with pytest.raises(ValueError, match="version must be one of"):
        encode_state(decoded, header["layers"], basis, lambda t, r: 0, None, settings, version=3)


def _first_target(h):
    return h["codec"]["targets"][0]


HOSTILE = {
    "tokens_seen_huge": (lambda h: h.update(tokens_seen=10 ** 12), None, "tokens seen must be an int"),
    "segment_longer_than_the_context": (lambda h: _first_target(h)["lengths"].__setitem__(0, 10 ** 9), None,
                                        "segment length must be an int"),
    "shape_not_its_segments": (lambda h: _first_target(h)["shape"].__setitem__(2, 10 ** 6), None,
                               "does not match its segments"),
    "too_many_heads": (lambda h: _first_target(h).update(heads=list(range(99)), lengths=[1] * 99), None,
                       "at most 4 of each"),
    "truncated_stream": (None, lambda t: t.update({_stream(t): t[_stream(t)][:-2].clone()}),
                         "does not decode|more words|damaged or truncated"),
    "stream_of_gigabytes": (None, lambda t: t.update({_stream(t): torch.zeros(10 ** 6, dtype=torch.int32)}),
                            "at most one per symbol"),
    "nan_step": (None, lambda t: t[next(k for k in t if k.endswith("tc_delta"))].__setitem__((0, 0), float("nan")),
                 "NaN or Inf"),
    "scale_out_of_range": (None, lambda t: t[next(k for k in t if k.endswith("tc_scale"))].__setitem__((0, 0), 60000.0),
                           "scales of coded components"),
    "missing_exact_rows": (None, lambda t: t.update({(k := next(k for k in t if k.endswith("tc_exact"))): t[k][1:].clone()}),
                           "exact rows"),
    "missing_stream": (None, lambda t: t.pop(_stream(t)), "stream is missing"),
    "other_basis": (lambda h: h["codec"].update(basis="0" * 64), None, "coded with basis"),
    "unknown_version": (lambda h: h["codec"].update(version=7), None, r"codec record version must be one of \(1, 2\)"),
    "scale_off_the_grid": (None, lambda t: _off_grid(t), "scale grid"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_payloads_are_refused_before_decoding(stories, basis, tmp_path, case):
    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.3))
    ctx.save(tmp_path / "ok.kvc", file_ratio=1.5, codec=basis)
    edit_header, edit_tensors, message = HOSTILE[case]
    _rewrite(tmp_path / "ok.kvc", tmp_path / "bad.kvc", edit_header, edit_tensors)
    with pytest.raises(ValueError, match=message):
        load_cache(tmp_path / "bad.kvc", model_config=model.config, codec=basis)


def test_eval_file_methods_parse():
    from kv_cache.spec.grammar import parse_method

    m = parse_method("kvzip@0.25+file20")
    assert m.file_ratio == 20 and m.needs_tokenizer and "file_ratio=20" in m.resolved
    assert parse_method("file10").file_ratio == 10
    q = parse_method("q4d+kvzip@0.5+file10")  # prefilled in full precision, loaded into q4d
    assert q.load_quant == QuantConfig(bits=4) and q.bits == 4 and "loaded_into=QuantConfig(bits=4" in q.resolved
    assert "kv_cache quant=None" in q.resolved
    with pytest.raises(ValueError, match="evicted tier"):
        parse_method("q4o2+kvzip@0.5+file10")
    with pytest.raises(ValueError, match="R >= 1"):
        parse_method("kvzip@0.5+file0.5")


def test_file_planner_measures_each_budget(stories, basis):
    from kv_cache.plan.file_plan import candidate_budgets, plan_file

    assert candidate_budgets(20) == [0.15, 0.2, 0.25, 0.4]
    assert candidate_budgets(2) == [None]  # 3/R >= 1: every token
    model, tok = stories
    ids = tok(DOC, add_special_tokens=False)["input_ids"][:160]
    plan = plan_file(model, tok, ids, 1.5, basis=basis, probe_tokens=32, candidates=[0.5, None])
    assert [b for b, _, _ in plan.measured] == [0.5, None]
    assert all(math.isfinite(n) and size > 0 for _, n, size in plan.measured)
    assert plan.budget == min(plan.measured, key=lambda m: m[1])[0]
    assert "file ratio 1.5" in plan.describe()
    short = plan_file(model, tok, ids[:40], 20, basis=basis, probe_tokens=32)  # too short to hold out a tail
    assert short.budget == 0.25 and short.measured == []
    with pytest.raises(ValueError, match="finite number >= 1"):
        plan_file(model, tok, ids, 0.5, basis=basis)


def test_file_planner_measures_both_bases(stories, basis, prerope_basis):
    """Given the bases fitted before and after RoPE, every budget is measured with each, and the
    pair of least held-out loss is chosen (§27.6)."""
    from kv_cache.plan.file_plan import plan_file

    model, tok = stories
    ids = tok(DOC, add_special_tokens=False)["input_ids"][:160]
    plan = plan_file(model, tok, ids, 1.5, basis=[prerope_basis, basis], probe_tokens=32, candidates=[0.5, None])
    assert [b for b, _, _ in plan.measured] == [0.5, 0.5, None, None]
    assert plan.measured_bases == ["before RoPE", "after RoPE"] * 2
    i = min(range(4), key=lambda j: plan.measured[j][1])
    assert plan.budget == plan.measured[i][0]
    assert plan.basis is (prerope_basis, basis)[i % 2]
    assert "keys coded" in plan.describe() and "before RoPE: nll" in plan.describe()
    with pytest.raises(ValueError, match="needs a codec basis"):
        plan_file(model, tok, ids, 1.5, basis=[], probe_tokens=32)


def test_compress_cli_file_ratio_is_checked_before_the_model_loads(tmp_path, capsys):
    from kv_cache.cli import main

    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    for extra, message in ((["--file-ratio", "0.5"], "finite number >= 1"),
                           (["--file-ratio", "20", "--bits", "4"], "goes with --method")):
        assert main(["compress", str(doc), "-o", str(tmp_path / "x.kvc"), "--model", "stories260K", *extra]) == 2
        assert message in capsys.readouterr().err


# ------------------------------------------------------------------ decoding into a quantized layout
@pytest.mark.parametrize("eviction", [None, KVzip(budget=0.3)], ids=["rectangular", "kvzip-ragged"])
def test_file_decodes_into_q4d_as_a_prefill_stores_it(stories, basis, tmp_path, eviction):
    """A codec file loaded with quant=QuantConfig(bits=4) holds its kept tokens in q4d: sinks,
    packed codes and residual per row, the bytes of a q4d prefill of those tokens, read back
    within q4d's own error of the decoded full-precision tokens; answering and decoding go on."""
    from kv_cache.cache.packed_ragged import PackedRaggedStorage
    from kv_cache.cache.storage import QuantizedStorage

    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC * 2, eviction=eviction, max_tokens=230)
    ctx.save(tmp_path / "c.kvc", file_ratio=1.5, codec=basis)
    fp = CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis)
    q4d = QuantConfig(bits=4)
    q = CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis, quant=q4d)
    # decoded keys carry their RoPE: the default's keys before RoPE give way to per-channel groups after it
    assert q.cache.quant == q4d.after_rope() and q.context_tokens == fp.context_tokens
    with pytest.raises(ValueError, match="before RoPE .* not supported"):
        CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis, quant=QuantConfig(bits=4, pre_rope=True))
    assert q.cache.get_seq_length() == fp.cache.get_seq_length()
    kinds = {type(layer.storage) for layer in q.cache.layers}
    assert kinds <= {QuantizedStorage, PackedRaggedStorage}
    report = q.cache.memory_report()
    assert report.codes_bytes > 0 and report.scales_bytes > 0
    assert report.total_bytes < 0.5 * fp.cache.memory_report().total_bytes
    for la, lb in zip(fp.cache.layers, q.cache.layers):  # the same tokens in every head
        assert torch.equal(la.storage.head_lengths(), lb.storage.head_lengths())
    # the question's next-token distribution after the context: within 4-bit rounding of the decoded file's
    from kv_cache.cache import compress
    from kv_cache.context import forward_at

    ids = torch.tensor([tok("What did Tom want?", add_special_tokens=False)["input_ids"]])
    logp = []
    for c in (fp, q):
        with torch.no_grad(), compress(model, c.cache), c.cache.session():
            logp.append(torch.log_softmax(forward_at(model, c.cache, ids, c.context_tokens)[0].float(), -1))
    kl = (logp[0].exp() * (logp[0] - logp[1])).sum(-1)  # per question position
    assert float(kl.max()) < 0.1, kl
    assert (logp[0].argmax(-1) == logp[1].argmax(-1)).float().mean() >= 0.8
    assert q.ask("What did Tom want?", max_new_tokens=6)  # a session on the q4d layout
    assert q.cache.get_seq_length() == fp.cache.get_seq_length()  # the session left the context as loaded
    # re-saved, it is a q4d file; loading a quantized file with quant= is refused, as are bad layouts
    q.save(tmp_path / "q.kvc")
    with pytest.raises(ValueError, match="holds a quantized cache.*without quant="):
        CompressedContext.load(tmp_path / "q.kvc", model, tok, quant=q4d)
    with pytest.raises(ValueError, match="quant must be a QuantConfig"):
        CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis, quant="q4d")
    with pytest.raises(TypeError, match="quant must be a QuantConfig or None"):
        load_cache(tmp_path / "c.kvc", model_config=model.config, codec=basis, quant=4)
    with pytest.raises(ValueError, match="evicted_bits"):
        CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis, quant=QuantConfig(bits=4, evicted_bits=2))


def test_quantize_cache_refuses_what_it_cannot_restore(stories):
    from kv_cache.cache.relayout import quantize_cache

    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4))
    with pytest.raises(ValueError, match="quantized already"):
        quantize_cache(ctx.cache, QuantConfig(bits=2))
    with pytest.raises(TypeError, match="cache must be a CompressedCache"):
        quantize_cache(object(), QuantConfig(bits=4))


def test_ask_cli_into_q4d(stories, basis, basis_path, tmp_path, monkeypatch, capsys):
    """`kvcache ask --into q4d` answers from a codec file held in q4d; a bad spec or a quantized
    file is refused before the model loads."""
    import shutil

    from kv_cache.cli import main

    model, tok = stories
    home = tmp_path / "home"
    (home / "codecs").mkdir(parents=True)
    shutil.copy(basis_path, home / "codecs" / "stories.safetensors")  # found by fingerprint, as a user's would be
    monkeypatch.setenv("KV_CACHE_HOME", str(home))
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.5))
    ctx.save(tmp_path / "c.kvc", file_ratio=1.5, codec=basis)
    assert main(["ask", str(tmp_path / "c.kvc"), "What did Tom want?", "--into", "q4d", "--max-new-tokens", "4",
                 "--model", "stories260K"]) == 0
    assert "Q: What did Tom want?" in capsys.readouterr().out
    assert main(["ask", str(tmp_path / "c.kvc"), "Why?", "--into", "q4zz", "--model", "stories260K"]) == 2
    assert "not one of our quantization specs" in capsys.readouterr().err
    CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4)).save(tmp_path / "q.kvc")
    assert main(["ask", str(tmp_path / "q.kvc"), "Why?", "--into", "q4d", "--model", "stories260K"]) == 2
    assert "holds a quantized cache already" in capsys.readouterr().err


def test_the_file_records_the_layout_it_is_loaded_into(stories, basis, tmp_path, capsys):
    """save(into=...) / `kvcache compress --into q4d`: every reader (load, ask, the server's store)
    holds the full-precision file in that layout; quant=None keeps it as stored."""
    from kv_cache.cli import main

    model, tok = stories
    ctx = CompressedContext.build(model, tok, DOC, eviction=KVzip(budget=0.5))
    ctx.save(tmp_path / "c.kvc", file_ratio=1.5, codec=basis, into=QuantConfig(bits=4))
    # recorded as readers hold it: decoded keys carry their RoPE, so the default's per-channel layout after it
    assert CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis).cache.quant == QuantConfig(bits=4,
                                                                                                     pre_rope=False)
    assert CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis, quant=None).cache.quant is None
    assert CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis,
                                  quant=QuantConfig.kivi(bits=4)).cache.quant == QuantConfig.kivi(bits=4)
    with pytest.raises(ValueError, match="quant must be a QuantConfig, None .* or 'file'"):
        CompressedContext.load(tmp_path / "c.kvc", model, tok, codec=basis, quant="q4d")
    with pytest.raises(TypeError, match="into must be a QuantConfig"):
        ctx.save(tmp_path / "x.kvc", into="q4d")
    with pytest.raises(ValueError, match="held quantized already"):
        CompressedContext.build(model, tok, DOC, quant=QuantConfig(bits=4)).save(tmp_path / "x.kvc",
                                                                               into=QuantConfig(bits=4))
    # the CLI: compress records it (no codec needed: an eviction-only file is full precision too)
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    assert main(["compress", str(doc), "-o", str(tmp_path / "e.kvc"), "--model", "stories260K",
                 "--method", "kvzip@0.5", "--into", "q4d", "--raw-text"]) == 0
    assert "into:  readers hold it as q4d" in capsys.readouterr().out
    assert CompressedContext.load(tmp_path / "e.kvc", model, tok).cache.quant == QuantConfig(bits=4, pre_rope=False)
    assert main(["ask", str(tmp_path / "e.kvc"), "Why?", "--into", "full", "--max-new-tokens", "2"]) == 0
    for extra, message in ((["--into", "q4d", "--bits", "4"], "goes with --file-ratio or an eviction-only"),
                           (["--into", "q4zz"], "not one of our quantization specs"),
                           (["--into", "q4d", "--method", "q4+kvzip@0.5"], "quantizes already")):
        assert main(["compress", str(doc), "-o", str(tmp_path / "y.kvc"), "--model", "stories260K", *extra]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_smollm2_basis_codes_keys_before_rope_closer():
    """Golden, SmolLM2 with the shipped bases: the basis found for the model is the one fitted
    before RoPE, and at 20x a KVzip-kept context's keys come back closer in the query metric
    (the logits' error) than with the basis fitted after RoPE, at the same file size.

    Measured (about 1,100 wikitext tokens, KVzip 25%, one metric for both: the post-RoPE
    queries'): mean relative key error 0.081 before RoPE against 0.119 after, the files within
    4 bytes of each other."""
    import tempfile

    from kv_cache.codec import basis_for_model
    from kv_cache.models import load_model, shared_data_dir

    model, tok = load_model("smollm2")
    before, after = basis_for_model(model), basis_for_model(model, keys_before_rope=False)
    assert before.keys_before_rope and after is not None and not after.keys_before_rope
    text = (shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")[:5000]
    ctx = CompressedContext.build(model, tok, text, eviction=KVzip(budget=0.25), chat=False)
    errors = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, b in (("before", before), ("after", after)):
            size = ctx.save(f"{tmp}/{name}.kvc", file_ratio=20, codec=b)
            back = CompressedContext.load(f"{tmp}/{name}.kvc", model, tok, codec=b)
            errs = []
            for i, (la, lb) in enumerate(zip(ctx.cache.layers, back.cache.layers)):
                ka, kb = la.storage.fp_keys[0, 0], lb.storage.fp_keys[0, 0]  # every head's kept keys
                a = after.layers[i].k_metric[0]  # one metric for both: the post-RoPE queries' A
                errs.append(float(((ka - kb) @ a).norm() / (ka @ a).norm()))
            errors[name] = (sum(errs) / len(errs), size)
    assert abs(errors["before"][1] - errors["after"][1]) < 0.02 * errors["after"][1]
    assert errors["before"][0] < 0.8 * errors["after"][0], errors


def test_keys_before_rope_refuse_a_quantized_ragged_layout():
    """A ragged layout holding packed tokens (or sinks) beside its full-precision rows: where those
    rows sit among a head's arrivals is not what the codec reads, so coding them before RoPE is
    refused with the fix named (a full-precision layout codes them, §27.6)."""
    from kv_cache.codec.targets import find_targets, segment_positions

    rec = {"class": "PackedRaggedStorage",
           "attrs": {"fp_keys": {"tensor": "k"}, "fp_values": {"tensor": "v"}, "heads": 1, "batch": 1,
                     "fp_lengths": {"list": [3]}, "packed_lengths": {"list": [5]},
                     "tail": {"class": "QuantizedStorage", "attrs": {}}}}
    tensors = {"k": torch.zeros(1, 1, 3, 4), "v": torch.zeros(1, 1, 3, 4)}
    layer = {"storage": rec, "seen": 8}
    (target,) = find_targets([layer], tensors)
    assert target.role == "rows" and target.mixed
    with pytest.raises(ValueError, match="full-precision caches only.*keys_before_rope=False"):
        segment_positions(layer, tensors, target)
    rec["attrs"]["packed_lengths"] = {"list": [0]}
    rec["attrs"]["tail"] = {"class": "FullPrecisionStorage", "attrs": {"key_buffer": {"tensor": "tk"},
                                                                      "value_buffer": {"tensor": "tv"}, "length": 0}}
    tensors.update(tk=torch.zeros(1, 1, 0, 4), tv=torch.zeros(1, 1, 0, 4))
    (target,) = find_targets([layer], tensors)
    with pytest.raises(ValueError, match="kept no positions.*track_positions=True"):
        segment_positions(layer, tensors, target)  # evicted, and no bitmap saved
