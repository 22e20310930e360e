"""Bits per layer: the allocation against brute force, the profile file, per-layer (K, V) bits in
the cache, the sensitivity measurement on a tiny model and ``kvcache allocate`` (math dictionary §20)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from kv_cache import CompressedCache, QuantConfig, compress
from kv_cache.plan.bit_allocation import (
    BitProfileError,
    allocate_bits,
    layer_bits_from_allocation,
    load_bit_profile,
    read_bit_profile,
    save_bit_profile,
)
from kv_cache.plan.sensitivity import _round_trip, measure_bit_costs
from kv_cache.eval.accounting import walked_nbytes
from kv_cache.spec.grammar import parse_method, parse_quant


def _brute(costs: torch.Tensor, choices, avg) -> float:
    n = costs.shape[0]
    best = float("inf")
    for combo in itertools.product(range(len(choices)), repeat=n):
        if sum(choices[c] for c in combo) <= avg * n + 1e-9:
            best = min(best, sum(float(costs[i, c]) for i, c in enumerate(combo)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_allocation_is_the_brute_force_optimum(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 6, (1,), generator=g))
    choices = [(2, 3, 4), (2, 4), (2, 3, 4, 8), (3,)][seed % 4]
    costs = torch.rand(n, len(choices), generator=g, dtype=torch.float64)  # not convex, not monotone
    avg = float(choices[0] + torch.rand(1, generator=g) * (choices[-1] - choices[0]))
    bits = allocate_bits(costs, choices, avg)
    assert bits.shape == (n,) and bits.dtype == torch.int64
    assert int(bits.sum()) <= avg * n + 1e-9 and set(bits.tolist()) <= set(choices)
    got = sum(float(costs[i, choices.index(int(b))]) for i, b in enumerate(bits))
    assert got == pytest.approx(_brute(costs, choices, avg), abs=1e-12)


def test_allocation_edges():
    costs = torch.tensor([[5.0, 1.0, 0.0], [3.0, 2.5, 1.0]])
    assert allocate_bits(costs, (2, 3, 4), 2.0).tolist() == [2, 2]  # the floor: nothing to spend
    assert allocate_bits(costs, (2, 3, 4), 9.0).tolist() == [4, 4]  # more than enough: every top width
    assert allocate_bits(costs, (2, 3, 4), 2.5).tolist() == [3, 2]  # one bit: where it buys the most
    assert allocate_bits(costs, (2, 3, 4), 3.0).tolist() == [4, 2]
    assert allocate_bits(torch.zeros(3, 2), (2, 4), 4.0).tolist() == [2, 2, 2]  # ties: the fewest bits
    assert layer_bits_from_allocation(torch.tensor([4, 2, 3, 3]), 2) == {0: (4, 2), 1: (3, 3)}


@pytest.mark.parametrize("costs, choices, avg, match", [
    ([[1.0, 0.5]], (2, 4), 3, "must be a torch.Tensor"),
    (torch.ones(2, 2, 1), (2, 4), 3, r"must be \[items, 2\]"),
    (torch.ones(2, 3), (2, 4), 3, r"must be \[items, 2\]"),
    (torch.ones(0, 2), (2, 4), 3, "no items"),
    (torch.tensor([[1.0, float("nan")]]), (2, 4), 3, "NaN or Inf"),
    (torch.tensor([[1.0, float("inf")]]), (2, 4), 3, "NaN or Inf"),
    (torch.tensor([[1.0, -0.1]]), (2, 4), 3, ">= 0"),
    (torch.ones(1, 2), (4, 2), 3, "strictly increasing"),
    (torch.ones(1, 2), (2, 5), 3, "strictly increasing"),
    (torch.ones(1, 0), (), 3, "strictly increasing"),
    (torch.ones(1, 2), (2, 4), 1.5, "below the smallest choice"),
    (torch.ones(1, 2), (2, 4), float("nan"), "finite number"),
    (torch.ones(1, 2), (2, 4), "3", "finite number"),
])
def test_allocation_errors(costs, choices, avg, match):
    with pytest.raises((TypeError, ValueError), match=match):
        allocate_bits(costs, choices, avg)


def test_quant_config_layer_bits_pairs():
    q = QuantConfig.kivi(bits=2, layer_bits={3: (4, 2), 0: 3, 1: [3, 2]})
    assert q.layer_bits == ((0, (3, 3)), (1, (3, 2)), (3, (4, 2)))
    assert q.bits_for(3) == (4, 2) and q.bits_for(0) == (3, 3) and q.bits_for(2) == (2, 2)
    assert QuantConfig.kivi(bits=2, layer_bits=((5, (4, 3)),)).bits_for(5) == (4, 3)
    hash(q)  # frozen and hashable: caches are keyed by it
    for bad in ({0: (4,)}, {0: (4, 5)}, {0: (True, 2)}, {"0": 4}, {-1: (2, 2)}, [1, 2]):
        with pytest.raises(ValueError, match="layer_bits"):
            QuantConfig.kivi(bits=2, layer_bits=bad)
    with pytest.raises(ValueError, match="supports bits"):  # Lloyd-Max has no 8-bit levels, in either half
        QuantConfig.kivi(bits=2, key_grouping="token", levels="lloyd_max", layer_bits={0: (2, 8)})


def test_layer_bits_beyond_the_model_are_refused(stories):
    model, _ = stories
    n = model.config.num_hidden_layers
    with pytest.raises(ValueError, match=f"names layers \\[{n}\\] but the model has {n} layers"):
        CompressedCache(model.config, quant=QuantConfig.kivi(bits=2, group_size=8, residual_length=8,
                                                        layer_bits={n: (4, 4)}))


def _profile(tmp_path, layer_bits, **meta):
    return save_bit_profile(tmp_path / "p.json", layer_bits, {"layout": "q2", **meta})


def test_profile_round_trip_and_spec(tmp_path):
    path = _profile(tmp_path, {0: (4, 2), 1: (3, 3)}, note="x")
    assert load_bit_profile(path) == {0: (4, 2), 1: (3, 3)}
    assert read_bit_profile(path)["note"] == "x"
    q = parse_quant(f"q2g4r4htc64lp[{path}]")
    assert q.layer_bits == ((0, (4, 2)), (1, (3, 3))) and q.levels == "lloyd_max"
    m = parse_method(f"q2g4r4htc64lp[{path}]")
    assert f"layer_bits=((0, (4, 2)), (1, (3, 3)))" in m.resolved  # resumes only with the same allocation
    with pytest.raises(ValueError, match="cannot parse|not one of"):
        parse_method("q2htp[a,b]")


@pytest.mark.parametrize("content, match", [
    (b"\xff\xfe", "is not JSON"),
    (b"{not json", "is not JSON"),
    (b"[1, 2]", "is not a bit profile"),
    (json.dumps({"format": "other"}).encode(), "is not a bit profile"),
    (json.dumps({"format": "kv_cache.bit_profile", "format_version": 99, "layer_bits": {"0": [2, 2]}}).encode(),
     "format_version 99"),
    (json.dumps({"format": "kv_cache.bit_profile", "format_version": 1, "layer_bits": {}}).encode(), "non-empty"),
    (json.dumps({"format": "kv_cache.bit_profile", "format_version": 1, "layer_bits": {"0": [2, 5]}}).encode(),
     "bits in"),
    (json.dumps({"format": "kv_cache.bit_profile", "format_version": 1, "layer_bits": {"a": [2, 2]}}).encode(),
     "bits in"),
])
def test_bad_profiles(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(BitProfileError, match=match):
        load_bit_profile(path)


def test_missing_profile(tmp_path):
    with pytest.raises(FileNotFoundError, match="kvcache allocate"):
        load_bit_profile(tmp_path / "none.json")
    with pytest.raises(FileNotFoundError, match="kvcache allocate"):
        parse_quant(f"q2p[{tmp_path / 'none.json'}]")


def test_mixed_layer_bits_cache_holds_each_layers_codes(stories):
    """Per-layer (K, V) widths: each layer's codes hold exactly its bits, the report equals a walk
    over every tensor, and generate runs over the mixed cache."""
    model, tok = stories
    n = model.config.num_hidden_layers
    bits = {i: ((4, 2) if i % 2 else (2, 3)) for i in range(n)}
    q = QuantConfig.kivi(bits=2, group_size=8, residual_length=8, key_grouping="token", rotation="hadamard",
                    levels="lloyd_max", layer_bits=bits)
    cache = CompressedCache(model.config, quant=q)
    ids = tok("Once upon a time there was a little girl who liked to play in the park.", return_tensors="pt").input_ids
    with compress(model, cache):
        out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    for i, layer in enumerate(cache.layers):
        p = layer.storage.packed
        kb, vb = bits[i]
        assert (p.key_bits, p.value_bits) == (kb, vb)
        d = p.head_dim
        assert p.k_codes.shape[-1] == d * kb // 8 and p.v_codes.shape[-1] == d * vb // 8
    assert cache.memory_report().total_bytes == walked_nbytes(cache)


def test_round_trip_keeps_sinks_and_tail_exact():
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 23, 16), torch.randn(1, 2, 23, 16)
    q = QuantConfig.kivi(bits=2, group_size=4, residual_length=4, sink_tokens=3, key_grouping="token",
                    rotation="hadamard", levels="lloyd_max")
    kq, vq = _round_trip(q, 2, 0, k, v)
    assert torch.equal(kq[:, :, :3], k[:, :, :3]) and torch.equal(vq[:, :, 23 - 0:], v[:, :, 23:])
    assert torch.equal(kq[:, :, 3 + 20:], k[:, :, 3 + 20:])  # 20 = 5 whole blocks of 4; the tail stays exact
    assert not torch.equal(kq[:, :, 3:23], k[:, :, 3:23])
    err2 = (_round_trip(q, 2, 0, k, v)[0] - k).square().sum()
    err4 = (_round_trip(q, 4, 0, k, v)[0] - k).square().sum()
    assert err4 < err2 / 4  # Lloyd-Max MSE 0.0095 vs 0.1175 of the RMS^2


def test_measure_bit_costs_on_a_tiny_model(stories):
    model, tok = stories
    ids = tok("Once upon a time, there was a little dog named Spot. Spot liked to run and jump. " * 6,
              return_tensors="pt").input_ids[0]
    q = parse_quant("q2g4r4s2htc16l")
    costs = measure_bit_costs(model, [ids[:96], ids[8:104]], q, (2, 4), prefix_len=80)
    n = model.config.num_hidden_layers
    assert costs.shape == (2 * n, 2) and costs.dtype == torch.float64
    assert bool((costs >= 0).all()) and bool(torch.isfinite(costs).all())
    assert float(costs[:, 0].sum()) > float(costs[:, 1].sum()) > 0  # 2 bits cost more than 4, and both cost
    with pytest.raises(ValueError, match="longer than prefix_len"):
        measure_bit_costs(model, [ids[:50]], q, (2,), prefix_len=80)
    with pytest.raises(ValueError, match="at least one calibration window"):
        measure_bit_costs(model, [], q, (2,), prefix_len=80)
    with pytest.raises(ValueError, match="supports bits"):
        measure_bit_costs(model, [ids[:96]], q, (2, 8), prefix_len=80)


def test_cli_allocate_writes_a_profile_that_evaluates(stories, tmp_path, capsys):
    from kv_cache.cli import main

    text = tmp_path / "t.txt"
    text.write_text("Once upon a time, there was a little dog named Spot. Spot liked to run and jump. " * 20)
    out = tmp_path / "alloc.json"
    rc = main(["allocate", "--model", "stories260K", "--text", str(text), "--layout", "q2g4r4htc16l",
               "--average-bits", "3", "--choices", "2,4", "--windows", "1", "--prefix", "64",
               "--continuation", "16", "--out", str(out)])
    assert rc == 0 and "keys   by layer" in capsys.readouterr().out
    doc = read_bit_profile(out)
    n = stories[0].config.num_hidden_layers
    bits = load_bit_profile(out)
    assert sorted(bits) == list(range(n)) and doc["mean_bits"] <= 3.0
    assert set(doc["costs_kl"]) == {str(i) for i in range(n)} and doc["layout"] == "q2g4r4htc16l"
    assert main(["allocate", "--model", "stories260K", "--text", str(text), "--average-bits", "1",
                 "--choices", "2,4", "--windows", "1", "--prefix", "64", "--continuation", "16",
                 "--layout", "q2g4r4htc16l", "--out", str(tmp_path / "x.json")]) == 2
    assert "below the smallest choice" in capsys.readouterr().err
    assert main(["allocate", "--average-bits", "3", "--layout", "snapkv@0.5", "--out", str(tmp_path / "y.json")]) == 2
    assert "not one of our quantization specs" in capsys.readouterr().err
