"""Compress a context once, ask it anything: the prefill driver and :class:`CompressedContext`.

* :func:`prefill` prefills a context into a :class:`~kv_cache.CompressedCache` and compresses
  it; for a policy scored by a pass of its own (:class:`~kv_cache.KVzip`) it runs that pass:
  the model reads a "repeat the previous context" prompt and the context again, chunk by
  chunk, each chunk's attention scores the stored tokens it repeats, and nothing of the pass
  stays in the cache or the positions. Then the cache evicts.
* :class:`CompressedContext` holds one compressed context and answers any number of
  questions from it (:meth:`CompressedCache.session`: each question starts from the same
  compressed context at its original positions; the question and answer are dropped after),
  and saves / loads it (:mod:`kv_cache.cache.serialize`).
* :func:`fit_context` checks a document against the model's positions before any work
  (:func:`max_context_tokens`: ``max_position_embeddings``, less the room KVzip's
  reconstruction pass reads after the context), and cuts it only when told what to keep.
"""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from .attention import active_cache
from .generation import forward_at  # noqa: F401 (defined there; kv_cache.context.forward_at stays importable)
from .cache import CompressedCache, compress
from .policies.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT


@dataclass
class PrefillStats:
    """What :func:`prefill` measured: seconds of the context prefill and of the scoring pass."""

    context_tokens: int
    prefill_s: float
    reconstruction_s: float = 0.0
    reconstruction_tokens: int = 0

    @property
    def cost_ratio(self) -> float:
        """Total prefill time over the plain prefill's (1.0 without a reconstruction pass)."""
        return (self.prefill_s + self.reconstruction_s) / self.prefill_s if self.prefill_s > 0 else float("nan")


def _ids(tokenizer: Any, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        try:
            return list(tokenizer.encode(text, add_special_tokens=False))
        except TypeError:
            return list(tokenizer.encode(text))
    raise TypeError(f"tokenizer must have an encode() method; got {type(tokenizer).__name__}")


KEEP = ("head", "tail")
"""Which part of a document :func:`fit_context` keeps when it cuts it: the first or the last tokens."""


def max_positions(config: Any) -> int | None:
    """The positions a model was trained on (``max_position_embeddings`` of its text config);
    None when the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def reconstruction_positions(context_tokens: int, eviction: Any, tokenizer: Any, first: int = 0) -> int:
    """Positions KVzip's reconstruction pass (:func:`reconstruct`) reads after a context of
    ``context_tokens`` tokens: its longest chunk, repeat prompt (or continue prompt + overlap)
    included; every chunk starts at the position after the context. 0 for a policy without the
    pass. ``first``: 1 when the context starts with a BOS token, which is not repeated."""
    if eviction is None or not eviction.needs_reconstruction or context_tokens <= first:
        return 0
    repeat, cont = len(_ids(tokenizer, REPEAT_PROMPT)), len(_ids(tokenizer, CONTINUE_PROMPT))
    c, longest = eviction.chunk_size, 0
    for s in range(first, context_tokens, c):  # as reconstruct() feeds them
        head = repeat if s == first else cont + s - max(first, s - eviction.overlap)
        longest = max(longest, head + min(context_tokens, s + c) - s)
    return longest


def max_context_tokens(config: Any, tokenizer: Any, eviction: Any = None, first: int = 0) -> int | None:
    """How many context tokens :meth:`CompressedContext.build` takes on a model with this
    config: its positions (:func:`max_positions`), less what KVzip's reconstruction pass reads
    after the context (:func:`reconstruction_positions`). None when the model does not say. A
    question and its answer need positions after the context too (:meth:`CompressedContext.ask`
    checks them)."""
    limit = max_positions(config)
    if limit is None:
        return None
    lo, hi = 0, limit  # the largest n with n + pass(n) <= limit; n + pass(n) grows with n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid + reconstruction_positions(mid, eviction, tokenizer, min(first, mid - 1)) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_context(ids: Sequence[int], config: Any, tokenizer: Any, eviction: Any = None, *,
                max_tokens: int | None = None, keep: str | None = None,
                names: tuple[str, str] = ("max_tokens=", "keep=")) -> list[int]:
    """The context ids :meth:`CompressedContext.build` prefills: ``ids`` unchanged when they fit
    the model's positions, cut when ``max_tokens`` / ``keep`` say what to keep, refused otherwise.

    Parameters
    ----------
    max_tokens : int >= 1 or None
        Keep at most this many tokens (a leading BOS included); it must fit
        (:func:`max_context_tokens`). None: the whole document, which must fit.
    keep : ``"head"``, ``"tail"`` or None
        Which tokens ``max_tokens`` keeps: the first (``"head"``, the default) or the last
        (``"tail"``, after a leading BOS token, which stays first). Only with ``max_tokens``.
    names : the option names used in error messages, as they are written before a value
        (``kvcache compress`` passes ``("--max-tokens ", "--keep ")``).

    Raises
    ------
    ValueError
        ``max_tokens`` not an int >= 1, or more than fits; ``keep`` not in :data:`KEEP`, or
        without ``max_tokens``; a document longer than fits without ``max_tokens`` (the
        message names its token count, the model's positions, what fits and the option).
    """
    opt_max, opt_keep = names
    n_max, n_keep = opt_max.rstrip("= "), opt_keep.rstrip("= ")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{n_max} must be an int >= 1 or None; got {max_tokens!r}")
    if keep is not None and keep not in KEEP:
        raise ValueError(f"{n_keep} must be one of {list(KEEP)} or None; got {keep!r}")
    ids = list(ids)
    if keep is not None and max_tokens is None:
        given = f"{opt_keep}{keep if opt_keep.endswith(' ') else repr(keep)}"
        raise ValueError(f"{n_keep} says which tokens {n_max} keeps; got {given} without {n_max}: "
                         f"pass {opt_max}N as well")
    bos = getattr(tokenizer, "bos_token_id", None)
    first = 1 if len(ids) > 1 and bos is not None and ids[0] == bos else 0
    fits = max_context_tokens(config, tokenizer, eviction, first)
    if fits is not None:
        limit = max_positions(config)
        why = f"the model has {limit:,} positions (max_position_embeddings)"
        if fits < limit:
            why += (f" and {type(eviction).__name__}'s reconstruction pass reads up to "
                    f"{reconstruction_positions(max(fits, 1), eviction, tokenizer, first):,} more after the context "
                    f"(chunk_size={eviction.chunk_size})")
        if fits < 1:
            raise ValueError(f"no context fits: {why}")
        if max_tokens is not None and max_tokens > fits:
            raise ValueError(f"{opt_max}{max_tokens} does not fit: {why}, so at most {fits:,} context tokens fit")
        if max_tokens is None and len(ids) > fits:
            values = " or ".join(repr(k) if opt_keep.endswith("=") else k for k in KEEP)
            raise ValueError(
                f"the document is {len(ids):,} tokens but {why}: at most {fits:,} context tokens fit; "
                f"pass {opt_max}N (N <= {fits:,}, leaving room for the questions) to compress the first N "
                f"tokens, with {opt_keep}{values} to choose the part"
            )
    if max_tokens is None or len(ids) <= max_tokens:
        return ids
    if keep == "tail":
        return ids[:first] + ids[len(ids) - (max_tokens - first):] if max_tokens > first else ids[:max_tokens]
    return ids[:max_tokens]


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a context text, with the special tokens (BOS) the tokenizer adds."""
    return list(tokenizer(text).input_ids) if callable(tokenizer) else _ids(tokenizer, text)


def check_text(text: Any, what: str = "the context text") -> str:
    """Refuse a text that is not a ``str``, is empty (or whitespace only) or holds NUL
    characters (binary data decoded as text)."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str; got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"{what} is empty" + (f" ({len(text)} whitespace characters)" if text else ""))
    nul = text.find("\x00")
    if nul >= 0:
        raise ValueError(f"{what} holds a NUL character at offset {nul}: binary data, not text")
    return text


def prefill(
    model: torch.nn.Module,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    *,
    tokenizer: Any = None,
    attention_mask: torch.Tensor | None = None,
    last_only: bool = False,
    check: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, PrefillStats]:
    """Prefill ``input_ids`` ``[batch, T]`` into an empty ``cache`` and compress it.

    Runs inside ``kv_cache.compress(model, cache)`` (entered here unless it is already active
    for this cache). With :class:`~kv_cache.KVzip` the reconstruction pass follows (``tokenizer``
    required, batch 1), then every layer evicts. ``last_only``: form the last position's logits
    only (``logits_to_keep=1``, as ``model.generate``'s prefill does); the ``T x vocab`` logits
    of a long context are otherwise the prefill's largest tensor (800 MB at 4K tokens and a
    49K vocabulary).

    ``check``: called before each attention layer of the prefill and before each chunk of the
    reconstruction pass; whatever it raises stops the prefill there and propagates (the cache is
    then unusable: a server's deadline or cancellation, :mod:`kv_cache.integrations.serve.engine`).

    Returns
    -------
    ``(logits [batch, T, vocab] of the context, or [batch, 1, vocab] with last_only, PrefillStats)``

    Raises
    ------
    TypeError, ValueError
        Not a CompressedCache; ids not an integer ``[batch, T]`` tensor with ``T >= 1``; a cache
        that already holds tokens; KVzip without a tokenizer or on a batch of several rows.
    """
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a CompressedCache; got {type(cache).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                  torch.int32):
        raise ValueError("input_ids must be an integer tensor [batch, tokens]; got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids holds no token: a context needs at least one")
    if cache.get_seq_length() != 0:
        raise ValueError(f"prefill needs an empty cache; this one has seen {cache.get_seq_length()} tokens")
    pol = cache.eviction
    scored = pol is not None and pol.needs_reconstruction
    if scored:
        if tokenizer is None:
            raise ValueError(f"{type(pol).__name__} reads a repeat prompt: pass tokenizer= to kv_cache.prefill")
        if input_ids.shape[0] != 1:
            raise ValueError(f"{type(pol).__name__} scores one context at a time (batch 1); got batch {input_ids.shape[0]}")
    with ExitStack() as stack:
        if active_cache() is not cache or not cache.native:
            stack.enter_context(compress(model, cache))
        if check is not None:
            check()
            stack.enter_context(between_layers(model, check))
        with torch.no_grad():
            t0 = time.perf_counter()
            extra = {"logits_to_keep": 1} if last_only else {}
            out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True,
                        **extra)
            stats = PrefillStats(int(input_ids.shape[1]), time.perf_counter() - t0)
            if scored:
                t0 = time.perf_counter()
                stats.reconstruction_tokens = reconstruct(model, cache, input_ids[0], tokenizer, check=check)
                stats.reconstruction_s = time.perf_counter() - t0
    return out.logits, stats


@contextmanager
def between_layers(model: torch.nn.Module, check: Callable[[], None]) -> Iterator[None]:
    """Call ``check()`` before each attention layer's forward while inside (forward pre-hooks on
    the modules with a ``layer_idx``, or on ``model`` itself when none has one; removed on exit)."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)] or [model]
    handles = [m.register_forward_pre_hook(lambda *_: check()) for m in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reconstruct(model: torch.nn.Module, cache: CompressedCache, context_ids: torch.Tensor, tokenizer: Any, *,
                finish: bool = True, check: Callable[[], None] | None = None) -> int:
    """KVzip's scoring pass over a prefilled context ``context_ids`` ``[T]``; then evict
    (``finish=False``: leave the scores in each layer's ``state["kvzip"]`` ``[batch, kv_heads, T]``
    and evict nothing, for fitting a KVzap scorer).

    Chunk ``[s, e)`` of the context (``chunk_size`` tokens) is fed as
    ``REPEAT_PROMPT + context[s:e]`` (the first) or ``CONTINUE_PROMPT + context[s - overlap:s]
    + context[s:e]`` at the positions after the context; the cache stores none of it. A
    leading BOS token is not repeated. Returns the number of tokens fed.
    """
    pol = cache.eviction
    n = int(context_ids.shape[0])
    first = 1 if n > 1 and int(context_ids[0]) == getattr(tokenizer, "bos_token_id", None) else 0
    repeat, cont = _ids(tokenizer, REPEAT_PROMPT), _ids(tokenizer, CONTINUE_PROMPT)
    fed = 0
    try:
        for s in range(first, n, pol.chunk_size):
            if check is not None:
                check()
            e = min(n, s + pol.chunk_size)
            head = repeat if s == first else cont + context_ids[max(first, s - pol.overlap):s].tolist()
            ids = torch.tensor([head + context_ids[s:e].tolist()], device=context_ids.device)
            cache.begin_reconstruction(min(pol.sink_tokens, s), s, e)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache.end_reconstruction_chunk()
            fed += ids.shape[1]
    finally:
        cache.end_reconstruction_chunk()
    if finish:
        cache.finish_reconstruction()
    return fed


class CompressedContext:
    """One compressed context, asked many questions.

    >>> ctx = CompressedContext.build(model, tokenizer, document, quant=QuantConfig(bits=4),      # doctest: +SKIP
    ...                               eviction=KVzip(budget=0.3))
    >>> ctx.ask("Who signed the contract?")                                                      # doctest: +SKIP
    >>> ctx.save("doc.kvc"); CompressedContext.load("doc.kvc", model, tokenizer).ask("...")      # doctest: +SKIP
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cache: CompressedCache, context_tokens: int,
                 last_logits: torch.Tensor | None = None, stats: PrefillStats | None = None,
                 document_tokens: int | None = None, question_suffix: str | None = None):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        # None: raw text (a question follows the document as is); else the chat template's tail
        # after the user's text (kv_cache.chat), appended to every question
        self.question_suffix = question_suffix
        self.context_tokens = context_tokens
        # tokens of the whole document (more than context_tokens when build cut it)
        self.document_tokens = context_tokens if document_tokens is None else document_tokens
        self.last_logits = last_logits  # [vocab] float32: the next-token logits after the context
        self.stats = stats

    @classmethod
    def build(cls, model: torch.nn.Module, tokenizer: Any, text_or_ids: str | Sequence[int] | torch.Tensor, *,
              quant=None, eviction=None, max_tokens: int | None = None, keep: str | None = None,
              chat: bool | None = None, plan=None, strict: bool = False,
              check: Callable[[], None] | None = None) -> "CompressedContext":
        """Prefill and compress a document (text, or token ids with their BOS if the model wants one).

        The document must fit the model's positions (``max_position_embeddings``; with
        :class:`~kv_cache.KVzip`, less what its reconstruction pass reads after the context:
        :func:`max_context_tokens`), or say what to keep (:func:`fit_context`):

        * ``max_tokens=N``: keep at most ``N`` tokens (``N`` must fit), a leading BOS included;
        * ``keep="head"`` (default) / ``"tail"``: which ones, the first or the last (``"tail"``
          keeps a leading BOS token first).

        Checked before any work: a text that is empty or holds NUL characters, token ids that are
        not integers in ``[0, vocab_size)``, a document longer than fits with neither option
        (``ValueError`` naming its tokens, the model's positions, what fits and the options).
        ``document_tokens`` of the result is the document's length, ``context_tokens`` what was
        kept. Questions need positions after the context too (:meth:`ask` checks them).

        ``chat``: follow the tokenizer's chat template (:mod:`kv_cache.chat`): the template's head
        and the document are compressed, and each question comes with the template's tail. The
        default (None) uses it for a text when the tokenizer has one; False keeps the raw text.
        ``plan``: a :class:`kv_cache.plan.CachePlan` instead of ``quant`` / ``eviction``.
        ``strict``: raise :class:`~kv_cache.FidelityError` when the fidelity check finds layers the
        compression wrecks, or the eviction check an eviction that drops too much of what the
        prompt's last queries read, instead of warning (:class:`~kv_cache.CompressedCache`).
        ``check``: called between the prefill's layers and KVzip's chunks (:func:`prefill`); what
        it raises stops the build.
        """
        from .chat import has_chat_template, split_chat

        if chat not in (None, True, False):
            raise ValueError(f"chat must be None (automatic), True or False; got {chat!r}")
        suffix = None
        if chat and not isinstance(text_or_ids, str):
            raise ValueError("chat=True applies the chat template to a text; token ids are compressed as given")
        if isinstance(text_or_ids, str) and (chat or (chat is None and has_chat_template(tokenizer))):
            head, suffix = split_chat(tokenizer, check_text(text_or_ids))
            ids = _ids(tokenizer, head)  # the template holds the special tokens it wants
        elif isinstance(text_or_ids, str):
            ids = _text_ids(tokenizer, check_text(text_or_ids))
        else:
            t = torch.as_tensor(text_or_ids)
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"token ids must be integers; got {t.dtype}")
            ids = t.reshape(-1).long().tolist()
        vocab = getattr(model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config,
                        "vocab_size", None)
        bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab}) (the model's vocab_size); got {bad[0]} "
                             f"({len(bad)} such ids)")
        document_tokens = len(ids)
        if plan is not None:
            if quant is not None or eviction is not None:
                raise ValueError("pass either plan= or quant=/eviction=, not both (a plan holds both)")
            eviction = plan.eviction()
        ids = fit_context(ids, model.config, tokenizer, eviction, max_tokens=max_tokens, keep=keep)
        cache = (CompressedCache(model.config, plan=plan, strict=strict) if plan is not None
                 else CompressedCache(model.config, quant=quant, eviction=eviction, strict=strict))
        logits, stats = prefill(model, cache, torch.tensor([ids], dtype=torch.long), tokenizer=tokenizer,
                                last_only=True, check=check)
        return cls(model, tokenizer, cache, len(ids), logits[0, -1].float(), stats, document_tokens, suffix)

    def question_ids(self, question: str | Sequence[int], max_new_tokens: int) -> list[int]:
        """The token ids of ``question``, once it is checked to fit with its answer.

        The question and the answer take the positions after the context: ``context_tokens +
        len(question) + max_new_tokens - 1`` must not exceed the model's positions
        (``max_position_embeddings``). ``ValueError`` for an empty question, ``max_new_tokens``
        not an int >= 1, or a question or an answer that would run past the positions (the
        message says how many tokens fit)."""
        if isinstance(question, str):
            if not question.strip():
                raise ValueError("the question is empty")
            if self.question_suffix is not None:
                from .chat import question_text

                question = question_text(question, self.question_suffix)
            ids = _ids(self.tokenizer, question)
        else:
            ids = list(question)
        if not ids:
            raise ValueError("the question is empty")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1; got {max_new_tokens!r}")
        limit = max_positions(self.model.config)
        if limit is not None:
            room = limit - self.context_tokens
            if len(ids) + max_new_tokens - 1 > room:
                where = (f"the model has {limit:,} positions (max_position_embeddings) and the context takes "
                         f"{self.context_tokens:,}, leaving {room:,} for the question and its answer")
                if len(ids) > room:
                    raise ValueError(f"the question is {len(ids):,} tokens but {where}: ask a shorter question "
                                     "(or compress less of the document)")
                raise ValueError(f"the question ({len(ids):,} tokens) + max_new_tokens ({max_new_tokens}) need "
                                 f"{len(ids) + max_new_tokens - 1:,} positions but {where}: max_new_tokens "
                                 f"<= {room - len(ids) + 1:,} fits")
        return ids

    def ask(self, question: str | Sequence[int], *, max_new_tokens: int = 64, eos_token_ids: Sequence[int] | None = None
            ) -> str:
        """Greedy answer to ``question`` (text appended after the context, or token ids), checked
        first by :meth:`question_ids`."""
        from .generation import SamplingParams, generate_tokens

        ids = self.question_ids(question, max_new_tokens)
        eos = set(eos_token_ids if eos_token_ids is not None else
                  [t for t in [getattr(self.tokenizer, "eos_token_id", None)] if isinstance(t, int)])
        with compress(self.model, self.cache), self.cache.session(), torch.no_grad():
            pos = self.context_tokens
            logits = forward_at(self.model, self.cache, torch.tensor([ids]), pos)[0, -1]
            out = list(generate_tokens(self.model, self.cache, logits, pos + len(ids), max_new_tokens=max_new_tokens,
                                       params=SamplingParams(), eos=eos))
        return self.tokenizer.decode(out, skip_special_tokens=True)

    def save(self, path, *, file_ratio: float | None = None, codec: Any = None, codec_settings: Any = None,
             into: Any = None) -> int:
        """Write the compressed context to ``path`` (:mod:`kv_cache.cache.serialize`); returns bytes written.

        ``file_ratio=R``: transform-code the full-precision K/V (:mod:`kv_cache.codec`) so the
        whole file is at most ``fp16 K/V bytes of every context token / R`` with the least
        squared error; ``codec``: the model's basis (a :class:`~kv_cache.codec.CodecBasis` or
        its path; default: the one shipped or in ``$KV_CACHE_HOME/codecs`` for this model).
        ``codec`` alone: the codec's finest steps. The context must be held in full precision
        (``quant=None``; eviction is fine: only the kept tokens are stored).
        ``into`` (a :class:`~kv_cache.QuantConfig`): the layout every reader holds the
        full-precision file in once loaded (:meth:`load`, ``kvcache ask``, the server), recorded
        in the file."""
        from .cache.config import QuantConfig
        from .cache.report import fp16_kv_bytes
        from .cache.serialize import save_cache
        from .cache.serialize_state import _encode_quant

        extra = {"context_tokens": self.context_tokens}
        if self.question_suffix is not None:
            extra["question_suffix"] = self.question_suffix
        if into is not None:
            if not isinstance(into, QuantConfig):
                raise TypeError(f"into must be a QuantConfig (e.g. QuantConfig(bits=4)) or None; got "
                                f"{type(into).__name__}")
            if self.cache.quant is not None:
                raise ValueError(f"into= records the layout a full-precision file is loaded into; this context is "
                                 f"held quantized already ({self.cache.quant!r})")
            if into.evicted_bits is not None:
                raise ValueError("into= cannot hold precision tiers (evicted_bits): the file keeps the kept tokens only")
            extra["into"] = _encode_quant(into)
        if file_ratio is None and codec is None:
            if codec_settings is not None:
                raise ValueError("codec_settings applies to a coded file: pass file_ratio= or codec= too")
            return save_cache(self.cache, path, model_config=self.model.config, extra=extra)
        file_bytes = None
        if file_ratio is not None:
            if isinstance(file_ratio, bool) or not isinstance(file_ratio, (int, float)) or not file_ratio >= 1 \
                    or file_ratio == float("inf"):
                raise ValueError(f"file_ratio must be a finite number >= 1 (fp16 K/V bytes over file bytes); "
                                 f"got {file_ratio!r}")
            file_bytes = int(fp16_kv_bytes(self.model.config, self.cache.get_seq_length()) / file_ratio)
        return save_cache(self.cache, path, model_config=self.model.config, extra=extra,
                          codec=self._basis(codec), file_bytes=file_bytes, codec_settings=codec_settings)

    def _basis(self, codec: Any) -> Any:
        from .codec import CodecBasis, basis_for_model, load_basis
        from .compression.scorer_file import model_identity

        if isinstance(codec, CodecBasis):
            basis = codec
        elif codec is not None:
            basis = load_basis(codec)
        else:
            basis = basis_for_model(self.model)
            if basis is None:
                raise ValueError("no codec basis is shipped or in $KV_CACHE_HOME/codecs for this model: fit one with "
                                 "`kvcache calibrate-codec --model M -o $KV_CACHE_HOME/codecs/M.safetensors` "
                                 "(or pass codec=path)")
        basis.check_identity(model_identity(self.model))
        return basis

    @classmethod
    def load(cls, path, model: torch.nn.Module, tokenizer: Any, *, codec: Any = None,
             quant: Any = "file") -> "CompressedContext":
        """Read a file written by :meth:`save`; refuses a different model or a damaged file.
        A transform-coded file is decoded with ``codec`` (a basis or its path; default: the
        one its fingerprint names among the shipped ones and ``$KV_CACHE_HOME/codecs``).
        ``quant`` (a :class:`~kv_cache.QuantConfig`, e.g. ``QuantConfig(bits=4)``): a
        full-precision file (every codec file is one) is re-stored in that layout on load, as a
        prefill of its kept tokens would store it (:func:`kv_cache.cache.relayout.quantize_cache`);
        ``"file"`` (default): the layout :meth:`save` recorded with ``into=``, if any; None: as
        stored."""
        from .cache.serialize import read_info
        from .cache.serialize_state import _decode_quant

        if isinstance(quant, str):
            if quant != "file":
                raise ValueError(f"quant must be a QuantConfig, None (as stored) or 'file' (the layout the file "
                                 f"records); got {quant!r}")
            recorded = read_info(path)["extra"].get("into")
            if recorded is not None and not isinstance(recorded, dict):
                raise ValueError(f"{path} is corrupted: its recorded layout ('into') must be a QuantConfig record; "
                                 f"got {type(recorded).__name__}")
            quant = _decode_quant(recorded)
        from .cache.serialize import load_cache
        from .codec import CodecBasis, load_basis

        if codec is not None and not isinstance(codec, CodecBasis):
            codec = load_basis(codec)
        device = next(model.parameters()).device  # the cache's tensors go where the model is
        cache, extra = load_cache(path, model_config=model.config, device=device, codec=codec, quant=quant)
        return cls(model, tokenizer, cache, int(extra["context_tokens"]), question_suffix=extra.get("question_suffix"))
