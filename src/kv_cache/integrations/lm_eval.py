"""The ``kv_cache`` model of lm-evaluation-harness: any task, answered over a compressed cache.

``pip install 'kv_cache[lm-eval]'``, then::

    kvcache-lm-eval --model kv_cache --model_args pretrained=DIR,method=q4+kvzip@0.3 --tasks T

``kvcache-lm-eval`` is lm-eval's own command line (every option of ``lm_eval``) with this model
registered first: lm-eval 0.4.13 registers models only when their module is imported
(``lm_eval.api.registry.register_model``) and discovers no plugins or entry points, so a bare
``lm_eval --model kv_cache`` cannot find it. (The package also declares the entry point
``[project.entry-points."lm_eval.models"] kv_cache`` for releases that look there.) From
Python, pass the model itself: ``lm_eval.simple_evaluate(model=KVCacheLM(pretrained=...,
method=...), tasks=[...])``.

The model is lm-eval's :class:`~lm_eval.models.huggingface.HFLM` (same tokenization, truncation,
batching of requests, chat templates, post-processing of generations) with the forward passes
replaced, as ``kvcache eval`` runs them (:func:`kv_cache.eval.runner._prefill`):

* ``loglikelihood`` / ``loglikelihood_rolling``: for each ``(context, continuation)`` pair (for
  rolling, each window of the document), left-truncated to the model's length as HFLM does, the
  context is prefilled into a fresh cache of ``method`` and compressed (KVzip runs its
  reconstruction pass); the continuation is then read over the compressed cache (teacher
  forcing, absolute positions after the context), giving its log-probability and whether it is
  the greedy continuation;
* ``generate_until``: the prompt is prefilled and compressed the same way, then tokens are
  generated one at a time over the compressed cache (:func:`kv_cache.generation.generate_tokens`:
  greedy unless ``do_sample`` / ``temperature`` say otherwise) until an end-of-sequence token, a
  stop string or ``max_gen_toks``.

``method`` is a method spec of ``kvcache eval`` (``full``, ``q4``, ``q4d``, ``kvzip@0.3``,
``q4+kvzip@0.3``, ``snapkv@0.5``, peers such as ``hf-quanto-int4`` when installed). With
``method=full`` the cache is transformers' ``DynamicCache`` and the results equal ``--model hf``
(tested). A context longer than a method's prefill takes (KVzip's reconstruction pass needs
positions after the context) keeps its last tokens, with a warning.

``pretrained``: a model alias of :func:`kv_cache.models.load_model` (``stories260K``,
``smollm2``) or a ``.gguf`` file is loaded by kv_cache; anything else (a Hugging Face folder or
hub id) is loaded by HFLM exactly as ``--model hf`` loads it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from ..context import forward_at, max_context_tokens
from ..spec import parse_method
from ..eval.prefilled import prefill_method
from ..generation import SamplingParams, generate_tokens, stop_scan

log = logging.getLogger(__name__)

__all__ = ["GENERATION_KWARGS", "KVCacheLM", "cli_main"]

GENERATION_KWARGS = ("do_sample", "temperature", "top_p", "attention_mask")
"""Generation arguments of a task that this model honours (``until`` and ``max_gen_toks`` are
lm-eval's own); any other is refused."""


def _kv_cache_loads(pretrained: Any) -> bool:
    """True for what :func:`kv_cache.models.load_model` loads and HFLM does not: an alias or a GGUF file."""
    from ..models import MODEL_ALIASES

    if not isinstance(pretrained, str):
        return False
    p = Path(pretrained)
    return pretrained.lower() in {a.lower() for a in MODEL_ALIASES} or p.suffix == ".gguf" or (
        p.is_dir() and not (p / "config.json").exists() and any(p.glob("*.gguf")))


@register_model("kv_cache")
class KVCacheLM(HFLM):
    """lm-eval's HF model over a compressed KV cache (see the module docstring).

    Parameters
    ----------
    pretrained : str or transformers.PreTrainedModel
        A kv_cache alias (``stories260K``, ``smollm2``), a ``.gguf`` file, a Hugging Face folder or
        hub id, or a loaded model (then pass ``tokenizer`` too).
    method : str, default "full"
        A method spec of ``kvcache eval``.
    seed : int, default 1234
        Seed of sampled generations (greedy ones do not use it).
    dtype : str
        As HFLM's; a model kv_cache loads defaults to float32.
    **kwargs
        HFLM's other arguments (``device``, ``batch_size``, ``max_length``, ``tokenizer``, ...).
    """

    def __init__(self, pretrained: Any, method: str = "full", seed: int = 1234, **kwargs: Any) -> None:
        self.method = parse_method(str(method))  # unknown specs fail before the model loads
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int; got {seed!r}")
        self.seed = seed
        if _kv_cache_loads(pretrained):
            from ..models import load_model

            dtype = kwargs.pop("dtype", None)
            model, tok = load_model(pretrained, dtype="float32" if dtype in (None, "auto") else dtype)
            kwargs.setdefault("tokenizer", tok)
            device = kwargs.pop("device", None)
            if device not in (None, "cpu"):
                model = model.to(device)
            pretrained = model
        super().__init__(pretrained=pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"the kv_cache model runs decoder-only (causal) models; got backend {self.backend!r}")
        cache, _ = self.method.make(self.model)
        self._eviction = getattr(cache, "eviction", None)  # what limits the context (KVzip's pass)
        self._warned_cut = False

    # ------------------------------------------------------------------------------ helpers
    def _fit(self, ids: list[int]) -> list[int]:
        """``ids`` unchanged when a prefill of this method takes them, else their last tokens."""
        bos = self.tokenizer.bos_token_id
        first = 1 if len(ids) > 1 and bos is not None and ids[0] == bos else 0
        fits = max_context_tokens(self.model.config, self.tokenizer, self._eviction, first)
        if fits is None or len(ids) <= fits:
            return ids
        if not self._warned_cut:
            log.warning("a context of %d tokens is longer than %s's prefill takes (%d); its last tokens are kept",
                        len(ids), self.method.spec, fits)
            self._warned_cut = True
        return ids[-fits:]

    def _continuation_log_probs(self, context: list[int], continuation: list[int]) -> torch.Tensor:
        """Log-probabilities ``[len(continuation), vocab]`` (float32) of each continuation
        position, read over the compressed cache of ``context``."""
        ids = torch.tensor([context], dtype=torch.long, device=self.device)
        with torch.no_grad():
            pre = prefill_method(self.model, self.method, ids, self.tokenizer, last_only=True)
            try:
                logits = pre.logits[0, -1:].float()  # [1, vocab]: predicts continuation[0]
                if len(continuation) > 1:
                    rest = torch.tensor([continuation[:-1]], dtype=torch.long, device=self.device)
                    logits = torch.cat([logits, forward_at(self.model, pre.cache, rest, len(context))[0]], dim=0)
            finally:
                pre.scope.close()
        return F.log_softmax(logits, dim=-1)

    # ------------------------------------------------------------------------------ lm-eval's API
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None
                              ) -> list[tuple[float, bool]]:
        """``(log P(continuation | context), continuation is greedy)`` per ``(request, context
        ids, continuation ids)``; the context is compressed, then the continuation read over it."""
        out: list[tuple[float, bool]] = []
        for request_str, context, continuation in tqdm(requests, disable=disable_tqdm or self.rank != 0,
                                                       desc="kv_cache loglikelihood"):
            if not continuation or not context:
                raise ValueError(f"a loglikelihood request needs context and continuation tokens; got "
                                 f"{len(context)} and {len(continuation)}")
            if len(continuation) > self.max_length:
                raise ValueError(f"a continuation of {len(continuation)} tokens is longer than the model's "
                                 f"max_length ({self.max_length})")
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]  # as HFLM truncates
            ctx = self._fit(whole[:len(whole) - len(continuation)])
            lp = self._continuation_log_probs(ctx, list(continuation))
            target = torch.tensor(continuation, dtype=torch.long, device=lp.device)
            answer = (float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
            out.append(answer)
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return out

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
                        ) -> torch.Tensor:
        """Prompts ``context`` ``[batch, T]`` (left-padded, ``attention_mask`` in the kwargs) and
        their generations: ``[batch, T + new]``, right-padded with the end-of-text token."""
        unknown = sorted(set(generation_kwargs) - set(GENERATION_KWARGS))
        if unknown:
            raise ValueError(f"generation arguments {unknown} are not supported by the kv_cache model; "
                             f"supported: {list(GENERATION_KWARGS)} (plus lm-eval's until and max_gen_toks)")
        mask = generation_kwargs.get("attention_mask")
        temperature = float(generation_kwargs.get("temperature") or 0.0)
        do_sample = generation_kwargs.get("do_sample")
        sample = temperature > 0 if do_sample is None else bool(do_sample)
        params = SamplingParams(temperature if sample else 0.0, float(generation_kwargs.get("top_p") or 1.0),
                                self.seed)
        n_new = max_length - context.shape[1]
        eos = {self.eot_token_id}
        g = getattr(self.model.generation_config, "eos_token_id", None)
        eos.update(i for i in (g if isinstance(g, (list, tuple)) else [g]) if isinstance(i, int))
        rows = []
        for b in range(context.shape[0]):
            ids = context[b] if mask is None else context[b][mask[b].bool()]
            rows.append(context[b].tolist() + self._generate_row(ids.tolist(), n_new, stop, params, eos))
        width = max(len(r) for r in rows)
        return torch.tensor([r + [self.eot_token_id] * (width - len(r)) for r in rows], dtype=torch.long)

    def _generate_row(self, prompt: list[int], n_new: int, stop: list[str], params: SamplingParams,
                      eos: set[int]) -> list[int]:
        prompt = self._fit(prompt)
        out: list[int] = []
        if n_new < 1:
            return out
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        with torch.no_grad():
            pre = prefill_method(self.model, self.method, ids, self.tokenizer, last_only=True)
            gen = generate_tokens(self.model, pre.cache, pre.logits[0, -1], len(prompt), max_new_tokens=n_new,
                                  params=params, eos=eos)
            try:
                for token in gen:
                    out.append(token)
                    if stop and stop_scan(self.tok_decode(out), stop)[1]:
                        break
            finally:
                gen.close()
                pre.scope.close()
        return out


def cli_main() -> None:
    """``kvcache-lm-eval``: lm-eval's command line (``sys.argv``) with the ``kv_cache`` model
    registered (importing this module registered it)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    cli_main()
