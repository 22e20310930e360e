"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest

from kv_cache.models import load_model


@pytest.fixture(scope="session")
def stories():
    """stories260K and its tokenizer (sdpa, left padding, pad token set), loaded once.

    Shared by the whole session: tests must not change the model or the tokenizer. The
    ``compress`` context manager is fine, since it removes its hooks on exit.
    """
    return load_model("stories260K")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA device: skipped with the reason where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
