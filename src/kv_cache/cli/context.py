"""``kvcache compress`` and ``kvcache ask``: compress a document once into a file, ask it many questions.

``kvcache compress --model stories260K doc.txt -o doc.kvc --method kvzip@0.3`` prefills and
compresses the document (:class:`kv_cache.CompressedContext`), prints the bytes held against an
fp16 cache and the seconds of the prefill and of KVzip's reconstruction pass, and writes the
file (:mod:`kv_cache.cache.serialize`). ``--method`` is a method spec of ``kvcache eval``
(``q4+kvzip@0.3``, ``q4htc8l``, ``snapkv@0.5:layer``, ``full``; our methods only).

The document is UTF-8 text (a binary file is refused) and must fit the model's positions
(``max_position_embeddings``; with KVzip, less what its reconstruction pass reads after the
context): a longer one is refused before the prefill, with its token count and what fits,
unless ``--max-tokens N`` says how many tokens to compress (the first ones, or the last with
``--keep tail``). Questions need positions after the context too.

``kvcache ask doc.kvc "question" ["question" ...]`` loads the model the file names (or
``--model``), checks it is the one the cache was made from, and answers each question from the
compressed context.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


from ..spec import method_settings, parse_ours  # noqa: F401 (defined there; importable from here as before)

KEEP = ("head", "tail")  # kv_cache.context.KEEP (not imported here: `kvcache --help` stays light)
DEFAULT_METHOD = "kvzip@0.3"
DEFAULT_MAX_NEW_TOKENS = 64


def add_parsers(sub) -> None:
    """Register ``compress`` and ``ask`` on ``sub`` (an argparse subparsers object)."""
    c = sub.add_parser("compress", help="compress a document once into a .kvc file",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("document", help="the text file to compress")
    c.add_argument("-o", "--out", required=True, help="the file to write (e.g. doc.kvc)")
    c.add_argument("--model", default="smollm2", help="as `kvcache eval --model` (an alias or a path) [smollm2]")
    how = c.add_mutually_exclusive_group()
    how.add_argument("--method", default=None,
                     help=f"a method spec of `kvcache eval` (quantization and/or eviction) [{DEFAULT_METHOD}]")
    how.add_argument("--ratio", default=None,
                     help="a size instead of a method: the preset plan for this ratio vs fp16 (e.g. 8 or 8x), "
                          "sized for this document (kv_cache.plan.model_preset_plan)")
    how.add_argument("--plan", default=None, help="a plan file written by `kvcache plan`")
    c.add_argument("--file-ratio", type=float, default=None, metavar="R",
                   help="transform-code the file to fp16 K/V bytes / R (kv_cache.codec, the model's calibrated "
                        "basis); without --method the planner picks the KVzip budget for R on the document itself")
    c.add_argument("--bits", type=int, default=None,
                   help="quantize to this many bits: prefixes q<bits>+ to --method (which then has no q part)")
    c.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="compress at most N tokens of the document (N must fit the model's positions) "
                        "[the whole document, refused if it does not fit]")
    c.add_argument("--keep", choices=KEEP, default=None,
                   help="which tokens --max-tokens keeps: the first (head) or the last (tail) [head]")
    c.add_argument("--into", default=None, metavar="SPEC",
                   help="record in the file the quantized layout every reader holds it in once loaded (e.g. q4d: "
                        "the bytes of a q4d prefill); the cache must be full precision (--file-ratio, or eviction "
                        "only) [as stored]")
    c.add_argument("--strict", action="store_true",
                   help="refuse to write a context whose compressed cache fails the fidelity check or, after "
                        "KVzip, the eviction check (an error naming the layers) instead of warning (math "
                        "dictionary §26, §26.1)")
    c.add_argument("--raw-text", action="store_true",
                   help="append questions to the document as raw text, not through the tokenizer's chat template")
    c.set_defaults(_run=run_compress)

    a = sub.add_parser("ask", help="answer questions from a .kvc file written by `kvcache compress`",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("file", help="a file written by `kvcache compress`")
    a.add_argument("questions", nargs="*", help="the questions, each appended after the document")
    a.add_argument("--questions-file", default=None, help="a text file with one question per line")
    a.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens generated per answer at most [{DEFAULT_MAX_NEW_TOKENS}]")
    a.add_argument("--model", default=None, help="the model to load [the one recorded in the file]")
    a.add_argument("--into", default=None, metavar="SPEC",
                   help="hold a full-precision file (every --file-ratio file is one) in this quantized layout once "
                        "loaded, e.g. q4d: the bytes of a q4d prefill; 'full': as stored [the layout the file "
                        "records with `kvcache compress --into`, else as stored]")
    a.set_defaults(_run=run_ask)


def _model_ref(name: str) -> str:
    """What ``ask`` loads: an existing path made absolute, otherwise the alias or hub id as given."""
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


def read_document(path: str) -> str:
    """The text of a document: a UTF-8 text file, not empty. A missing file, a binary file (NUL
    bytes, or bytes that are not UTF-8) or an empty one is refused, naming the file."""
    doc = Path(path)
    if not doc.is_file():
        raise FileNotFoundError(f"no document at {str(doc)!r}")
    data = doc.read_bytes()
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{doc} is not a text file: it holds a NUL byte at offset {nul:,} "
                         "(`kvcache compress` reads UTF-8 text)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{doc} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start:,} "
                         f"({exc.reason}); convert it to UTF-8 first") from None
    if not text.strip():
        raise ValueError(f"{doc} is empty" + (f" ({len(text)} whitespace characters)" if text else ""))
    return text


def run_compress(args: argparse.Namespace) -> int:
    from ..cache.serialize import save_cache
    from ..context import CompressedContext, fit_context, text_token_ids
    from ..models import load_model

    # Everything that can be checked without the model is checked before it loads.
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be an int >= 1; got {args.max_tokens}")
    if args.keep is not None and args.max_tokens is None:
        raise ValueError(f"--keep says which tokens --max-tokens keeps; got --keep {args.keep} without "
                         "--max-tokens: pass --max-tokens N as well")
    if args.bits is not None and (args.ratio is not None or args.plan is not None):
        raise ValueError("--bits prefixes q<bits>+ to --method; --ratio and --plan already choose the widths")
    if args.file_ratio is not None:
        if not 1 <= args.file_ratio < float("inf"):
            raise ValueError(f"--file-ratio must be a finite number >= 1; got {args.file_ratio}")
        if args.bits is not None or args.ratio is not None or args.plan is not None:
            raise ValueError("--file-ratio codes full-precision K/V: it goes with --method (eviction only) or alone, "
                             "not with --bits, --ratio or --plan")
    into = None
    if args.into is not None:
        from ..spec import parse_quant

        into = parse_quant(args.into)
        if args.bits is not None or args.ratio is not None or args.plan is not None:
            raise ValueError("--into records the layout a full-precision file is loaded into: it goes with "
                             "--file-ratio or an eviction-only --method, not with --bits, --ratio or --plan")
    doc = Path(args.document)
    text = read_document(args.document)
    if args.file_ratio is not None and args.method is None:
        args.method = "file-plan"  # chosen below, once the model is loaded
    if args.ratio is not None:
        from ..plan import model_preset_plan, parse_target

        target = f"{parse_target(args.ratio if str(args.ratio).lower().endswith('x') else float(args.ratio)):g}x"
        spec = target
    elif args.method != "file-plan":
        spec = f"plan[{args.plan}]" if args.plan is not None else (args.method or DEFAULT_METHOD)
        parse_ours(spec, args.bits)
    model, tok = load_model(args.model)
    ids = text_token_ids(tok, text)  # checked against the model's positions before the prefill
    basis = None
    if args.file_ratio is not None:
        from ..codec import basis_for_model

        basis = basis_for_model(model)
        if basis is None:
            raise ValueError(f"--file-ratio: no codec basis is shipped or in $KV_CACHE_HOME/codecs for {args.model}: "
                             f"fit one with `kvcache calibrate-codec --model {args.model}`")
    if args.method == "file-plan":
        from ..plan.file_plan import plan_file

        from ..codec import basis_for_model

        limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or len(ids)
        bases = [b for b in (basis_for_model(model, keys_before_rope=True), basis_for_model(model, keys_before_rope=False))
                 if b is not None]  # keys coded before and after RoPE: chosen by measurement too (§27.6)
        fplan = plan_file(model, tok, ids[: min(len(ids), limit // 2)], args.file_ratio, basis=bases)
        basis = fplan.basis or basis
        print(fplan.describe())
        args.method = "full" if fplan.budget is None else f"kvzip@{fplan.budget:g}"
        spec = args.method
    if args.ratio is not None:  # the preset sized for this document's length
        limit = int(getattr(model.config, "max_position_embeddings", 0) or 0) or len(ids)
        plan = model_preset_plan(model, target, context_tokens=min(len(ids), limit))
        kept = fit_context(ids, model.config, tok, plan.eviction(), max_tokens=args.max_tokens, keep=args.keep,
                           names=("--max-tokens ", "--keep "))
        if len(kept) != min(len(ids), limit):
            plan = model_preset_plan(model, target, context_tokens=len(kept))
        quant, eviction = plan.quant_config(), plan.eviction()
        print(plan.describe())
    else:
        quant, eviction, spec = method_settings(spec, args.bits, model)
        if args.file_ratio is not None and quant is not None:
            raise ValueError(f"--file-ratio codes full-precision K/V; --method {spec} quantizes: drop its q part "
                             "(e.g. --method kvzip@0.25) or drop --method to let the planner choose")
        if into is not None and quant is not None:
            raise ValueError(f"--into {args.into} records the layout a full-precision file is loaded into; --method "
                             f"{spec} quantizes already: drop its q part (e.g. --method kvzip@0.25 --into q4d)")
        kept = fit_context(ids, model.config, tok, eviction, max_tokens=args.max_tokens, keep=args.keep,
                           names=("--max-tokens ", "--keep "))
    if not args.raw_text and len(kept) == len(ids):  # the whole document: through the chat template if any
        ctx = CompressedContext.build(model, tok, text, quant=quant, eviction=eviction, strict=args.strict)
    else:  # raw text, or the tokens --max-tokens kept
        ctx = CompressedContext.build(model, tok, kept, quant=quant, eviction=eviction, strict=args.strict)
    extra = {"context_tokens": ctx.context_tokens, "model": _model_ref(args.model), "method": spec,
             "document": doc.name}
    if ctx.question_suffix is not None:  # questions follow the chat template (kv_cache.chat)
        extra["question_suffix"] = ctx.question_suffix
    if len(kept) < len(ids):
        extra.update(document_tokens=len(ids), keep=args.keep or "head")
    if into is not None:
        from ..cache.relayout import restorable
        from ..cache.serialize_state import _encode_quant

        extra["into"] = _encode_quant(restorable(into.for_model(model.config)))  # as readers will hold it
    if args.file_ratio is not None:
        from ..cache.report import fp16_kv_bytes

        spec = extra["method"] = f"{spec}+file{args.file_ratio:g}"
        written = save_cache(ctx.cache, args.out, model_config=model.config, extra=extra, codec=basis,
                             file_bytes=int(fp16_kv_bytes(model.config, ctx.cache.get_seq_length()) / args.file_ratio))
    else:
        written = save_cache(ctx.cache, args.out, model_config=model.config, extra=extra)
    rep, st = ctx.cache.memory_report(), ctx.stats
    print(f"compressed {doc.name}: {ctx.context_tokens} tokens with {spec} on {args.model}")
    if len(kept) < len(ids):
        print(f"kept:  the {'last' if args.keep == 'tail' else 'first'} {len(kept):,} of the document's "
              f"{len(ids):,} tokens (--max-tokens {args.max_tokens})")
    print(f"held:  {rep.total_bytes:,} B vs fp16 {rep.fp16_bytes:,} B ({rep.ratio:.2f}x smaller; "
          f"{rep.tokens_kept:.1f} of {rep.tokens_seen} tokens kept per head on average)")
    line = f"time:  prefill {st.prefill_s:.2f} s"
    if st.reconstruction_s:
        line += f" + reconstruction {st.reconstruction_s:.2f} s ({st.cost_ratio:.2f}x the prefill alone)"
    print(line)
    for note in rep.notes:
        print(f"note:  {note}")
    ratio = f", {rep.fp16_bytes / written:.1f}x smaller than fp16" if args.file_ratio is not None else ""
    print(f"wrote: {args.out} ({written:,} B{ratio})")
    if into is not None:
        print(f"into:  readers hold it as {args.into} once loaded (`kvcache ask --into full` keeps it as stored)")
    return 0


def _questions(args: argparse.Namespace) -> list[str]:
    qs = list(args.questions)
    if args.questions_file:
        f = Path(args.questions_file)
        if not f.is_file():
            raise FileNotFoundError(f"--questions-file: no file at {str(f)!r}")
        qs += [line.strip() for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not qs:
        raise ValueError("no question: give questions as arguments or with --questions-file")
    return qs


def run_ask(args: argparse.Namespace) -> int:
    from ..cache.serialize import read_info
    from ..context import CompressedContext
    from ..models import load_model

    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    questions = _questions(args)
    into = "file"  # the layout the file records, if any
    if args.into is not None:
        from ..spec import parse_quant

        into = None if args.into.strip().lower() == "full" else parse_quant(args.into)
    info = read_info(args.file)  # checks the file before the model is loaded
    if into not in (None, "file") and info.get("quant") is not None:
        raise ValueError(f"--into {args.into}: {args.file} holds a quantized cache already; --into re-stores a "
                         "full-precision file (one written with --file-ratio, or without quantization)")
    name = args.model or info["extra"].get("model")
    if not name:
        raise ValueError(f"{args.file} does not record its model: pass --model")
    model, tok = load_model(name)
    ctx = CompressedContext.load(args.file, model, tok, quant=into)
    for q in questions:  # every question fits with its answer before any is answered
        ctx.question_ids(q, args.max_new_tokens)
    for q in questions:
        answer = ctx.ask(q, max_new_tokens=args.max_new_tokens)
        print(f"Q: {q}\nA: {answer.strip()}\n")
    sys.stdout.flush()
    return 0
