"""``kvcache compress`` and ``kvcache ask`` on stories260K with a tiny document."""

from __future__ import annotations

import pytest

from kv_cache import CompressedContext
from kv_cache.cache.serialize import read_info
from kv_cache.cli import main
from kv_cache.cli_context import method_settings

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
