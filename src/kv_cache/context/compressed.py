"""A compressed context asked many questions: :class:`CompressedContext` holds one, answers any
number of questions from it (:meth:`~kv_cache.CompressedCache.session`: each question starts
from the same compressed context at its original positions; the question and answer are
dropped after), and saves / loads it (:mod:`kv_cache.cache.serialize`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..cache import CompressedCache, compress
from ..generation import forward_at
from .fit import check_text, fit_context, max_positions, text_token_ids, token_ids
from .prefill_pass import PrefillStats, prefill


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
              check: Callable[[], None] | None = None, track_positions: bool | None = None) -> "CompressedContext":
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
        it raises stops the build. ``track_positions``: keep the kept tokens' positions (one bit
        per token and KV head, :class:`~kv_cache.CompressedCache`), so that :meth:`save` with a
        basis fitted before RoPE can code the keys before RoPE (§27.6); None (default): where the
        context is held in full precision after an eviction, the case the codec codes.
        """
        from ..chat import has_chat_template, split_chat

        if chat not in (None, True, False):
            raise ValueError(f"chat must be None (automatic), True or False; got {chat!r}")
        suffix = None
        if chat and not isinstance(text_or_ids, str):
            raise ValueError("chat=True applies the chat template to a text; token ids are compressed as given")
        if isinstance(text_or_ids, str) and (chat or (chat is None and has_chat_template(tokenizer))):
            head, suffix = split_chat(tokenizer, check_text(text_or_ids))
            ids = token_ids(tokenizer, head)  # the template holds the special tokens it wants
        elif isinstance(text_or_ids, str):
            ids = text_token_ids(tokenizer, check_text(text_or_ids))
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
        if track_positions is None:
            held_quant = plan.quant_config() if plan is not None else quant
            track_positions = held_quant is None and eviction is not None
        cache = (CompressedCache(model.config, plan=plan, strict=strict, track_positions=track_positions)
                 if plan is not None else
                 CompressedCache(model.config, quant=quant, eviction=eviction, strict=strict,
                                 track_positions=track_positions))
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
                from ..chat import question_text

                question = question_text(question, self.question_suffix)
            ids = token_ids(self.tokenizer, question)
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
        from ..generation import SamplingParams, generate_tokens

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
        from ..cache.config import QuantConfig
        from ..cache.report import fp16_kv_bytes
        from ..cache.serialize import save_cache
        from ..cache.serialize_state import _encode_quant

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
            from ..cache.relayout import restorable

            extra["into"] = _encode_quant(restorable(into.for_model(self.model.config)))  # as readers will hold it
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
        from ..codec import CodecBasis, basis_for_model, load_basis
        from ..compression.scorer_file import model_identity

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
        from ..cache.serialize import read_info
        from ..cache.serialize_state import _decode_quant

        if isinstance(quant, str):
            if quant != "file":
                raise ValueError(f"quant must be a QuantConfig, None (as stored) or 'file' (the layout the file "
                                 f"records); got {quant!r}")
            recorded = read_info(path)["extra"].get("into")
            if recorded is not None and not isinstance(recorded, dict):
                raise ValueError(f"{path} is corrupted: its recorded layout ('into') must be a QuantConfig record; "
                                 f"got {type(recorded).__name__}")
            quant = _decode_quant(recorded)
        from ..cache.serialize import load_cache
        from ..codec import CodecBasis, load_basis

        if codec is not None and not isinstance(codec, CodecBasis):
            codec = load_basis(codec)
        device = next(model.parameters()).device  # the cache's tensors go where the model is
        cache, extra = load_cache(path, model_config=model.config, device=device, codec=codec, quant=quant)
        return cls(model, tokenizer, cache, int(extra["context_tokens"]), question_suffix=extra.get("question_suffix"))
