"""``kvcache compress`` and ``kvcache ask`` on stories260K with a tiny document."""

from __future__ import annotations

import re

import pytest
import torch

from kv_cache import CompressedContext, KVzip, QuantConfig
from kv_cache.cache.serialize import read_info
from kv_cache.cli import main
from kv_cache.cli.context import method_settings
from kv_cache.context import fit_context, max_context_tokens, max_positions
from kv_cache.models import shared_data_dir

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
        "One day, she saw a big red ball near the tree. ") * 2


@pytest.fixture
def doc(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text(TEXT)
    return p


def _answers(out: str) -> list[str]:
    return [line[3:] for line in out.splitlines() if line.startswith("A: ")]


def test_compress_then_ask(stories, doc, tmp_path, capsys):
    out = tmp_path / "doc.kvc"
    assert main(["compress", "--model", "stories260K", str(doc), "-o", str(out), "--method", "kvzip@0.3"]) == 0
    printed = capsys.readouterr().out
    assert "held:" in printed and "vs fp16" in printed and "x smaller" in printed
    assert "prefill" in printed and "reconstruction" in printed
    assert f"wrote: {out}" in printed
    info = read_info(out)
    assert info["extra"]["model"] == "stories260K" and info["extra"]["method"] == "kvzip@0.3"
    assert info["eviction"]["class"] == "KVzip"

    qfile = tmp_path / "q.txt"
    qfile.write_text("The ball was\n\n")
    assert main(["ask", str(out), "Lily saw", "--questions-file", str(qfile), "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out
    assert "Q: Lily saw" in printed and "Q: The ball was" in printed
    model, tok = stories
    quant, eviction, _ = method_settings("kvzip@0.3", None, model)
    ctx = CompressedContext.build(model, tok, TEXT, quant=quant, eviction=eviction)
    expected = [ctx.ask(q, max_new_tokens=6).strip() for q in ("Lily saw", "The ball was")]
    assert _answers(printed) == expected


def test_bits_sugar_and_eval_specs(stories, doc, tmp_path, capsys):
    out = tmp_path / "q.kvc"
    args = ["compress", "--model", "stories260K", str(doc), "-o", str(out),
            "--method", "snapkv@0.5:layer", "--bits", "4"]
    assert main(args) == 0
    assert "with q4+snapkv@0.5:layer" in capsys.readouterr().out
    info = read_info(out)
    assert info["quant"]["bits"] == 4 and info["eviction"]["fields"]["scope"] == "layer"
    assert main(["ask", str(out), "Lily saw", "--max-new-tokens", "3"]) == 0
    assert len(_answers(capsys.readouterr().out)) == 1


def test_compress_by_ratio_or_plan(stories, doc, tmp_path, capsys):
    """`--ratio 4`: the preset sized for this document reaches 4x; `--plan` reads a plan file."""
    from kv_cache.plan import CachePlan

    out = tmp_path / "r.kvc"
    # a short document: the slots kept in full precision (sinks, the residual of per-channel key
    # groups) leave 4x within reach, not 8x
    assert main(["compress", "--model", "stories260K", str(doc), "-o", str(out), "--ratio", "4"]) == 0
    printed = capsys.readouterr().out
    assert "plan '4x'" in printed and "with 4x on stories260K" in printed
    ratio = float(printed.split(" B (")[1].split("x smaller")[0])
    assert ratio >= 4 * 0.98
    assert main(["ask", str(out), "Lily saw", "--max-new-tokens", "3"]) == 0
    plan_path = tmp_path / "p.json"
    model, _ = stories
    CachePlan.uniform(model.config, QuantConfig(bits=2)).save(plan_path)
    assert main(["compress", "--model", "stories260K", str(doc), "-o", str(out), "--plan", str(plan_path)]) == 0
    assert read_info(out)["quant"]["bits"] == 2
    capsys.readouterr()
    assert main(["compress", "--model", "stories260K", str(doc), "-o", str(out), "--ratio", "8", "--bits", "4"]) == 2
    assert "--ratio and --plan already choose the widths" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not allowed with --method
        main(["compress", "--model", "stories260K", str(doc), "-o", str(out), "--ratio", "8", "--method", "q4"])


def test_method_settings(stories):
    model = stories[0]
    assert method_settings("full", None, model)[:2] == (None, None)
    quant, eviction, spec = method_settings("h2o@0.5", 2, model)
    assert quant.bits == 2 and type(eviction).__name__ == "H2O" and spec == "q2+h2o@0.5"


@pytest.mark.parametrize("argv, message", [
    (["compress", "--model", "stories260K", "{doc}", "-o", "{tmp}/x.kvc", "--method", "hf-quanto-int4"],
     "peer's method"),
    (["compress", "--model", "stories260K", "{doc}", "-o", "{tmp}/x.kvc", "--method", "q4", "--bits", "2"],
     "two quantization parts"),
    (["compress", "--model", "stories260K", "{tmp}/missing.txt", "-o", "{tmp}/x.kvc"], "no document at"),
    (["ask", "{tmp}/missing.kvc", "q"], "no kv_cache file at"),
    (["ask", "{doc}", "q"], "not a kv_cache file"),
    (["ask", "{doc}"], "no question"),
])
def test_errors(doc, tmp_path, capsys, argv, message):
    argv = [a.format(doc=doc, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# -- documents that do not fit, binary files, bad options (issue 19) --------------------------------

LONG = shared_data_dir() / "tinyshakespeare" / "input.txt"  # ~690K stories260K tokens; the model has 512 positions
BINARY = shared_data_dir() / "stories260K" / "stories260K_q80.bin"


def _no_model(monkeypatch):
    """Fail the test if the command loads the model (its checks must come first)."""
    import kv_cache.models

    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(kv_cache.models, "load_model", load_model)


def _no_prefill(monkeypatch):
    import kv_cache.context.compressed

    def prefill(*a, **k):
        raise AssertionError("the prefill ran before the document was checked")

    monkeypatch.setattr(kv_cache.context.compressed, "prefill", prefill)  # where CompressedContext.build calls it


@pytest.mark.parametrize("method, fits, why", [
    ("full", 512, "the model has 512 positions (max_position_embeddings):"),
    ("kvzip@0.3", None, "KVzip's reconstruction pass reads up to"),
])
def test_compress_refuses_a_document_longer_than_the_model_positions(stories, tmp_path, capsys, monkeypatch,
                                                                    method, fits, why):
    model, tok = stories
    if fits is None:
        fits = max_context_tokens(model.config, tok, method_settings(method, None, model)[1], first=1)
        assert 200 < fits < 256  # the pass repeats the context after it: about half the positions
    _no_prefill(monkeypatch)
    out = tmp_path / "x.kvc"
    n = len(tok(LONG.read_text()).input_ids)
    assert main(["compress", "--model", "stories260K", str(LONG), "-o", str(out), "--method", method]) == 2
    err = capsys.readouterr().err
    assert f"the document is {n:,} tokens" in err and why in err
    assert f"at most {fits} context tokens fit" in err and f"pass --max-tokens N (N <= {fits}" in err
    assert "--keep head or tail" in err
    assert not out.exists()


@pytest.mark.parametrize("keep", [None, "head", "tail"])
def test_compress_max_tokens_keeps_part_of_a_long_document(stories, tmp_path, capsys, keep):
    model, tok = stories
    out = tmp_path / "x.kvc"
    argv = ["compress", "--model", "stories260K", str(LONG), "-o", str(out), "--method", "q4+kvzip@0.3",
            "--max-tokens", "120"] + ([] if keep is None else ["--keep", keep])
    assert main(argv) == 0
    printed = capsys.readouterr().out
    n = len(tok(LONG.read_text()).input_ids)
    which = "last" if keep == "tail" else "first"
    assert "compressed input.txt: 120 tokens" in printed
    assert f"kept:  the {which} 120 of the document's {n:,} tokens (--max-tokens 120)" in printed
    extra = read_info(out)["extra"]
    assert extra["context_tokens"] == 120 and extra["document_tokens"] == n and extra["keep"] == (keep or "head")
    assert main(["ask", str(out), "Then", "--max-new-tokens", "3"]) == 0
    assert len(_answers(capsys.readouterr().out)) == 1


def test_compress_max_tokens_that_do_not_fit(tmp_path, capsys):
    out = tmp_path / "x.kvc"
    assert main(["compress", "--model", "stories260K", str(LONG), "-o", str(out), "--method", "full",
                 "--max-tokens", "600"]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens 600 does not fit: the model has 512 positions" in err and "at most 512 context" in err
    assert not out.exists()


@pytest.mark.parametrize("content, message", [
    (b"Once upon a time\x00\x01\x02", "is not a text file: it holds a NUL byte at offset 16"),
    (b"Once upon a caf\xe9 time", "is not UTF-8 text: byte 0xe9 at offset 15"),
    (b"", "is empty"),
    (b" \n\t\n", "is empty (4 whitespace characters)"),
])
def test_compress_refuses_binary_or_empty_files_before_loading_the_model(tmp_path, capsys, monkeypatch,
                                                                        content, message):
    _no_model(monkeypatch)
    doc = tmp_path / "doc.bin"
    doc.write_bytes(content)
    assert main(["compress", "--model", "stories260K", str(doc), "-o", str(tmp_path / "x.kvc")]) == 2
    err = capsys.readouterr().err
    assert f"{doc} {message}" in err


def test_compress_refuses_a_real_binary_file(tmp_path, capsys, monkeypatch):
    _no_model(monkeypatch)
    assert main(["compress", "--model", "stories260K", str(BINARY), "-o", str(tmp_path / "x.kvc")]) == 2
    err = capsys.readouterr().err
    assert str(BINARY) in err and ("is not a text file" in err or "is not UTF-8 text" in err)


@pytest.mark.parametrize("extra, message", [
    (["--max-tokens", "0"], "--max-tokens must be an int >= 1; got 0"),
    (["--keep", "tail"], "--keep says which tokens --max-tokens keeps; got --keep tail without --max-tokens"),
    (["--method", "hf-quanto-int4"], "peer's method"),
])
def test_compress_option_errors_come_before_the_model(doc, tmp_path, capsys, monkeypatch, extra, message):
    _no_model(monkeypatch)
    assert main(["compress", "--model", "stories260K", str(doc), "-o", str(tmp_path / "x.kvc"), *extra]) == 2
    assert message in capsys.readouterr().err


def test_compress_keep_choices(doc, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compress", "--model", "stories260K", str(doc), "-o", str(tmp_path / "x.kvc"),
              "--max-tokens", "10", "--keep", "middle"])
    assert exc.value.code == 2
    err = capsys.readouterr().err  # argparse quotes the choices or not, by Python version
    assert re.search(r"argument --keep: invalid choice: 'middle' \(choose from '?head'?, '?tail'?\)", err)


def test_ask_checks_every_question_fits_before_answering(tmp_path, capsys):
    out = tmp_path / "x.kvc"
    assert main(["compress", "--model", "stories260K", str(LONG), "-o", str(out), "--method", "full",
                 "--max-tokens", "500"]) == 0
    capsys.readouterr()
    assert main(["ask", str(out), "Then", "Then she said", "--max-new-tokens", "11"]) == 2  # 2 + 11 - 1 = 12 fit
    captured = capsys.readouterr()
    assert "A:" not in captured.out
    assert ("the question (4 tokens) + max_new_tokens (11) need 14 positions but the model has 512 positions "
            "(max_position_embeddings) and the context takes 500, leaving 12 for the question and its answer: "
            "max_new_tokens <= 9 fits") in captured.err
    assert main(["ask", str(out), "Then", "Then she said", "--max-new-tokens", "9"]) == 0
    assert len(_answers(capsys.readouterr().out)) == 2


# -- the same rules in the Python API: CompressedContext.build / ask, fit_context ------------------

def test_build_refuses_a_document_that_does_not_fit(stories, monkeypatch):
    model, tok = stories
    _no_prefill(monkeypatch)
    text = LONG.read_text()[:5000]
    n = len(tok(text).input_ids)
    with pytest.raises(ValueError, match=rf"the document is {n:,} tokens but the model has 512 positions "
                                         r"\(max_position_embeddings\): at most 512 context tokens fit; pass "
                                         r"max_tokens=N \(N <= 512, leaving room for the questions\) .* "
                                         r"keep='head' or 'tail'"):
        CompressedContext.build(model, tok, text)
    fits = max_context_tokens(model.config, tok, KVzip(budget=0.3), first=1)
    with pytest.raises(ValueError, match=rf"max_tokens={fits + 1} does not fit: .* KVzip's reconstruction pass "
                                         rf"reads up to \d+ more after the context \(chunk_size=2048\), so at most "
                                         rf"{fits} context tokens fit"):
        CompressedContext.build(model, tok, text, eviction=KVzip(budget=0.3), max_tokens=fits + 1)
    # A smaller chunk leaves more room for the context.
    assert max_context_tokens(model.config, tok, KVzip(budget=0.3, chunk_size=64), first=1) > fits


def test_build_max_tokens_and_keep(stories):
    model, tok = stories
    text = LONG.read_text()[:5000]
    ids = tok(text).input_ids
    fits = max_context_tokens(model.config, tok, KVzip(budget=0.3), first=1)
    ctx = CompressedContext.build(model, tok, text, eviction=KVzip(budget=0.3), max_tokens=fits)
    assert (ctx.context_tokens, ctx.document_tokens) == (fits, len(ids))
    tail = CompressedContext.build(model, tok, text, max_tokens=50, keep="tail")
    ref = CompressedContext.build(model, tok, ids[:1] + ids[-49:])
    assert tail.context_tokens == 50 and torch.equal(tail.last_logits, ref.last_logits)
    head = CompressedContext.build(model, tok, text, max_tokens=50)
    assert torch.equal(head.last_logits, CompressedContext.build(model, tok, ids[:50]).last_logits)
    short = CompressedContext.build(model, tok, TEXT, max_tokens=500, keep="tail")  # nothing to cut
    assert short.context_tokens == short.document_tokens == len(tok(TEXT).input_ids)


def test_fit_context_rules(stories):
    model, tok = stories
    ids = [tok.bos_token_id] + list(range(10, 700))
    assert fit_context(ids, model.config, tok, max_tokens=5) == ids[:5]
    assert fit_context(ids, model.config, tok, max_tokens=5, keep="head") == ids[:5]
    assert fit_context(ids, model.config, tok, max_tokens=5, keep="tail") == [tok.bos_token_id, 696, 697, 698, 699]
    assert fit_context(ids[1:], model.config, tok, max_tokens=3, keep="tail") == [697, 698, 699]  # no BOS
    assert fit_context(ids[:100], model.config, tok) == ids[:100]
    assert max_positions(model.config) == 512


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an int >= 1 or None; got 0"),
    (dict(max_tokens=True), "max_tokens must be an int >= 1 or None; got True"),
    (dict(max_tokens=2.5), "max_tokens must be an int >= 1 or None; got 2.5"),
    (dict(max_tokens=10, keep="middle"), r"keep must be one of \['head', 'tail'\] or None; got 'middle'"),
    (dict(keep="tail"), "keep says which tokens max_tokens keeps; got keep='tail' without max_tokens"),
])
def test_build_option_errors(stories, monkeypatch, kwargs, message):
    model, tok = stories
    _no_prefill(monkeypatch)
    with pytest.raises(ValueError, match=message):
        CompressedContext.build(model, tok, TEXT, **kwargs)


@pytest.mark.parametrize("document, error, message", [
    ("", ValueError, "the context text is empty"),
    ("  \n", ValueError, r"the context text is empty \(3 whitespace characters\)"),
    ("Once upon\x00 a time", ValueError, "the context text holds a NUL character at offset 9: binary data, not text"),
    ([1, 600], ValueError, r"token ids must be in \[0, 512\) \(the model's vocab_size\); got 600"),
    ([1, -3], ValueError, r"token ids must be in \[0, 512\) \(the model's vocab_size\); got -3"),
    ([1.0, 2.0], ValueError, "token ids must be integers; got torch.float32"),
])
def test_build_refuses_bad_documents(stories, monkeypatch, document, error, message):
    model, tok = stories
    _no_prefill(monkeypatch)
    with pytest.raises(error, match=message):
        CompressedContext.build(model, tok, document)


def test_ask_needs_room_for_the_question_and_the_answer(stories):
    model, tok = stories
    ctx = CompressedContext.build(model, tok, LONG.read_text()[:5000], max_tokens=505)  # 7 positions left
    q = tok.encode(" Then she", add_special_tokens=False)
    with pytest.raises(ValueError, match=rf"the question \({len(q)} tokens\) \+ max_new_tokens \(9\) need "
                                         rf"{len(q) + 8} positions but the model has 512 positions .* context takes "
                                         rf"505, leaving 7 for the question and its answer: max_new_tokens <= "
                                         rf"{8 - len(q)} fits"):
        ctx.ask(q, max_new_tokens=9)
    assert isinstance(ctx.ask(q, max_new_tokens=8 - len(q)), str)  # exactly the room left
    with pytest.raises(ValueError, match="the question is 8 tokens but .* leaving 7 .*: ask a shorter question"):
        ctx.ask(list(range(10, 18)), max_new_tokens=1)
