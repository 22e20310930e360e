"""Tests for the offline evaluation task builders (kv_cache.eval.tasks)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kv_cache.eval import tasks as T

TOKENIZER_DIR = Path("/work/shared/data/stories260K/hf")
SHAKESPEARE = Path("/work/shared/data/tinyshakespeare/input.txt")
WIKITEXT = Path("/work/shared/data/wikitext-2-raw/wiki.test.raw")

pytestmark = pytest.mark.skipif(
    not (TOKENIZER_DIR.exists() and SHAKESPEARE.exists() and WIKITEXT.exists()),
    reason="shared test data not available",
)

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


@pytest.fixture(scope="module")
def shakes():
    return T.read_text(SHAKESPEARE)


@pytest.fixture(scope="module")
def wiki_raw():
    return WIKITEXT.read_bytes().decode("utf-8")  # keeps the CRLF line endings


@pytest.fixture(scope="module")
def bpe_chat_tok(shakes):
    """A tiny GPT-2-style byte-level BPE tokenizer with a ChatML template (like SmolLM2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator([shakes[:100_000]], trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    tok.chat_template = CHATML
    return tok


def n_tokens(tok, sample, *, query_aware=False, chat=None):
    ctx, q = T.build_prompt(sample, tok, query_aware=query_aware, chat=chat)
    return len(tok(ctx + q, verbose=False).input_ids)


# ----------------------------------------------------------------- perplexity windows
def test_ppl_windows_are_consecutive_tokens_of_text(tok, wiki_raw):
    wins = T.perplexity_windows(tok, wiki_raw, context=64, prefix_len=48, num_windows=3)
    assert len(wins) == 3
    ref = tok(wiki_raw[:4000].replace("\r\n", "\n"), add_special_tokens=False).input_ids
    for i, w in enumerate(wins):
        assert len(w.input_ids) == 64
        assert w.prefix_len == 48 and len(w.prefix_ids) == 48 and len(w.continuation_ids) == 16
        assert w.start == 64 * i and w.index == i
        assert w.input_ids == ref[64 * i : 64 * (i + 1)]
    assert wins[0].input_ids[0] != tok.bos_token_id  # no BOS by default


def test_ppl_windows_crlf_normalised_stride_and_bos(tok, wiki_raw):
    assert "\r\n" in wiki_raw
    a = T.perplexity_windows(tok, wiki_raw, context=32, prefix_len=8, num_windows=2)
    b = T.perplexity_windows(
        tok, wiki_raw.replace("\r\n", "\n"), context=32, prefix_len=8, num_windows=2
    )
    assert a == b
    over = T.perplexity_windows(tok, wiki_raw, context=32, prefix_len=8, num_windows=3, stride=16)
    assert [w.start for w in over] == [0, 16, 32]
    assert over[1].input_ids[:16] == over[0].input_ids[16:]
    bos = T.perplexity_windows(tok, wiki_raw, context=32, prefix_len=8, num_windows=2, add_bos=True)
    assert all(len(w.input_ids) == 32 and w.input_ids[0] == tok.bos_token_id for w in bos)
    assert bos[0].input_ids[1:] == a[0].input_ids[:31]


def test_ppl_text_too_short(tok):
    with pytest.raises(ValueError, match=r"has \d+ tokens .* need 300 tokens"):
        T.perplexity_windows(tok, "A tiny text. " * 5, context=100, prefix_len=50, num_windows=3)


@pytest.mark.parametrize(
    "kwargs", [dict(prefix_len=64), dict(prefix_len=0), dict(num_windows=0), dict(stride=0)]
)
def test_ppl_bad_arguments(tok, shakes, kwargs):
    args = dict(context=64, prefix_len=32, num_windows=2) | kwargs
    with pytest.raises(ValueError):
        T.perplexity_windows(tok, shakes, **args)


# ----------------------------------------------------------------- needle depth
@pytest.mark.parametrize("task", ["niah_single", "passkey"])
@pytest.mark.parametrize("haystack", ["text", "noise"])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_at_requested_depth(tok, shakes, task, haystack, depth):
    request = T.TaskRequest(tok, shakes, context=1500, num_samples=1, depths=[depth],
                            haystack=haystack, seed=5)
    (s,) = T.build_task(task, request)
    needle = s.metadata["needles"][0]
    assert s.depth == depth
    pos = s.context.find(needle)
    assert pos >= 0 and s.context.count(needle) == 1
    hay_len = len(s.context) - len(needle)
    assert abs(pos / hay_len - depth) <= 0.05, (pos, hay_len)
    # in tokens too
    tok_pos = len(tok(s.context[:pos], add_special_tokens=False).input_ids)
    tok_all = len(tok(s.context.replace(needle, ""), add_special_tokens=False).input_ids)
    assert abs(tok_pos / tok_all - depth) <= 0.05
    if depth == 0.0:
        assert pos == 0
    elif depth == 1.0:
        assert s.context.endswith(needle)
    else:  # snapped to a sentence or line start
        assert s.context[pos - 1].isspace()
        assert re.search(r"([.!?][\"')\]]*\s+|\n)$", s.context[:pos]), s.context[pos - 40 : pos]


def test_default_depths_are_random_and_recorded(tok, shakes):
    ss = T.build_task("niah_single", T.TaskRequest(tok, shakes, context=400, num_samples=4, seed=1))
    depths = [s.depth for s in ss]
    assert all(0.0 <= d <= 1.0 for d in depths) and len(set(depths)) == 4
    request = T.TaskRequest(tok, shakes, context=400, num_samples=3, depths=[0.2, 0.8])
    ss = T.build_task("niah_single", request)
    assert [s.depth for s in ss] == [0.2, 0.8, 0.2]


# ----------------------------------------------------------------- prompt length
@pytest.mark.parametrize("task", sorted(T.TASKS))
@pytest.mark.parametrize("haystack", ["text", "noise"])
def test_prompt_length_within_slack(tok, shakes, task, haystack):
    opts = {"top_k": 3} if task == "cwe" else {}
    for context in (500, 1200, 3000):
        request = T.TaskRequest(tok, shakes, context=context, num_samples=2, haystack=haystack,
                                seed=context)
        ss = T.build_task(task, request, **opts)
        for s in ss:
            n = n_tokens(tok, s)
            assert context - T.CONTEXT_SLACK <= n <= context, (task, context, n)
            assert n == s.metadata["num_tokens"]
            if task != "cwe":  # cut token by token: within a few tokens
                assert context - 4 <= n, (task, context, n)


@pytest.mark.parametrize("task", ["niah_multikey", "vt", "cwe", "passkey"])
@pytest.mark.parametrize("query_aware", [False, True])
def test_prompt_length_chat_bpe_tokenizer(bpe_chat_tok, shakes, task, query_aware):
    tok = bpe_chat_tok
    opts = {"top_k": 5} if task == "cwe" else {}
    for context in (700, 2000):
        request = T.TaskRequest(tok, shakes, context=context, num_samples=2,
                                query_aware=query_aware)
        ss = T.build_task(task, request, **opts)
        for s in ss:
            assert s.metadata["fit"] == {"query_aware": query_aware, "chat": True}
            n = n_tokens(tok, s, query_aware=query_aware)
            assert context - T.CONTEXT_SLACK <= n <= context, (task, context, n)


def test_context_too_small(tok, shakes):
    with pytest.raises(ValueError, match="too small"):
        T.build_task("niah_multiquery", T.TaskRequest(tok, shakes, context=100, num_samples=1))
    with pytest.raises(ValueError, match="too small for task 'cwe'"):
        T.build_task("cwe", T.TaskRequest(tok, shakes, context=200, num_samples=1))


# ----------------------------------------------------------------- prompt building
def test_build_prompt_modes(tok, shakes):
    request = T.TaskRequest(tok, shakes, context=400, num_samples=1, depths=[0.5])
    (s,) = T.build_task("niah_single", request)
    ctx, q = T.build_prompt(s, tok, query_aware=False)
    assert ctx == s.instruction + s.context
    assert q == "\n" + s.question + " " + s.answer_prefix
    assert s.answer_prefix.startswith("The special magic number for ")
    assert s.answer_prefix.endswith("mentioned in the provided text is")
    ctx_qa, q_qa = T.build_prompt(s, tok, query_aware=True)
    assert ctx_qa + q_qa == ctx + q  # the same prompt; only the compression boundary moves
    assert ctx_qa == s.instruction + s.context + "\n" + s.question  # the question ends the compressed part
    assert q_qa == " " + s.answer_prefix
    assert T.format_chat(tok, "hello") == "hello"  # no chat template: plain text
    with pytest.raises(ValueError, match="no chat template"):
        T.build_prompt(s, tok, query_aware=False, chat=True)


def test_build_prompt_chat(bpe_chat_tok, shakes):
    tok = bpe_chat_tok
    (s,) = T.build_task("passkey", T.TaskRequest(tok, shakes, context=600, num_samples=1))
    chat_text = T.format_chat(tok, "hi")
    assert chat_text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    for qa in (False, True):
        ctx, q = T.build_prompt(s, tok, query_aware=qa)
        assert ctx.startswith("<|im_start|>system")
        if qa:
            assert ctx.endswith(s.context + "\n" + s.question) and q.startswith("<|im_end|>")
        else:
            assert ctx.endswith(s.context) and q.startswith("\n" + s.question + "<|im_end|>")
        assert q.endswith("<|im_start|>assistant\n" + s.answer_prefix)
        user = s.instruction + s.context + "\n" + s.question
        assert ctx + q == T.format_chat(tok, user) + s.answer_prefix
    plain_ctx, plain_q = T.build_prompt(s, tok, query_aware=False, chat=False)
    assert plain_ctx == s.instruction + s.context


# ----------------------------------------------------------------- scoring
def test_score_exact_and_near_misses():
    assert T.score_retrieval("The special magic number is 12345.", ["12345"]) == 1.0
    assert T.score_retrieval("12345", ["12345"]) == 1.0
    assert T.score_retrieval("(12345)", ["12345"]) == 1.0
    assert T.score_retrieval("It is 123456.", ["12345"]) == 0.0
    assert T.score_retrieval("It is 1234.", ["12345"]) == 0.0
    assert T.score_retrieval("It is 012345.", ["12345"]) == 0.0
    assert T.score_retrieval("It is 12345a.", ["12345"]) == 0.0
    assert T.score_retrieval("It is 1 2345.", ["12345"]) == 0.0
    assert T.score_retrieval("", ["12345"]) == 0.0


def test_score_words_case_insensitive_and_partial():
    assert T.score_retrieval("1. APPLE 2. Banana", ["apple", "banana"]) == 1.0
    assert T.score_retrieval("pineapple, bananas", ["apple", "banana"]) == 0.0
    assert T.score_retrieval("apple and pear", ["apple", "banana", "pear", "plum"]) == 0.5
    score = T.score_retrieval("they are: XKCDA, qwert", ["XKCDA", "QWERT", "ZZZZZ"])
    assert score == pytest.approx(2 / 3)
    assert T.score_retrieval("key is amber-fox", ["amber-fox"]) == 1.0
    assert T.score_retrieval("apple", ["apple", "banana"], mode="part") == 1.0
    assert T.score_retrieval("grape", ["apple", "banana"], mode="part") == 0.0


def test_score_validation():
    with pytest.raises(ValueError, match="at least one"):
        T.score_retrieval("x", [])
    with pytest.raises(ValueError, match=r"\('all', 'part'\).*'any'"):
        T.score_retrieval("x", ["x"], mode="any")
    with pytest.raises(TypeError):
        T.score_retrieval("x", "x")


def test_generated_answer_scores_perfectly(tok, shakes):
    for task in sorted(T.TASKS):
        opts = {"top_k": 3} if task == "cwe" else {}
        (s,) = T.build_task(task, T.TaskRequest(tok, shakes, context=700, num_samples=1), **opts)
        answer = s.answer_prefix + " " + ", ".join(s.expected) + "."
        assert T.score_retrieval(answer, s.expected) == 1.0
        assert T.score_retrieval(s.answer_prefix, s.expected) == 0.0


# ----------------------------------------------------------------- determinism
@pytest.mark.parametrize("task", sorted(T.TASKS))
def test_determinism(tok, shakes, task):
    opts = {"top_k": 3} if task == "cwe" else {}
    a = T.build_task(task, T.TaskRequest(tok, shakes, context=500, num_samples=2, seed=7), **opts)
    b = T.build_task(task, T.TaskRequest(tok, shakes, context=500, num_samples=2, seed=7), **opts)
    c = T.build_task(task, T.TaskRequest(tok, shakes, context=500, num_samples=2, seed=8), **opts)
    assert a == b
    assert [s.context for s in a] != [s.context for s in c]
    assert [s.expected for s in a] != [s.expected for s in c]
    assert a[0].context != a[1].context  # samples differ from each other


# ----------------------------------------------------------------- task content
def test_niah_multikey_has_distractors(tok, shakes):
    for s in T.build_task("niah_multikey", T.TaskRequest(tok, shakes, context=800, num_samples=3)):
        keys = s.metadata["keys"]
        (query,) = s.metadata["query_keys"]
        assert len(keys) == len(set(keys)) == 4
        assert len(s.expected) == 1 and s.expected == s.metadata["values"][query]
        found = re.findall(r"special magic numbers for ([\w-]+) is: (\d+)\.", s.context)
        assert len(found) == 4
        assert {k for k, _ in found} == set(keys)
        assert dict(found)[query] == s.expected[0]
        for k, v in found:
            if k != query:
                assert v != s.expected[0] and k not in s.question
        assert query in s.question and query in s.answer_prefix


def test_niah_multivalue_and_multiquery(tok, shakes):
    (mv,) = T.build_task("niah_multivalue", T.TaskRequest(tok, shakes, context=800, num_samples=1))
    (key,) = mv.metadata["query_keys"]
    assert len(mv.expected) == len(set(mv.expected)) == 4
    assert sorted(re.findall(rf"for {key} is: (\d+)\.", mv.context)) == sorted(mv.expected)
    assert "numbers" in mv.question and mv.answer_prefix.endswith("are")
    (mq,) = T.build_task("niah_multiquery", T.TaskRequest(tok, shakes, context=800, num_samples=1))
    assert len(mq.metadata["query_keys"]) == 4 and len(mq.expected) == 4
    for k, v in zip(mq.metadata["query_keys"], mq.expected):
        assert k in mq.question and f"for {k} is: {v}." in mq.context


def test_vt_chain_is_consistent(tok, shakes):
    for haystack in ("text", "noise"):
        request = T.TaskRequest(tok, shakes, context=800, num_samples=2, haystack=haystack)
        for s in T.build_task("vt", request):
            assign = dict(re.findall(r"^VAR ([A-Z]{5}) = (\d+|VAR [A-Z]{5})$", s.context, re.M))
            assert len(assign) == 5

            def resolve(v):
                rhs = assign[v]
                return resolve(rhs[4:]) if rhs.startswith("VAR ") else rhs

            value = s.metadata["value"]
            holding = {v for v in assign if resolve(v) == value}
            assert holding == set(s.expected) and len(s.expected) == 5
            assert value in s.question and "5 variables" in s.answer_prefix
            # hops appear in order
            lines = [ln for ln in s.context.split("\n") if ln.startswith("VAR ")]
            assert lines == s.metadata["chains"][0]


@pytest.mark.parametrize("haystack", ["text", "noise"])
def test_cwe_expected_are_most_frequent(tok, shakes, haystack):
    request = T.TaskRequest(tok, shakes, context=1500, num_samples=2, haystack=haystack)
    for s in T.build_task("cwe", request, top_k=5):
        items = re.findall(r"(\d+)\. ([a-z]+)", s.context)
        assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
        counts = Counter(w for _, w in items)
        assert len(s.expected) == 5
        top = {w for w, _ in counts.most_common(5)}
        assert top == set(s.expected)
        assert min(counts[w] for w in s.expected) > max(
            c for w, c in counts.items() if w not in s.expected
        )
        assert "5 most common" in s.question and s.depth is None


def test_noise_haystack_and_passkey_needle(tok):
    request = T.TaskRequest(tok, None, context=600, num_samples=1, haystack="noise", depths=[0.3])
    (s,) = T.build_task("passkey", request)
    key = s.expected[0]
    assert re.fullmatch(r"\d{5}", key)
    assert f"The pass key is {key}. Remember it." in s.context
    assert T.NOISE_HAYSTACK in s.context
    assert s.answer_prefix == "The pass key is"


# ----------------------------------------------------------------- errors
def test_text_too_short_for_retrieval(tok):
    request = T.TaskRequest(tok, "The cat sat. " * 20, context=1000, num_samples=1)
    with pytest.raises(ValueError, match=r"text too short .* tokens"):
        T.build_task("niah_single", request)


def test_unknown_task_lists_known_names(tok, shakes):
    with pytest.raises(ValueError, match="unknown task 'niah_bogus'") as info:
        T.build_task("niah_bogus", T.TaskRequest(tok, shakes, context=500, num_samples=1))
    for name in T.TASKS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        (dict(haystack="essay"), ValueError, r"\('text', 'noise'\).*'essay'"),
        (dict(depths=[1.5]), ValueError, r"\[0, 1\].*1.5"),
        (dict(depths=[]), ValueError, "non-empty"),
        (dict(num_samples=0), ValueError, "num_samples"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(context="500"), TypeError, "context"),
    ],
)
def test_invalid_request_arguments(tok, shakes, kwargs, exc, pattern):
    args = dict(context=500, num_samples=1) | kwargs
    with pytest.raises(exc, match=pattern):
        T.TaskRequest(tok, shakes, **args)


def test_text_required_for_text_haystack(tok):
    with pytest.raises(ValueError, match="haystack='noise'"):
        T.TaskRequest(tok, None, context=500, num_samples=1)


def test_task_request_is_normalised_once_and_frozen(tok):
    import dataclasses

    r = T.TaskRequest(tok, "a\r\nb", context=np.int64(500), num_samples=2, depths=0.25)
    assert r.text == "a\nb" and r.depths == (0.25,) and type(r.context) is int
    assert r.use_chat is False and "a\nb" not in repr(r)  # the haystack text stays out of repr
    assert T.TaskRequest(tok, "x", context=9, num_samples=1, depths=[0, 1]).depths == (0.0, 1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.seed = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="no chat template"):
        T.TaskRequest(tok, "x", context=9, num_samples=1, chat=True)


def test_build_task_takes_a_request_and_rejects_unknown_options(tok, shakes):
    with pytest.raises(TypeError, match="request must be a TaskRequest, got dict"):
        T.build_task("passkey", {"context": 500, "num_samples": 1})
    request = T.TaskRequest(tok, shakes, context=500, num_samples=1)
    with pytest.raises(TypeError, match=r"unexpected options for passkey: \['top_k'\]"):
        T.build_task("passkey", request, top_k=3)


def test_eval_package_reexports_exactly_the_tasks_api():
    import kv_cache.eval as E

    assert E.__all__ == T.__all__
    assert all(getattr(E, name) is getattr(T, name) for name in T.__all__)


def test_check_context_fits():
    T.check_context_fits(4096, 8192)
    T.check_context_fits(8000, 8192, max_new_tokens=128)
    with pytest.raises(ValueError, match=r"needs 8320 positions.*at most 8192"):
        T.check_context_fits(8192, 8192, max_new_tokens=128)
    with pytest.raises(ValueError, match="at most 512"):
        T.check_context_fits(1024, 512)


def test_read_text_normalises_crlf(tmp_path):
    p = tmp_path / "crlf.txt"
    p.write_bytes(b"\xef\xbb\xbfline one\r\nline two\rthree\r\n")
    assert T.read_text(p) == "line one\nline two\nthree\n"
