"""What the calibration commands share (``calibrate``, ``calibrate-scorer``, ``calibrate-codec``,
``allocate``, ``plan``): the ``--model`` / ``--text`` / ``-o --out`` / ``--tokens`` arguments and
the reading of a calibration text. Calibration texts default to a Gutenberg novel of
``shared/data``, never the wikitext-2 test split the evaluation scores on."""

from __future__ import annotations

import argparse
from pathlib import Path

MODEL_HELP = "as `kvcache eval --model` (an alias or a path) [smollm2]"


def add_model(p: argparse.ArgumentParser) -> None:
    """``--model``: an alias or a path, SmolLM2 by default."""
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)


def add_calibration_args(p: argparse.ArgumentParser, *, default_text: str, out_help: str,
                         tokens: int | None = None) -> None:
    """``--model``, ``--text`` (one file; ``default_text`` under ``shared/data`` when none is
    given), a required ``-o/--out`` and, with ``tokens``, ``--tokens`` (how much of the text is used)."""
    add_model(p)
    p.add_argument("--text", default=None, help=f"calibration text file [shared/data/{default_text}]")
    p.add_argument("-o", "--out", required=True, help=out_help)
    if tokens is not None:
        p.add_argument("--tokens", type=int, default=tokens, help=f"tokens of the text to use [{tokens}]")


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Raise ``ValueError`` naming the option when any of ``names`` (attributes of ``args``) is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")


def read_text_file(path: str | Path) -> str:
    """A calibration text: UTF-8 (undecodable bytes replaced), Windows line ends made ``\\n``.

    Raises ``FileNotFoundError`` naming ``--text`` when ``path`` is not a file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--text: no file at {str(path)!r}")
    return path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")


def calibration_text(arg: str | None, default_text: str) -> tuple[Path, str]:
    """The file ``--text`` names (``shared/data/<default_text>`` when it names none) and its text."""
    from ..models import shared_data_dir

    path = Path(arg) if arg else shared_data_dir() / default_text
    return path, read_text_file(path)


__all__ = ["MODEL_HELP", "add_calibration_args", "add_model", "calibration_text", "read_text_file"]
