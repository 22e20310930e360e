"""Questions through the tokenizer's chat template (kv_cache.chat), split as kvpress' pipeline does:
the template's head and the document are compressed; the question, the template's tail and the
answer are the session's tail. With the full cache, ``ask`` gives exactly the tokens
``model.generate`` gives on the whole rendered prompt."""

from __future__ import annotations

import copy

import pytest
import torch

from kv_cache import CompressedContext, KVzip, QuantConfig
from kv_cache.chat import has_chat_template, question_text, split_chat

TEMPLATE = ("{% for m in messages %}<s>[{{ m['role'] }}]: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>[assistant]: {% endif %}")
DOC = "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog Max."


@pytest.fixture
def chat_tok(stories):
    tok = copy.deepcopy(stories[1])  # the shared tokenizer is never changed
    tok.chat_template = TEMPLATE
    return tok


def test_split_chat(chat_tok, stories):
    head, tail = split_chat(chat_tok, "DOC")
    assert head == "<s>[user]: DOC" and tail == "</s>\n<s>[assistant]: "
    assert question_text("Q?", tail) == "\nQ?</s>\n<s>[assistant]: "
    assert not has_chat_template(stories[1])
    with pytest.raises(ValueError, match="has no chat template"):
        split_chat(stories[1], "DOC")


def test_ask_follows_the_template_like_generate(stories, chat_tok, tmp_path):
    model, _ = stories
    ctx = CompressedContext.build(model, chat_tok, DOC, max_tokens=None)
    assert ctx.question_suffix == "</s>\n<s>[assistant]: "
    got = ctx.ask("Who is Max?", max_new_tokens=8)
    prompt = chat_tok.apply_chat_template([{"role": "user", "content": DOC + "\nWho is Max?"}],
                                          add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([chat_tok.encode(prompt, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = chat_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert got == want
    raw = CompressedContext.build(model, chat_tok, DOC, chat=False)
    assert raw.question_suffix is None and raw.context_tokens < ctx.context_tokens
    ctx.save(tmp_path / "c.kvc")  # the suffix travels with the file
    again = CompressedContext.load(tmp_path / "c.kvc", model, chat_tok)
    assert again.question_suffix == ctx.question_suffix and again.ask("Who is Max?", max_new_tokens=8) == got


def test_chat_with_compression_and_errors(stories, chat_tok):
    model, _ = stories
    ctx = CompressedContext.build(model, chat_tok, DOC * 3, quant=QuantConfig(bits=4), eviction=KVzip(budget=0.5))
    assert isinstance(ctx.ask("Who is Max?", max_new_tokens=4), str)
    with pytest.raises(ValueError, match="chat must be None"):
        CompressedContext.build(model, chat_tok, DOC, chat="yes")
    with pytest.raises(ValueError, match="chat=True applies the chat template to a text"):
        CompressedContext.build(model, chat_tok, [1, 2, 3], chat=True)
    with pytest.raises(ValueError, match="has no chat template"):
        CompressedContext.build(model, stories[1], DOC, chat=True)
    with pytest.raises(ValueError, match="the question is empty"):
        ctx.ask("  ")
