"""``kvcache``: evaluate KV-cache compression settings against the full cache and against peers.

Subcommands
-----------
eval   run a grid of methods x tasks on a model and a text file; writes results.json,
       results.md and pareto.png into --out (finished samples are reused on restart)
demo   the README's main job: a small eval of SmolLM2-135M on wikitext-2 (a few minutes on
       2 CPU cores); prints the table and the path of the plot
bill   the byte bill of one captured KV cache under several quantization/selection settings
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

METHODS_HELP = """\
method specs (comma-separated, case-insensitive):
  full                           the uncompressed cache (always run, as the reference)
  q<bits>[g<G>][r<R>][s<S>]      kv_cache quantization: bits 2/3/4/8, group G (default 32),
                                 full-precision residual R (default 32), full-precision sinks S
  snapkv@B  h2o@B  streaming@B   kv_cache eviction keeping B: a fraction of the context (0.5)
                                 or a token count (512)
  h2o@0.5w32  snapkv@0.5w64      ... with the always-kept recent window: a count (w32) or a
                                 fraction of the budget (w0.5); default: h2o 0.5 (the H2O
                                 paper's even split), snapkv 32 (its observation window)
  q4+h2o@0.5                     both levers in one cache
  hf-quanto-int4  hf-quanto-int2 transformers QuantizedCache, quanto backend (pip install optimum-quanto)
  hf-hqq-int4 ...                transformers QuantizedCache, HQQ backend (pip install hqq)
  hf-fp8                         transformers QuantizedCache, fp8 e4m3 backend with a per-tensor
                                 scale (a line-for-line backport on transformers < its release)
  kvpress-<press>@K              kvpress at prefill keeping fraction K (pip install kvpress);
                                 press: snapkv, streamingllm, knorm, expectedattention, tova,
                                 observedattention
tasks: ppl (teacher-forced continuation perplexity), needle (=niah_single), multikey,
  multivalue, multiquery, vt, cwe, passkey
"""

DEMO_DEFAULTS = dict(
    model="smollm2", tasks="ppl,needle", methods="full,q8,q4,q2,snapkv@0.5,h2o@0.5,q4+h2o@0.5",
    samples=2, context=1024, continuation=128, out="runs/demo",
)


def _default_text() -> str:
    from .models import shared_data_dir

    return str(shared_data_dir() / "wikitext-2-raw" / "wiki.test.raw")


def _load_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"kvcache: config file {path!r} not found")
    if p.suffix == ".toml":
        import tomllib

        data = tomllib.loads(p.read_text())
    elif p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(p.read_text()) or {}
    else:
        raise SystemExit(f"kvcache: config file must end in .toml, .yaml or .yml; got {p.name!r}")
    if not isinstance(data, dict):
        raise SystemExit(f"kvcache: config file {path!r} must hold a mapping of option: value")
    return {k.replace("-", "_"): (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in data.items()}


def _eval_parser(sub, name: str, help_text: str, defaults: dict[str, Any]) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text, epilog=METHODS_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML or YAML file with any of these options (flags override it)")
    p.add_argument("--model", help="alias (smollm2, stories260K), local HF directory, .gguf file or hub id "
                                    f"[{defaults.get('model', 'smollm2')}]")
    p.add_argument("--text", help="haystack / perplexity text file [wikitext-2 test from ../shared/data]")
    p.add_argument("--tasks", help=f"comma-separated tasks [{defaults.get('tasks', 'ppl')}]")
    p.add_argument("--methods", help=f"comma-separated method specs [{defaults.get('methods', 'full,q4')}]")
    p.add_argument("--samples", type=int, help=f"samples per task [{defaults.get('samples', 8)}]")
    p.add_argument("--context", type=int, help=f"context length in tokens [{defaults.get('context', 2048)}]")
    p.add_argument("--continuation", type=int,
                   help=f"ppl: tokens scored after the compressed prefix [{defaults.get('continuation', 256)}]")
    p.add_argument("--query-aware", action="store_true", default=None,
                   help="retrieval: compress the question together with the context, so compression can see it")
    p.add_argument("--haystack", choices=["text", "noise"], help="retrieval haystack [text]")
    p.add_argument("--seed", type=int, help="task seed [0]")
    p.add_argument("--depths", help="retrieval: comma-separated needle depths in [0, 1], sample i uses "
                                    "depths[i %% len]; default: a seeded random depth per sample")
    p.add_argument("--max-new-tokens", type=int, help="retrieval answer length cap [32]")
    p.add_argument("--out", help=f"output directory [{defaults.get('out', 'runs/eval')}]")
    p.add_argument("--quiet", action="store_true", help="no progress bar; print only the table and paths")
    p.set_defaults(_defaults=defaults)
    return p


def _depths(value: Any) -> list[float] | None:
    """``"0.1,0.5"`` (or a config file's list, already joined) -> ``[0.1, 0.5]``; None stays None."""
    from .eval.tasks import check_depths

    if value is None:
        return None
    try:
        return check_depths([float(x) for x in str(value).split(",") if x.strip()])
    except ValueError:
        raise ValueError(f"--depths must be comma-separated numbers in [0, 1]; got {value!r}") from None


def _run_eval(args: argparse.Namespace) -> int:
    from .eval.report import write_reports
    from .eval.runner import EvalConfig, run_eval

    opts: dict[str, Any] = {"model": "smollm2", "tasks": "ppl", "methods": "full,q4", "samples": 8,
                            "context": 2048, "continuation": 256, "query_aware": False, "haystack": "text",
                            "seed": 0, "max_new_tokens": 32, "out": "runs/eval", "text": None, "depths": None}
    opts.update(args._defaults)
    if args.config:
        opts.update(_load_config_file(args.config))
    for k, v in vars(args).items():
        if not k.startswith("_") and k not in ("config", "quiet", "command") and v is not None:
            opts[k] = v
    unknown = set(opts) - {f for f in EvalConfig.__dataclass_fields__} - {"out"}
    if unknown:
        raise SystemExit(f"kvcache: unknown option(s) {sorted(unknown)}")
    cfg = EvalConfig(
        model=str(opts["model"]), text=str(opts["text"] or _default_text()),
        tasks=[t for t in str(opts["tasks"]).split(",") if t.strip()],
        methods=[m for m in str(opts["methods"]).split(",") if m.strip()],
        samples=int(opts["samples"]), context=int(opts["context"]), continuation=int(opts["continuation"]),
        query_aware=bool(opts["query_aware"]), haystack=str(opts["haystack"]), seed=int(opts["seed"]),
        max_new_tokens=int(opts["max_new_tokens"]), depths=_depths(opts["depths"]),
    )
    from .eval.methods import MethodUnavailable, parse_method
    from .eval.runner import resolve_task

    for spec in cfg.methods:  # fail fast on typos, before any model is loaded
        try:
            parse_method(spec)
        except MethodUnavailable:
            pass
    for task in cfg.tasks:
        resolve_task(task)
    bar = None
    progress = None
    if not args.quiet:
        from tqdm import tqdm

        n_methods = len({m.strip().lower() for m in cfg.methods} | {"full"})
        bar = tqdm(total=n_methods * len(cfg.tasks) * cfg.samples, unit="sample", dynamic_ncols=True)

        def progress(n: int, what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(n)
    try:
        doc = run_eval(cfg, opts["out"], progress=progress)
    finally:
        if bar is not None:
            bar.close()
    paths = write_reports(doc, opts["out"])
    print(paths["markdown"].read_text())
    for spec, why in doc.get("skipped", {}).items():
        print(f"skipped {spec}: {why}", file=sys.stderr)
    print(f"results: {paths['json']}\ntable:   {paths['markdown']}\nplot:    {paths['plot']}")
    return 0


def _run_bill(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from .bill import bill, format_bill
    from .models import load_model

    hf_logging.disable_progress_bar()
    model, tok = load_model(args.model)
    text = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
            "One day, she saw a big red ball near the tree. ") * 40
    ids = tok(text, return_tensors="pt").input_ids[:, : args.prompt_tokens]
    cfg = model.config
    print(f"model: {args.model}  layers={cfg.num_hidden_layers} kv_heads={cfg.num_key_value_heads} "
          f"prompt={ids.shape[1]} tokens; keys per-channel, values per-token, group 32, fp16 scales")
    print(format_bill(bill(model, ids)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvcache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    _eval_parser(sub, "eval", "evaluate compression methods on a model and tasks", {})
    _eval_parser(sub, "demo", "the README's main job: SmolLM2, wikitext-2, 7 configurations", DEMO_DEFAULTS)
    b = sub.add_parser("bill", help="byte bill of one captured KV cache")
    b.add_argument("--model", default="stories260K")
    b.add_argument("--prompt-tokens", type=int, default=256)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvcache`` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the CLI owns the terminal; library code never does this
        if args.command == "bill":
            return _run_bill(args)
        return _run_eval(args)
    except (ValueError, PermissionError, FileNotFoundError) as exc:
        print(f"kvcache: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
