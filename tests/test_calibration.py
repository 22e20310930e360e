"""Calibrated (OSCAR-style) rotations: the fit, the file, and the cache that uses it (math dictionary §17.7)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kv_cache import CompressedCache, QuantConfig, compress
from kv_cache.cache.packed import Rotation
from kv_cache.cache.storage import make_storage
from kv_cache.compression import dequantize, quantize
from kv_cache.compression.rotation_file import (
    CalibrationError,
    check_against_model,
    load_calibration,
    rotation_matrices,
    save_calibration,
)
from kv_cache.plan.calibration import calibrate_rotations, calibration_meta, query_covariances
from kv_cache.compression.rotation import calibrated_rotation, covariance_eigenvectors, fwht, hadamard_matrix
from kv_cache.eval.accounting import walked_nbytes


CONTINUATION = "Tom had a dog and the dog ran to the ball. Lily laughed and they played all day."


def _continuation(model, tok, ids: torch.Tensor, cache=None) -> torch.Tensor:
    """Logits ``[1, n, vocab]`` of a teacher-forced continuation after prefilling ``ids`` into
    ``cache`` (None: the full DynamicCache): every position reads the cache."""
    from transformers import DynamicCache

    from kv_cache.generation import forward_at

    cont = tok([CONTINUATION], return_tensors="pt").input_ids[:, 1:]
    with torch.no_grad():
        if cache is None:
            cache = DynamicCache()
            forward_at(model, cache, ids, 0)
            return forward_at(model, cache, cont, ids.shape[1])
        with compress(model, cache):
            forward_at(model, cache, ids, 0)
            return forward_at(model, cache, cont, ids.shape[1])


def _rotated_reference(model, tok, ids: torch.Tensor, tensors, bits: int) -> torch.Tensor:
    """``_continuation``'s logits read through a ``DynamicCache`` holding what a KIVI cache
    (group 8, residual 8) with the calibrated rotation ``tensors`` stores for ``ids``, computed
    here from the full cache's K/V: values rotated by ``R_h`` (the same ``x @ R`` as the cache, so
    that no code rounds differently), quantized per token and rotated back; keys quantized per
    channel, unrotated; every whole group of 8 tokens coded, the remainder kept."""
    from transformers import DynamicCache

    from kv_cache.generation import forward_at

    full, ref = DynamicCache(), DynamicCache()
    with torch.no_grad():
        forward_at(model, full, ids, 0)
    n = ids.shape[1] // 8 * 8
    for i, layer in enumerate(full.layers):
        k, v = layer.keys, layer.values
        R = tensors[f"layers.{i}"].to(v.dtype).unsqueeze(0)  # [1, kv_heads, d, d]
        dv = dequantize(quantize(v[:, :, :n] @ R, bits, axis=-1, group_size=8, scale_dtype=torch.float16))
        dk = dequantize(quantize(k[:, :, :n], bits, axis=-2, group_size=8, scale_dtype=torch.float16))
        ref.update(torch.cat([dk, k[:, :, n:]], 2), torch.cat([dv @ R.transpose(-1, -2), v[:, :, n:]], 2), i)
    cont = tok([CONTINUATION], return_tensors="pt").input_ids[:, 1:]
    with torch.no_grad():
        return forward_at(model, ref, cont, ids.shape[1])


def _spd(d: int, seed: int = 0) -> torch.Tensor:
    """A symmetric positive definite matrix with distinct, well separated eigenvalues."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    lam = torch.linspace(1.0, 50.0, d, dtype=torch.float64) ** 2
    return (q * lam) @ q.T


# --------------------------------------------------------------------------- model-free: the math


@pytest.mark.parametrize("dim, block", [(8, None), (64, None), (96, None), (64, 16), (64, 2), (32, 32)])
def test_hadamard_matrix_is_symmetric_orthonormal_blockwise_fwht(dim, block):
    H = hadamard_matrix(dim, block)
    assert H.dtype == torch.float64 and H.shape == (dim, dim)
    torch.testing.assert_close(H, H.T, rtol=0, atol=0)
    torch.testing.assert_close(H @ H.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    b = block or dim & -dim if dim & (dim - 1) else (block or dim)
    x = torch.randn(5, dim, dtype=torch.float64)
    if block is not None or dim & (dim - 1) == 0:  # equal blocks: a reshaped fwht
        b = block or dim
        ref = fwht(x.view(5, dim // b, b)).view(5, dim)
        torch.testing.assert_close(x @ H, ref, rtol=0, atol=1e-12)


def test_hadamard_matrix_errors():
    with pytest.raises(ValueError, match=r"block must be a power of two >= 2 dividing dim=64; got 24"):
        hadamard_matrix(64, 24)
    with pytest.raises(ValueError, match=r"block must be a power of two >= 2 dividing dim=96; got 64"):
        hadamard_matrix(96, 64)
    with pytest.raises(ValueError, match="even integer >= 2"):
        hadamard_matrix(7)
    with pytest.raises(TypeError, match="dtype must be one of"):
        hadamard_matrix(8, dtype=torch.int32)


@pytest.mark.parametrize("d", [2, 7, 16, 64])
def test_eigenvectors_match_numpy_eigh(d):
    c = _spd(d, seed=d)
    lam, V = covariance_eigenvectors(c.float())  # float32 input, computed in float64
    ref_lam, ref_V = np.linalg.eigh(c.float().double().numpy())  # the float32 input, exactly
    ref_lam, ref_V = ref_lam[::-1], ref_V[:, ::-1]
    np.testing.assert_allclose(lam.numpy(), ref_lam, rtol=1e-5)
    # Same vectors up to sign; ours have their largest-magnitude entry positive.
    pivots = np.abs(ref_V).argmax(0)
    ref_V = ref_V * np.sign(ref_V[pivots, np.arange(d)])
    np.testing.assert_allclose(V.numpy(), ref_V, atol=1e-4)
    assert bool((V.gather(0, V.abs().argmax(0, keepdim=True)) > 0).all())
    torch.testing.assert_close(V @ torch.diag(lam) @ V.T, c.float().double(), rtol=1e-5, atol=1e-3)


def test_eigenvectors_batched_and_errors():
    c = torch.stack([_spd(8, 1), _spd(8, 2), torch.eye(8, dtype=torch.float64)])
    lam, V = covariance_eigenvectors(c)
    assert lam.shape == (3, 8) and V.shape == (3, 8, 8)
    assert bool((lam[:, :-1] >= lam[:, 1:]).all())
    with pytest.raises(ValueError, match=r"square matrices \[\.\.\., d, d\]; got shape \(3, 4\)"):
        covariance_eigenvectors(torch.ones(3, 4))
    bad = _spd(4)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        covariance_eigenvectors(bad)
    with pytest.raises(TypeError, match="floating dtype"):
        covariance_eigenvectors(torch.eye(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        covariance_eigenvectors(np.eye(4))


@pytest.mark.parametrize("block", [None, 4, 16])
def test_calibrated_rotation_is_V_times_H_and_orthonormal(block):
    c = _spd(16, 3)
    R = calibrated_rotation(c, block)
    _, V = covariance_eigenvectors(c)
    torch.testing.assert_close(R, V @ hadamard_matrix(16, block), rtol=0, atol=1e-12)
    torch.testing.assert_close(R @ R.T, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-12)
    # In the rotated space the query energy of each Hadamard block is the sum of its eigenvalues,
    # spread evenly over the block's channels: diag(R^T C R) is constant per block.
    diag = torch.diagonal(R.T @ c @ R)
    lam, _ = covariance_eigenvectors(c)
    b = block or 16
    torch.testing.assert_close(diag.view(-1, b), (lam.view(-1, b).sum(1, keepdim=True) / b).expand(-1, b),
                               rtol=1e-9, atol=1e-6)


def test_rotation_from_matrices_round_trip_and_head():
    R = torch.stack([calibrated_rotation(_spd(16, s)).float() for s in range(3)])  # [h, d, d]
    rot = Rotation.from_matrices(R)
    x = torch.randn(2, 3, 5, 16)
    y = rot.forward(x)
    torch.testing.assert_close(y, torch.einsum("bhnd,hde->bhne", x, R), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rot.inverse(y), x, rtol=1e-5, atol=1e-5)
    one = rot.head(1)
    torch.testing.assert_close(one.forward(x[:, 1:2]), y[:, 1:2], rtol=1e-5, atol=1e-5)
    assert one.matrices.data_ptr() != R.data_ptr() and one.matrices.shape == (1, 16, 16)
    assert set(rot.named_tensors()) == {"rotation_matrices"}
    # The randomized Hadamard rotation keeps its int8 signs (and their name).
    had = Rotation(0, 3, 16, 0, "cpu")
    assert set(had.named_tensors()) == {"rotation_signs"} and had.signs.dtype == torch.int8
    assert Rotation.from_signs(had.signs).head(2).signs.shape == (1, 16)


# --------------------------------------------------------------------------- fit on a model


def _layer0_queries_reference(model, ids):
    """Post-RoPE queries of layer 0 computed by hand (embeddings -> RMSNorm -> q_proj -> RoPE)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner = model.model
    h = inner.layers[0].input_layernorm(inner.embed_tokens(ids))
    attn = inner.layers[0].self_attn
    b, n = ids.shape
    q = attn.q_proj(h).view(b, n, -1, attn.head_dim).transpose(1, 2)
    pos = torch.arange(n).unsqueeze(0)
    cos, sin = inner.rotary_emb(h, pos)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return q.double()  # [b, Hq, n, d]


def test_query_covariance_matches_hand_computed_queries(stories):
    model, tok = stories
    ids = tok(["Once upon a time there was a cat. It liked milk and the sun."], return_tensors="pt").input_ids
    with torch.no_grad():
        covs, count = query_covariances(model, ids)
        q = _layer0_queries_reference(model, ids)
    cfg = model.config
    kvh, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    ref = torch.stack([sum(q[0, j].T @ q[0, j] for j in range(h * group, (h + 1) * group)) for h in range(kvh)])
    assert count == ids.numel() and sorted(covs) == list(range(cfg.num_hidden_layers))
    torch.testing.assert_close(covs[0], ref, rtol=1e-5, atol=1e-5)
    # Windows: two independent passes add up; padding (mask 0) is left out.
    with torch.no_grad():
        halves, _ = query_covariances(model, ids, window=ids.shape[1] // 2 + 1)
        masked, n_masked = query_covariances(model, torch.cat([ids, ids], 0),
                                             attention_mask=torch.tensor([[1] * ids.shape[1], [1] * ids.shape[1]]))
    assert not torch.allclose(halves[1], covs[1])  # the second window restarts at position 0
    torch.testing.assert_close(masked[0], 2 * covs[0], rtol=1e-6, atol=1e-6)
    assert n_masked == 2 * count


def test_calibrate_removes_its_hooks_even_on_error(stories):
    model, tok = stories
    attn = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    before = [len(m._forward_hooks) for m in attn]
    ids = tok(["The dog ran to the park."], return_tensors="pt").input_ids
    tensors = calibrate_rotations(model, ids)
    assert [len(m._forward_hooks) for m in attn] == before
    with pytest.raises(Exception):
        calibrate_rotations(model, torch.full_like(ids, 10**6))  # an out-of-vocabulary id fails inside forward
    assert [len(m._forward_hooks) for m in attn] == before
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    assert sorted(tensors, key=lambda k: int(k.split(".")[1])) == [f"layers.{i}" for i in range(cfg.num_hidden_layers)]
    for R in tensors.values():
        assert R.dtype == torch.float32 and R.shape == (cfg.num_key_value_heads, d, d)
        torch.testing.assert_close(R @ R.transpose(-1, -2), torch.eye(d).expand_as(R), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="window must be an int >= 1 or None; got 0"):
        query_covariances(model, ids, window=0)
    with pytest.raises(TypeError, match="integer tensor"):
        query_covariances(model, ids.float())


# --------------------------------------------------------------------------- the file


@pytest.fixture(scope="module")
def calib_file(stories, tmp_path_factory):
    model, tok = stories
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside. " * 6
    ids = tok(text, return_tensors="pt").input_ids
    tensors = calibrate_rotations(model, ids)
    path = tmp_path_factory.mktemp("calib") / "stories.safetensors"
    save_calibration(path, tensors, calibration_meta(model, text, ids.shape[1]))
    return path, tensors, text, ids.shape[1]


def test_save_load_round_trip(calib_file, stories):
    path, tensors, text, n = calib_file
    got, meta = load_calibration(path)
    assert set(got) == set(tensors)
    for k in tensors:
        torch.testing.assert_close(got[k], tensors[k], rtol=0, atol=0)
    cfg = stories[0].config
    assert meta["format_version"] == 1 and meta["tokens"] == n and meta["num_layers"] == cfg.num_hidden_layers
    assert meta["kv_heads"] == cfg.num_key_value_heads and meta["model_type"] == "llama"
    import hashlib

    assert meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    check_against_model(meta, cfg)
    other = type(cfg)(**{**cfg.to_dict(), "num_key_value_heads": 2})
    with pytest.raises(CalibrationError, match=r"fitted for kv_heads=4; this model has kv_heads=2"):
        check_against_model(meta, other)


def _rewrite(src, dst, tensors=None, meta=None):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    with safe_open(str(src), framework="pt") as f:
        header = dict(f.metadata())
    t = load_file(str(src)) if tensors is None else tensors
    if meta is not None:
        header = {"kv_cache.calibration": json.dumps(meta)} if not isinstance(meta, str) else {"other": meta}
    save_file(t, str(dst), metadata=header)
    return dst


def test_corrupted_truncated_and_mismatched_files(calib_file, tmp_path):
    path, tensors, _, _ = calib_file
    raw = path.read_bytes()
    trunc = tmp_path / "trunc.safetensors"
    trunc.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CalibrationError, match="not a readable safetensors calibration file"):
        load_calibration(trunc)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(CalibrationError, match="corrupted or truncated"):
        load_calibration(garbage)
    with pytest.raises(FileNotFoundError, match="no calibration file at"):
        load_calibration(tmp_path / "missing.safetensors")
    _, meta = load_calibration(path)
    with pytest.raises(CalibrationError, match="no 'kv_cache.calibration' header"):
        load_calibration(_rewrite(path, tmp_path / "nometa.safetensors", meta="x"))
    with pytest.raises(CalibrationError, match="format_version 99 is not supported"):
        load_calibration(_rewrite(path, tmp_path / "v99.safetensors", meta={**meta, "format_version": 99}))
    with pytest.raises(CalibrationError, match=r"metadata lacks 'head_dim'"):
        load_calibration(_rewrite(path, tmp_path / "nohd.safetensors",
                                  meta={k: v for k, v in meta.items() if k != "head_dim"}))
    with pytest.raises(CalibrationError, match=r"metadata 'kv_heads' must be a int; got '4'"):
        load_calibration(_rewrite(path, tmp_path / "str.safetensors", meta={**meta, "kv_heads": "4"}))
    fewer = {k: v for k, v in tensors.items() if k != "layers.3"}
    with pytest.raises(CalibrationError, match=r"missing \['layers.3'\]"):
        load_calibration(_rewrite(path, tmp_path / "fewer.safetensors", tensors=fewer))
    wrong = {**tensors, "layers.0": tensors["layers.0"][:2].contiguous()}
    with pytest.raises(CalibrationError, match=r"layers.0 must have shape \[kv_heads, head_dim, head_dim\] = "
                                               r"\[4, 8, 8\]; got \[2, 8, 8\]"):
        load_calibration(_rewrite(path, tmp_path / "shape.safetensors", tensors=wrong))
    nan = {**tensors, "layers.1": tensors["layers.1"].clone()}
    nan["layers.1"][0, 0, 0] = float("nan")
    with pytest.raises(CalibrationError, match="layers.1 holds NaN or Inf"):
        load_calibration(_rewrite(path, tmp_path / "nan.safetensors", tensors=nan))
    scaled = {**tensors, "layers.2": tensors["layers.2"] * 1.1}
    with pytest.raises(CalibrationError, match=r"layers.2 is not orthonormal"):
        load_calibration(_rewrite(path, tmp_path / "scaled.safetensors", tensors=scaled))
    with pytest.raises(CalibrationError, match="not orthonormal"):
        save_calibration(tmp_path / "bad.safetensors", scaled, meta)


# --------------------------------------------------------------------------- in the cache


def test_quant_config_rotation_path_validation(calib_file, tmp_path):
    path, _, _, _ = calib_file
    q = QuantConfig.kivi(bits=2, rotation="calibrated", rotation_path=path, key_grouping="token")
    assert q.rotation_path == str(path) and hash(q)
    assert repr(q).endswith(f"rotation='calibrated', key_grouping='token', rotation_path={str(path)!r})")
    assert "rotation_path" not in repr(QuantConfig.kivi(bits=2)) and "zero_dtype" not in repr(QuantConfig.kivi(bits=2))
    with pytest.raises(ValueError, match=r"rotation='calibrated' needs rotation_path .*; got None"):
        QuantConfig.kivi(rotation="calibrated")
    with pytest.raises(FileNotFoundError, match="no calibration file at"):
        QuantConfig.kivi(rotation="calibrated", rotation_path=tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match=r"rotation_path is read only with rotation='calibrated'; got "
                                         r"rotation='hadamard'"):
        QuantConfig.kivi(rotation="hadamard", rotation_path=path)
    with pytest.raises(TypeError, match="rotation_path must be a str or os.PathLike; got int"):
        QuantConfig.kivi(rotation="calibrated", rotation_path=3)
    with pytest.raises(ValueError, match=r"rotation must be one of \[None, 'hadamard', 'calibrated'\]; got 'oscar'"):
        QuantConfig.kivi(rotation="oscar")


def test_shape_mismatch_is_caught_at_first_use(calib_file):
    path, _, _, _ = calib_file
    with pytest.raises(CalibrationError, match=r"fitted for kv_heads=4, head_dim=8 .*; this model's layer 0 has "
                                               r"kv_heads=3, head_dim=16"):
        rotation_matrices(path, 0, 3, 16)
    with pytest.raises(CalibrationError, match=r"holds layers 0..4 .*; this model asks for layer 7"):
        rotation_matrices(path, 7, 4, 8)
    q = QuantConfig.kivi(bits=4, group_size=8, residual_length=8, rotation="calibrated", rotation_path=path)
    k = torch.randn(1, 3, 16, 16)
    st = make_storage(q, k[:, :, :0], k[:, :, :0], track_groups=False, layer=0)
    with pytest.raises(CalibrationError, match="this model's layer 0 has kv_heads=3, head_dim=16"):
        st.append(k, k)


@pytest.mark.parametrize("key_grouping", ["channel", "token"])
def test_storage_reads_back_the_rotated_reference(calib_file, key_grouping):
    """Stored = rotate by R_h -> quantize -> dequantize -> rotate back by R_h^T; R is counted as tables."""
    path, tensors, _, _ = calib_file
    q = QuantConfig.kivi(bits=2, group_size=8, residual_length=8, rotation="calibrated", rotation_path=path,
                    key_grouping=key_grouping, channel_group=8)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 4, 32, 8, generator=g), torch.randn(1, 4, 32, 8, generator=g)
    st = make_storage(q, k[:, :, :0], v[:, :, :0], track_groups=False, layer=2)
    st.append(k, v)
    got_k, got_v = st.read()
    R = tensors["layers.2"]  # [4, 8, 8]
    # per-channel keys are never rotated (math dictionary §25.3): only per-token keys live in R's space
    kr = torch.einsum("bhnd,hde->bhne", k, R) if key_grouping == "token" else k
    vr = torch.einsum("bhnd,hde->bhne", v, R)
    key_axis, key_group = (-2, 8) if key_grouping == "channel" else (-1, 8)
    ref_k = dequantize(quantize(kr, 2, axis=key_axis, group_size=key_group, scale_dtype=torch.float16))
    ref_v = dequantize(quantize(vr, 2, axis=-1, group_size=8, scale_dtype=torch.float16))
    Rt = R.transpose(-1, -2)
    want_k = torch.einsum("bhnd,hde->bhne", ref_k, Rt) if key_grouping == "token" else ref_k
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, torch.einsum("bhnd,hde->bhne", ref_v, Rt), rtol=1e-5, atol=1e-5)
    cats = st.nbytes_by_category()
    assert cats["tables"] == 4 * 8 * 8 * 4  # float32 [kv_heads, d, d]
    assert sum(cats.values()) == sum(t.nbytes for t in st.named_tensors().values())
    assert "packed.rotation_matrices" in st.named_tensors()


@pytest.mark.parametrize("quant_kw", [
    dict(bits=4, group_size=8, residual_length=8),
    dict(bits=2, key_bits=3, group_size=8, residual_length=8, key_grouping="token", channel_group=8,
         levels="lloyd_max"),
])
def test_attention_over_calibrated_cache_matches_reference(stories, calib_file, quant_kw):
    """Native attention (query rotated once, output back once) equals the model's own attention
    over the dequantized tokens; at 8 bits both stay close to the full cache."""
    model, tok = stories
    path, tensors, _, _ = calib_file
    ids = tok(["Lily and Tom went to the park to play with a big red ball. They were happy. " * 2],
              return_tensors="pt").input_ids
    q = QuantConfig.kivi(rotation="calibrated", rotation_path=path, **quant_kw)
    outs = {}
    with torch.no_grad():
        for mode in ("native", "reference"):
            cache = CompressedCache(model.config, quant=q)
            with compress(model, cache, attention=mode):
                first = model(ids, past_key_values=cache).logits[:, -1]
                nxt = model(first.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
            outs[mode] = torch.stack([first, nxt])
            rep = cache.memory_report()
            cfg = model.config
            assert rep.tables_bytes == cfg.num_hidden_layers * cfg.num_key_value_heads * 8 * 8 * 4
            assert rep.total_bytes == walked_nbytes(cache)
        full = model(ids).logits[:, -1]
    torch.testing.assert_close(outs["native"], outs["reference"], rtol=0, atol=2e-3)
    # the prefill's logits never read the cache: both modes give the full model's (measured: equal)
    for mode in outs:
        torch.testing.assert_close(outs[mode][0], full, rtol=0, atol=1e-4)
    # At 8 bits the calibrated cache stays close to the full one on a continuation that reads it
    # (the prefill's own logits never read the cache): measured max |d logit| 0.017 on these
    # tokens; 4-bit codes give 0.47 and 2-bit 3.1, so a broken layout fails this bound.
    q8 = QuantConfig.kivi(bits=8, group_size=8, residual_length=8, rotation="calibrated", rotation_path=path)
    got, want = _continuation(model, tok, ids, CompressedCache(model.config, quant=q8)), _continuation(model, tok, ids)
    err = (got - want).abs().max().item()
    assert err < 0.035, err
    # That bound holds without the rotation too (no rotation measures 0.017 as well): that the
    # calibrated rotation is applied is checked against a cache the test quantizes itself, values
    # rotated by R_h (per-channel keys are not, §25.3), every whole group of 8 coded, the rest kept.
    # Measured max |d logit| 1.5e-5 (float noise); with R_h skipped (identity) 0.018; the bound
    # sits between (perturbing every rotated value by 1e-5 relative, which flips many codes, gives
    # 1.1e-3). On stories260K the calibrated rotation is no better than none at any width here
    # (head_dim 8), so a quality bound cannot tell them apart: this reference can.
    off = (got - _rotated_reference(model, tok, ids, tensors, bits=8)).abs().max().item()
    assert off < 1e-3, f"max |d logit| {off:.2e} from the rotated reference (R_h skipped measures 0.018)"
