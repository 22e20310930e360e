"""The eval / demo progress bar and warnings: a warning raised while the bar is drawn prints on a
line of its own above the bar (it used to land after the bar's text, cutting the bar mid-line),
and nothing is silenced. Model-free."""

from __future__ import annotations

import logging
import sys
import warnings

from kv_cache import FidelityWarning
from kv_cache.cli import main
from kv_cache.cli.progress import progress_bar

FORMAT = "%(levelname)s %(name)s: %(message)s"  # the CLI's (kvcache main)


def _emit(progress) -> None:
    progress(1, "full ppl")
    warnings.warn("layer 3's attention is wrecked (fidelity)", FidelityWarning, stacklevel=1)
    progress(1, "q8 ppl")
    logging.getLogger("kv_cache.eval.runner").warning("skipping peer: not installed")
    progress(0, "q8 ppl")


def _own_lines(err: str, *texts: str) -> None:
    """Each text is printed once, at the start of a screen line: after a newline or the bar's
    clearing carriage return, never after the bar's text."""
    for text in texts:
        assert err.count(text) == 1, err
        line = err[: err.index(text)].rsplit("\n", 1)[-1]
        shown = line.rsplit("\r", 1)[-1]  # what a terminal shows before the text on that line
        assert "sample" not in shown and "%|" not in shown, f"the warning is glued to the bar: {line!r}"


def test_warnings_print_above_the_bar_and_are_not_silenced(capsys):
    handler = logging.StreamHandler(sys.stderr)  # what basicConfig gives the CLI
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.root.addHandler(handler)
    shown_before = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with progress_bar(2) as progress:
                _emit(progress)
            assert warnings.showwarning is shown_before or warnings.showwarning.__module__ == "warnings"
    finally:
        logging.root.removeHandler(handler)
    assert logging.root.handlers.count(handler) == 0
    err = capsys.readouterr().err
    _own_lines(err, "FidelityWarning: layer 3's attention is wrecked (fidelity)",
               "WARNING kv_cache.eval.runner: skipping peer: not installed")
    assert "2/2" in err.rsplit("\r", 1)[-1]  # the bar is whole at the end


def test_the_eval_command_runs_its_bar_that_way(tmp_path, capsys, monkeypatch):
    import kv_cache.eval.report as report
    import kv_cache.eval.runner as runner

    def fake_run_eval(cfg, out, progress=None):
        assert progress is not None
        _emit(progress)
        return {"methods": {}}

    md = tmp_path / "results.md"
    md.write_text("| table |\n")
    monkeypatch.setattr(runner, "run_eval", fake_run_eval)
    monkeypatch.setattr(report, "write_reports", lambda doc, out: {"markdown": md, "json": tmp_path / "r.json",
                                                                   "plot": None, "plot_missing": "no plot"})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["eval", "--methods", "full,q8", "--tasks", "ppl", "--samples", "1",
                     "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    _own_lines(err, "FidelityWarning: layer 3's attention is wrecked (fidelity)",
               "skipping peer: not installed")  # no format: pytest's handlers keep basicConfig out
