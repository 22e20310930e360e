"""Saving and loading a compressed cache (kv_cache.cache.serialize) on stories260K."""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch

from kv_cache import H2O, CompressedContext, KVzip, QuantConfig, SnapKV
from kv_cache.cache import serialize
from kv_cache.cache.packed import Rotation, _hadamard
from kv_cache.cache.packed_ragged import PackedRaggedStorage
from kv_cache.cache.serialize import load_cache, read_info, save_cache
from kv_cache.cache.storage import FullPrecisionStorage, QuantizedStorage

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
        "One day, she saw a big red ball near the tree. ") * 3
QUESTION = " Lily saw"
Q4 = dict(bits=4, group_size=16, residual_length=16)

CASES = {
    # name: (quant, eviction, storage class of layer 0)
    "full+kvzip": (None, KVzip(budget=0.3), PackedRaggedStorage),
    "q4+snapkv-layer": (QuantConfig.kivi(**Q4), SnapKV(budget=0.5, scope="layer"), PackedRaggedStorage),
    "q4-hadamard-token-lloyd": (QuantConfig.kivi(**Q4, rotation="hadamard", key_grouping="token", levels="lloyd_max"),
                                None, QuantizedStorage),
    "none": (None, None, FullPrecisionStorage),
    "h2o": (None, H2O(budget=48), FullPrecisionStorage),
    "q4+h2o": (QuantConfig.kivi(**Q4), H2O(budget=64), QuantizedStorage),
}

_built: dict[str, CompressedContext] = {}


def _ctx(stories, name: str) -> CompressedContext:
    if name not in _built:
        model, tok = stories
        quant, eviction, _ = CASES[name]
        _built[name] = CompressedContext.build(model, tok, TEXT, quant=quant, eviction=eviction)
    return _built[name]


def _same_tensors(a, b) -> None:
    ha, hb = a.held_tensors(), b.held_tensors()
    assert ha.keys() == hb.keys()
    for k in ha:
        assert ha[k].dtype == hb[k].dtype and ha[k].shape == hb[k].shape, k
        assert torch.equal(ha[k], hb[k]), k


@pytest.fixture(scope="module")
def saved(stories, tmp_path_factory):
    """A small saved cache (4-bit + SnapKV(scope="layer"): ragged, packed) to damage."""
    path = tmp_path_factory.mktemp("kvc") / "ctx.kvc"
    _ctx(stories, "q4+snapkv-layer").save(path)
    return path


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_answers_and_bytes_identical(stories, tmp_path, name):
    model, tok = stories
    ctx = _ctx(stories, name)
    assert isinstance(ctx.cache.layers[0].storage, CASES[name][2])
    before = ctx.ask(QUESTION, max_new_tokens=12)
    path = tmp_path / "ctx.kvc"
    n = ctx.save(path)
    assert n == path.stat().st_size
    loaded = CompressedContext.load(path, model, tok)
    assert loaded.context_tokens == ctx.context_tokens
    assert loaded.cache.quant == ctx.cache.quant and loaded.cache.eviction == ctx.cache.eviction
    assert loaded.cache.memory_report() == ctx.cache.memory_report()
    _same_tensors(ctx.cache, loaded.cache)
    for a, b in zip(ctx.cache.layers, loaded.cache.layers):
        assert (a.seen, a.prompt_len, a._prefill_done, a.dtype) == (b.seen, b.prompt_len, b._prefill_done, b.dtype)
        assert (a._starts is None) == (b._starts is None)
        if a._starts is not None:
            assert torch.equal(a._starts, b._starts)
    assert loaded.ask(QUESTION, max_new_tokens=12) == before
    assert ctx.ask(QUESTION, max_new_tokens=12) == before  # saving changed nothing


def test_dense_rotation_round_trips(stories, tmp_path):
    """A rotation held as dense matrices (the calibrated kind) is saved by its tensors and class."""
    model, tok = stories
    quant = QuantConfig.kivi(**Q4, rotation="hadamard", key_grouping="token")
    ctx = CompressedContext.build(model, tok, TEXT, quant=quant)
    for layer in ctx.cache.layers:
        rot = layer.storage.packed.rotation
        h = _hadamard(rot.signs.shape[-1], "cpu")
        layer.storage.packed.rotation = Rotation.from_matrices(rot.signs.float()[:, :, None] * h)  # diag(s) H
    before = ctx.ask(QUESTION, max_new_tokens=8)
    ctx.save(tmp_path / "m.kvc")
    loaded = CompressedContext.load(tmp_path / "m.kvc", model, tok)
    assert loaded.cache.layers[0].storage.packed.rotation.signs is None
    _same_tensors(ctx.cache, loaded.cache)
    assert loaded.ask(QUESTION, max_new_tokens=8) == before


def test_header_records_settings_model_and_tokens(stories, saved):
    model, _ = stories
    info = read_info(saved)
    assert info["model"]["model_type"] == "llama"
    assert info["model"]["kv_heads"] == model.config.num_key_value_heads
    assert info["model"]["config_hash"] == serialize.model_identity(model.config)["config_hash"]
    assert info["quant"]["bits"] == 4 and info["quant"]["scale_dtype"] == {"dtype": "float16"}
    assert info["eviction"] == {"class": "SnapKV", "fields": {**info["eviction"]["fields"], "scope": "layer"}}
    assert info["tokens_seen"] == info["extra"]["context_tokens"] > 0
    from safetensors import safe_open

    with safe_open(saved, "pt") as f:  # plain safetensors, tensors named by where they live
        names = set(f.keys())
        assert f.metadata()["format_version"] == str(serialize.FORMAT_VERSION)
    assert "layer3.packed.k_codes" in names and "layer3.tail.residual_keys" in names


def test_unknown_rotation_type_refused(stories, tmp_path):
    ctx = _ctx(stories, "q4-hadamard-token-lloyd")
    layer = ctx.cache.layers[0]
    rot = layer.storage.packed.rotation

    class Other:
        pass

    layer.storage.packed.rotation = Other()
    try:
        refused = r"cannot save attribute 'layer0.packed.rotation' of type .*Other: .*Rotation"
        with pytest.raises(ValueError, match=refused):
            save_cache(ctx.cache, tmp_path / "x.kvc")
    finally:
        layer.storage.packed.rotation = rot
    assert not (tmp_path / "x.kvc").exists()


def test_save_refused_inside_a_session(stories, tmp_path):
    ctx = _ctx(stories, "none")
    with ctx.cache.session(), pytest.raises(ValueError, match="inside cache.session"):
        save_cache(ctx.cache, tmp_path / "x.kvc")


def test_calibrated_quant_without_its_calibration_file():
    """The file holds the rotation matrices: a calibration file deleted since is not needed."""
    settings = {**serialize._encode_quant(QuantConfig.kivi(bits=4)), "rotation": "calibrated",
                "rotation_path": "/no/such/calibration.safetensors"}
    quant = serialize._decode_quant(settings)
    assert (quant.rotation, quant.rotation_path) == ("calibrated", "/no/such/calibration.safetensors")
    assert quant.bits == 4


# ------------------------------------------------------------------------------------ errors
def test_missing_file(stories, tmp_path):
    with pytest.raises(FileNotFoundError, match="no kv_cache file at"):
        load_cache(tmp_path / "nope.kvc", model_config=stories[0].config)


def test_wrong_model_shape(stories, saved):
    cfg = copy.deepcopy(stories[0].config)
    cfg.num_hidden_layers -= 1
    with pytest.raises(ValueError, match=r"num_layers expected 5 \(in the file\), received 4 \(this model\)"):
        load_cache(saved, model_config=cfg)


def test_wrong_model_config_hash(stories, saved):
    cfg = copy.deepcopy(stories[0].config)
    cfg.rms_norm_eps = 0.125
    with pytest.raises(ValueError, match=r"different model config .*rms_norm_eps: expected .*, received 0\.125"):
        load_cache(saved, model_config=cfg)


def test_same_model_from_another_folder_matches(stories, saved):
    cfg = copy.deepcopy(stories[0].config)
    cfg._name_or_path = "/somewhere/else"
    cache, extra = load_cache(saved, model_config=cfg)
    assert extra["context_tokens"] == cache.get_seq_length()


def test_truncated(stories, saved, tmp_path):
    data = saved.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 100, 5):
        bad = tmp_path / f"t{keep}.kvc"
        bad.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="truncated|not a kv_cache file"):
            load_cache(bad, model_config=stories[0].config)
    bad.write_bytes(data[:len(data) - 10])
    with pytest.raises(ValueError, match=r"truncated: expected \d+ bytes, found \d+"):
        load_cache(bad, model_config=stories[0].config)


def test_trailing_bytes(stories, saved, tmp_path):
    bad = tmp_path / "long.kvc"
    bad.write_bytes(saved.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="trailing bytes"):
        load_cache(bad, model_config=stories[0].config)


def test_flipped_byte_in_a_tensor(stories, saved, tmp_path):
    data = bytearray(saved.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    table = json.loads(data[8:8 + n])
    begin, end = table["layer3.packed.k_codes"]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x01
    bad = tmp_path / "flip.kvc"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted: tensor 'layer3.packed.k_codes' sha256 expected"):
        load_cache(bad, model_config=stories[0].config)


def test_flipped_byte_anywhere_is_an_error(stories, saved, tmp_path):
    data = saved.read_bytes()
    bad = tmp_path / "flip.kvc"
    step = max(1, len(data) // 97)
    for pos in range(0, len(data), step):
        flipped = bytearray(data)
        flipped[pos] ^= 0x04
        bad.write_bytes(bytes(flipped))
        with pytest.raises(ValueError):
            load_cache(bad, model_config=stories[0].config)


def test_changed_header_value_caught(stories, saved, tmp_path):
    """A header edited consistently for safetensors (same length) still fails its sha256."""
    data = saved.read_bytes()
    seen = ('\\"seen\\":' + str(read_info(saved)["tokens_seen"])).encode()  # JSON inside a JSON string
    assert seen in data
    other = seen[:-1] + (b"1" if seen[-1:] == b"0" else b"0")
    bad = tmp_path / "edit.kvc"
    bad.write_bytes(data.replace(seen, other, 1))
    with pytest.raises(ValueError, match="corrupted: header sha256 expected"):
        load_cache(bad, model_config=stories[0].config)


def test_wrong_format_version(stories, tmp_path, monkeypatch):
    ctx = _ctx(stories, "none")
    monkeypatch.setattr(serialize, "FORMAT_VERSION", 99)
    save_cache(ctx.cache, tmp_path / "v99.kvc")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"format version expected one of \[2, 3\], found .99."):
        load_cache(tmp_path / "v99.kvc", model_config=stories[0].config)


def test_not_a_kv_cache_file(stories, tmp_path):
    from safetensors.torch import save_file

    cfg = stories[0].config
    junk = tmp_path / "junk.kvc"
    junk.write_bytes(b"this is a text file, not a cache at all\n" * 4)
    with pytest.raises(ValueError, match="not a kv_cache file"):
        load_cache(junk, model_config=cfg)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(3)}, other, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not a kv_cache file.*format expected 'kv_cache.compressed_cache', "
                                         r"found 'pt'"):
        load_cache(other, model_config=cfg)
    empty = tmp_path / "empty.kvc"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a kv_cache file"):
        load_cache(empty, model_config=cfg)


def test_tensors_are_named_by_declared_fields(stories, tmp_path):
    """Every object is written by its layout's declared ``FIELDS`` (saved name -> attribute), never by
    whatever attributes it carries: an extra attribute is not saved, an undeclared field is refused."""
    from safetensors import safe_open

    from kv_cache.cache.serialize_state import _Reader, _Writer

    ctx = _ctx(stories, "q4+h2o")
    path = tmp_path / "q.kvc"
    ctx.save(path)
    with safe_open(path, "pt") as f:
        names = set(f.keys())
    assert "layer0.residual_keys" in names and "layer0.packed.k_codes" in names
    assert not any(n.rsplit(".", 1)[-1].startswith("_") or n.endswith(".keys") for n in names if "state" not in n)
    plain = _ctx(stories, "none")
    with safe_open(_save(plain, tmp_path / "p.kvc"), "pt") as f:
        assert {"layer0.key_buffer", "layer0.value_buffer"} <= set(f.keys())
    storage = ctx.cache.layers[0].storage
    storage.scratch = torch.zeros(3)  # not a declared field: not written
    w = _Writer(ctx.cache.quant, None)
    rec = w.obj(storage, "layer0")
    del storage.scratch
    assert set(rec["attrs"]) == set(QuantizedStorage.FIELDS) and "layer0.scratch" not in w.tensors
    bad = copy.deepcopy(rec)
    bad["attrs"]["scratch"] = None
    with pytest.raises(ValueError, match="declares"):
        _Reader(w.tensors, ctx.cache.quant, torch.device("cpu"), set()).obj(bad)


def _save(ctx, path):
    ctx.save(path)
    return path
