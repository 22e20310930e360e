"""Rebuild the tokenizer stored in a GGUF file, working around transformers 5.2 bugs.

For a GGUF whose tokenizer is GPT-2 style byte-level BPE (``tokenizer.ggml.model ==
"gpt2"``), such as SmolLM2's, transformers 5.2 builds a broken tokenizer: it declares
``<|im_start|>`` as both BOS and EOS, prepends BOS to every text although the GGUF says
``add_bos_token = False``, adds five CodeLlama infill tokens past the model's vocabulary,
omits SmolLM2's digit pre-tokenizer (so ``"  1846"`` splits differently) and cleans up
spaces when decoding (``decode(encode(text)) != text``). For the pre-tokenizers listed
in ``_BYTE_LEVEL_PRE_TOKENIZERS`` this module rebuilds the tokenizer from the GGUF's
vocabulary, merges and special-token ids instead. For other GGUF tokenizers (for example
sentencepiece Llama ones, where 5.2 likewise sets EOS to the BOS token ``<s>`` and adds the
five infill tokens) it keeps the transformers tokenizer and only corrects EOS, BOS and BOS
insertion from the GGUF metadata.

Gemma 3's GGUF tokenizer is a sentencepiece *BPE* vocabulary (``tokenizer.ggml.model ==
"llama"``, each normal token's score is minus its merge rank), and transformers 5.2 turns it
into a Unigram model that reads those ranks as log-probabilities, so a text splits into the
shortest frequent pieces (``"The capital"`` becomes ``The ▁c ap it al``, not ``The ▁capital``).
For the architectures in ``_SPM_BPE_ARCHITECTURES`` (and no ``add_space_prefix``, as Gemma 3
says) this module rebuilds it as a BPE model whose merges are derived from the scores
(:func:`spm_bpe_merges`), as llama.cpp's sentencepiece tokenizer merges them; on Gemma 3's
vocabulary it gives sentencepiece's own ids.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# llama.cpp's ``tokenizer.ggml.pre`` names whose pre-tokenization this module can rebuild:
# True = split digits one by one before the GPT-2 byte-level regex, False = GPT-2 regex only.
_BYTE_LEVEL_PRE_TOKENIZERS: dict[str, bool] = {"smollm": True, "starcoder": True, "gpt-2": False}

# GGUF architectures whose sentencepiece ("llama") vocabulary is a BPE one that transformers
# 5.2 rebuilds as a Unigram model (its GGUFGemmaConverter); rebuilt here as BPE instead.
_SPM_BPE_ARCHITECTURES = frozenset({"gemma3"})

# llama.cpp's token types (LLAMA_TOKEN_TYPE_*).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _gguf_field(reader: Any, key: str) -> Any:
    """Return a GGUF metadata value as a Python object, or None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    if hasattr(field, "contents"):  # gguf >= 0.11
        return field.contents()
    from gguf import GGUFValueType

    item_type = field.types[-1]
    values = []
    for idx in field.data:
        part = field.parts[idx]
        values.append(bytes(part).decode("utf-8") if item_type == GGUFValueType.STRING else part.tolist()[0])
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def spm_bpe_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges of a sentencepiece BPE vocabulary, from its scores, best first.

    Every split ``(left, right)`` of a normal token into two normal tokens is a merge; merges
    are ranked by the merged token's score, highest first (in a sentencepiece BPE vocabulary
    that is the order in which training learnt them), and the splits of one token by the ids
    of their halves. Applying them lowest rank first is llama.cpp's sentencepiece tokenizer:
    repeatedly join the adjacent pair whose join is the best-scored token.
    """
    vocab = {tok: i for i, (tok, ty) in enumerate(zip(tokens, types)) if int(ty) == _NORMAL}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for tok, idx in vocab.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-float(scores[idx]), idx, li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _added_tokens(tokens: list[str], types: list[int]) -> list[Any]:
    """Control tokens as special ``AddedToken``s and user-defined ones as plain ones, matched in
    the raw text before the model splits it (llama.cpp's rule)."""
    from tokenizers import AddedToken

    return [AddedToken(t, special=int(ty) == _CONTROL, normalized=False)
            for t, ty in zip(tokens, types) if int(ty) in (_CONTROL, _USER_DEFINED)]


def _bos_eos_template(tokens: list[str], bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> Any:
    """The post-processor adding BOS / EOS as the GGUF metadata says (None: it adds neither)."""
    from tokenizers import processors

    prefix = [bos] if add_bos and bos is not None else []
    suffix = [eos] if add_eos and eos is not None else []
    if not (prefix or suffix):
        return None

    def template(seq: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in prefix] + [f"{seq}:{type_id}"] + [f"{t}:{type_id}" for t in suffix]

    return processors.TemplateProcessing(single=template("$A", 0), pair=template("$A", 0) + template("$B", 1),
                                         special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(prefix + suffix)])


def _fast_tokenizer(backend: Any, specials: dict[str, str | None], chat_template: str | None) -> Any:
    """``backend`` wrapped as a ``PreTrainedTokenizerFast`` with the GGUF's special tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template,
                                   clean_up_tokenization_spaces=False,
                                   **{k: v for k, v in specials.items() if v is not None})


def _spm_bpe_tokenizer(reader: Any, tokens: list[str], specials: dict[str, str | None], add_bos: bool,
                       add_eos: bool, chat_template: str | None) -> Any:
    """A sentencepiece BPE GGUF vocabulary as a ``PreTrainedTokenizerFast`` (see the module docstring).

    Spaces become ``▁`` (no space is prepended: only a GGUF whose ``add_space_prefix`` is not
    true comes here), the pieces are joined by :func:`spm_bpe_merges`, a character outside the
    vocabulary falls back to its ``<0xNN>`` byte tokens, control tokens are special tokens and
    user-defined ones (Gemma 3's runs of newlines, spaces and tabs) are matched in the raw text
    first, as llama.cpp does.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _gguf_field(reader, "tokenizer.ggml.scores")
    types = _gguf_field(reader, "tokenizer.ggml.token_type")
    if scores is None or types is None:
        raise ValueError("a sentencepiece BPE vocabulary needs tokenizer.ggml.scores and tokenizer.ggml.token_type")
    backend = Tokenizer(models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=spm_bpe_merges(tokens, scores, types),
        unk_token=specials["unk_token"], fuse_unk=True, byte_fallback=True,
    ))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_tokens(_added_tokens(tokens, types))
    template = _bos_eos_template(tokens, specials["bos_token"], specials["eos_token"], add_bos, add_eos)
    if template is not None:
        backend.post_processor = template
    return _fast_tokenizer(backend, specials, chat_template)


def gguf_tokenizer(gguf_path: Path) -> Any:
    """Build the tokenizer of a GGUF file, working around transformers 5.2 bugs.

    See the module docstring for what is wrong with the stock conversion.
    """
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    reader = GGUFReader(str(gguf_path))
    tok_model = _gguf_field(reader, "tokenizer.ggml.model")
    pre = _gguf_field(reader, "tokenizer.ggml.pre")
    tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{gguf_path} has no tokenizer (tokenizer.ggml.tokens is missing)")

    def special(name: str) -> str | None:
        idx = _gguf_field(reader, f"tokenizer.ggml.{name}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    add_bos = _gguf_field(reader, "tokenizer.ggml.add_bos_token")
    add_eos = _gguf_field(reader, "tokenizer.ggml.add_eos_token")
    chat_template = _gguf_field(reader, "tokenizer.chat_template")

    specials = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    if (tok_model == "llama" and _gguf_field(reader, "general.architecture") in _SPM_BPE_ARCHITECTURES
            and not _gguf_field(reader, "tokenizer.ggml.add_space_prefix")):
        return _spm_bpe_tokenizer(reader, tokens, specials, bool(add_bos), bool(add_eos), chat_template)

    if tok_model == "gpt2" and pre in _BYTE_LEVEL_PRE_TOKENIZERS:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

        merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges") or []]
        types = _gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _BYTE_LEVEL_PRE_TOKENIZERS[pre]:
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens(_added_tokens(tokens, types))
        template = _bos_eos_template(tokens, bos, eos, bool(add_bos), bool(add_eos))
        backend.post_processor = template if template is not None else processors.ByteLevel(trim_offsets=False)
        return _fast_tokenizer(backend, specials, chat_template)

    log.info(
        "GGUF tokenizer %r (pre %r) is not rebuilt here; using transformers' conversion with "
        "special tokens corrected from the GGUF metadata",
        tok_model,
        pre,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if eos is not None and tokenizer.eos_token != eos:
        log.info("setting eos_token to %r (transformers chose %r)", eos, tokenizer.eos_token)
        tokenizer.eos_token = eos
    if bos is not None and tokenizer.bos_token != bos:
        tokenizer.bos_token = bos
    # TokenizersBackend rebuilds its post-processor when add_bos_token is assigned.
    if add_bos is not None and getattr(tokenizer, "add_bos_token", None) not in (None, bool(add_bos)):
        log.info("setting add_bos_token to %s as the GGUF metadata says", bool(add_bos))
        tokenizer.add_bos_token = bool(add_bos)
    return tokenizer
