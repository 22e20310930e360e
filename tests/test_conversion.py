"""Tests for the GGUF-to-float32 conversion cache (kv_cache.models.conversion), offline.

The suite runs under the lowest and the newest supported transformers releases (see the
Makefile), so the pinned token ids below also check that both give the same ids. The
GGUF files are written here from stories260K's weights: one with its sentencepiece
tokenizer, one with a GPT-2 style byte-level tokenizer like SmolLM2's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kv_cache.models import conversion, load_model, shared_data_dir
from kv_cache.models.tokenizer import gguf_tokenizer

SHA = "0" * 64  # stands for the source's sha256 in the marker

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def _new_llama_gguf(model, path):
    """A GGUFWriter for a float32 llama GGUF of ``model``, with the hyperparameters and weights added.

    q and k are permuted the way llama.cpp stores them; the caller adds the tokenizer and writes.
    """
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers), w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size), w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads), w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps), w.add_rope_freq_base(10000.0), w.add_rope_dimension_count(cfg.head_dim)
    for key, tensor in model.state_dict().items():
        t = tensor.float().numpy()
        if key == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif key == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif key.startswith("model.layers."):
            layer, rest = key[len("model.layers."):].split(".", 1)
            part = _GGUF_NAMES[rest.rsplit(".", 1)[0]]
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(part)
            if heads:  # llama.cpp's rotary layout: (heads, 2, d/2) -> (heads, d/2, 2)
                t = t.reshape(heads, 2, t.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(t.shape)
            w.add_tensor(f"blk.{layer}.{part}.weight", np.ascontiguousarray(t))
    return w


def _finish_gguf(w):
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _sentencepiece_gguf(model, path):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(
        model_file=str(shared_data_dir() / "stories260K" / "hf" / "tokenizer.model")
    )
    w = _new_llama_gguf(model, path)
    w.add_tokenizer_model("llama"), w.add_bos_token_id(sp.bos_id()), w.add_eos_token_id(sp.eos_id())
    w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    w.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(len(sp))])
    _finish_gguf(w)


def _byte_level_alphabet():
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    return [chr(b) if b in keep else chr(256 + sum(1 for x in range(b) if x not in keep)) for b in range(256)]


BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_LEVEL_MERGES = ["Ġ t", "h e", "Ġt he", "Ġ w", "h a", "Ġw ha", "l e", "Ġwha le"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _byte_level_gguf(model, path):
    """stories260K's weights with a SmolLM2-like byte-level BPE tokenizer of the same vocabulary size."""
    tokens = [*BYTE_LEVEL_SPECIALS, *_byte_level_alphabet(), *("".join(m.split()) for m in BYTE_LEVEL_MERGES)]
    tokens += [f"<unused{i}>" for i in range(model.config.vocab_size - len(tokens))]
    w = _new_llama_gguf(model, path)
    w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("smollm"), w.add_token_list(tokens)
    w.add_token_types([3] * len(BYTE_LEVEL_SPECIALS) + [1] * (len(tokens) - len(BYTE_LEVEL_SPECIALS)))
    w.add_token_merges(BYTE_LEVEL_MERGES)
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0), w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    _finish_gguf(w)


@pytest.fixture(scope="module")
def converted(stories, tmp_path_factory):
    """stories260K written as a GGUF file of each tokenizer kind, and each converted once."""
    model, _ = stories
    root = tmp_path_factory.mktemp("conversion")
    out = {}
    for kind, write in (("sentencepiece", _sentencepiece_gguf), ("byte_level", _byte_level_gguf)):
        gguf_path = root / kind / f"{kind}.gguf"
        gguf_path.parent.mkdir()
        write(model, gguf_path)
        folder = root / f"{kind}-hf"
        conversion.convert_gguf_to_hf(gguf_path, folder, SHA)
        out[kind] = (gguf_path, folder)
    return out


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level"])
def test_converted_folder_is_complete_plain_float32(converted, kind):
    from safetensors import safe_open

    _, folder = converted[kind]
    assert conversion.is_converted(folder, SHA) and conversion.is_conversion(folder)
    assert not conversion.is_converted(folder, "1" * 64)  # another source
    marker = json.loads((folder / "kv_cache_conversion.json").read_text())
    assert marker["format"] == conversion._CONVERSION_FORMAT and marker["dtype"] == "float32"
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model, which any release loads
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 512
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as fh:
        dtypes = {fh.get_slice(name).get_dtype() for name in fh.keys()}
    assert dtypes == {"F32"}
    assert not list(folder.parent.glob(f".{folder.name}.tmp-*"))  # the temporary folder is gone


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_level"])
def test_converted_folder_gives_the_original_logits(stories, converted, kind):
    model, tok = stories
    _, folder = converted[kind]
    c_model, c_tok = load_model(str(folder))
    assert c_tok.padding_side == "left" and c_tok.pad_token is not None
    ids = tok("Once upon a time, there was a little girl named Lily.", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(c_model(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_sentencepiece_tokenizer_survives_the_conversion(stories, converted):
    _, tok = stories
    _, folder = converted["sentencepiece"]
    _, c_tok = load_model(str(folder))
    text = "Once upon a time, there was a little girl named Lily."
    assert c_tok(text).input_ids == tok(text).input_ids  # BOS included, as stories260K adds it
    assert (c_tok.bos_token, c_tok.eos_token) == ("<s>", "</s>")
    assert c_tok.decode(c_tok(text).input_ids, skip_special_tokens=True) == text


# What the byte-level tokenizer above must give, under every supported transformers release.
BYTE_LEVEL_TEXT = "the whale  1851<|im_end|>"
BYTE_LEVEL_TOKENS = ["t", "he", "Ġwhale", "Ġ", "Ġ", "1", "8", "5", "1", "<|im_end|>"]


def test_byte_level_tokenizer_round_trips_with_pinned_ids(converted):
    gguf_path, folder = converted["byte_level"]
    _, c_tok = load_model(str(folder))
    ids = c_tok(BYTE_LEVEL_TEXT).input_ids
    assert c_tok.convert_ids_to_tokens(ids) == BYTE_LEVEL_TOKENS
    assert ids == gguf_tokenizer(gguf_path)(BYTE_LEVEL_TEXT).input_ids
    assert c_tok.decode(ids) == BYTE_LEVEL_TEXT  # no space clean-up, no BOS
    assert (c_tok.bos_token, c_tok.eos_token, c_tok.unk_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    assert c_tok.eos_token_id == 2 and len(c_tok) == 512
    assert c_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>hi<|im_end|>"


def test_converted_tokenizer_does_not_depend_on_the_class_guess(converted, monkeypatch, tmp_path):
    """A converted folder's tokenizer comes from its tokenizer.json, not from AutoTokenizer.

    AutoTokenizer picks a class from tokenizer_config.json and the model type; without the
    class entry transformers 5.2 rebuilds a Llama tokenizer from the vocabulary and every
    space becomes <|endoftext|>.
    """
    import shutil

    import transformers

    _, folder = converted["byte_level"]
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    config_file = copy / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("tokenizer_class", None)
    config_file.write_text(json.dumps(config))

    def guessing(*args, **kwargs):
        raise AssertionError("a converted folder must not go through AutoTokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", guessing)
    _, c_tok = load_model(str(copy))
    assert c_tok.convert_ids_to_tokens(c_tok(BYTE_LEVEL_TEXT).input_ids) == BYTE_LEVEL_TOKENS
