"""The Markdown and plot reports of ``kvcache eval`` (kv_cache.eval.report)."""

from __future__ import annotations

import pytest

from kv_cache.eval.report import _plain_log_labels

pytest.importorskip("matplotlib", reason="the Pareto plot needs matplotlib")


def _tick_labels(lo: float, hi: float) -> tuple[list[str], list[str]]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xscale("log")
    _plain_log_labels(ax.xaxis)
    ax.set_xlim(lo, hi)
    fig.canvas.draw()

    def shown(ticks):  # the locator also places ticks just outside the view; they are not drawn
        return [t.label1.get_text() for t in ticks if lo <= t.get_loc() <= hi and t.label1.get_text()]

    return shown(ax.xaxis.get_major_ticks()), shown(ax.xaxis.get_minor_ticks())


def test_log_axis_labels_are_plain_numbers():
    major, minor = _tick_labels(7.0, 75.0)  # the span of the committed SmolLM2 ppl plot
    assert major == ["10"]
    assert minor == ["20", "30", "50"]


def test_log_axis_over_many_decades_labels_only_the_decades():
    major, minor = _tick_labels(0.004, 30.0)
    assert major == ["0.01", "0.1", "1", "10"]
    assert minor == []
