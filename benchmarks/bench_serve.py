"""``kvcache serve`` under load: N concurrent clients x M questions about one 4K-token document.

Three ways to answer the same questions about the same document, each in a fresh
``kvcache serve`` process (SmolLM2-135M-Instruct, float32, CPU):

* ``re-prefill``: what a plain server does; every request carries the whole document in its
  message, so every question prefills the 4K tokens again;
* ``full``: the document is prefilled once (``POST /v1/contexts`` with ``method=full``) and every
  question starts from the stored, uncompressed cache (``context_id``);
* a compressed method (default ``q4+kvzip@0.3``): the same, from the compressed cache.

Each client asks its questions one after the other through the ``openai`` client, streaming
(time to first token = until the first content chunk; latency = until ``[DONE]``). Reported
per configuration: throughput (answers/s and generated tokens/s over the wall time of the whole
load), p50 / p95 TTFT and latency, the context's KV bytes and its one-time prefill seconds, and
the server's resident memory (Linux ``VmRSS`` after the load, ``VmHWM`` peak over the process's
life, model loading included). One warm-up question per configuration is not counted. Every
server runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``, as
``bench_generate.py``) so resident memory reflects live buffers. Greedy answers, ``max_tokens``
16 by default.

Run: ``python benchmarks/bench_serve.py [--clients 4] [--questions 2] [--context 4096]
[--method q4+kvzip@0.3] [--model smollm2] [--out benchmarks/results/]``

``--batching``: instead, N clients x M short chats without a stored context (each a one-line
story opening), on a server run one at a time (``--max-batch 1``) and on one that decodes
concurrent chats together (``--max-batch N``); reported as above, plus the ratio of answers/s.
Greedy answers of both runs are compared (they must be equal).

``--batching-contexts``: the same comparison for chats on stored contexts: each server stores
two short stories compressed with ``--batch-method`` (default ``q4``), and client ``i`` asks
story ``i % 2`` its M questions (story openings), so a batch holds chats on the same context
and on different ones. Both servers run in the same invocation, one after the other, on the
same contexts' documents; the ratios (answers/s, TTFT p50) are taken within that run.
``--rounds R`` alternates the two servers R times and reports each round's ratios and their
median: on a shared machine the load drifts between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

DOCUMENT = "gutenberg/pg1342.txt"  # Pride and Prejudice
QUESTIONS = [
    "Who is the author of this book?", "What is the name of the eldest Bennet daughter?",
    "Who rents Netherfield Park?", "How many daughters do Mr. and Mrs. Bennet have?",
    "What does Mrs. Bennet want for her daughters?", "Who is Mr. Darcy's friend?",
    "Where do the Bennets live?", "How does Elizabeth first judge Mr. Darcy?",
]
MMAP_THRESHOLD = 1 << 20
KEY = "bench"


def _status(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _document(model: str, tokens: int) -> str:
    from kv_cache.models import load_model, shared_data_dir

    _, tok = load_model(model)
    text = (shared_data_dir() / DOCUMENT).read_text(encoding="utf-8")
    start = text.find("Chapter 1")
    ids = tok(text[max(start, 0):], add_special_tokens=False).input_ids[:tokens]
    return tok.decode(ids)


OPENINGS = ["Once upon a time, there was a dog", "Lily went to the park", "The big red ball",
            "One day, a little girl named Sue saw a bird", "Tom was sad", "The sun was hot",
            "Ben and Mia found a box", "A cat sat on the mat"]


STORIES = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "red ball. One day, she saw a big dog near the tree. The dog was sad because he was lost. Lily gave the "
    "dog some water and a hug. Then she helped him find his home. The dog's mom was very happy. She said, "
    "\"Thank you, Lily!\" Lily smiled and ran back to the park to play with her ball.",
    "Tom had a big box of toys. He liked to build tall towers with his blocks. One day, his little sister "
    "Sue wanted to play too. Tom did not want to share. Sue was sad and started to cry. Mom came and said, "
    "\"Tom, sharing is nice.\" Tom looked at Sue and gave her a block. They built a tower together. It was "
    "the tallest tower ever, and they laughed and played all day.",
]


def run_config(name: str, method: str | None, doc: str, args: argparse.Namespace, store: Path,
               max_batch: int | None = None, stories: list[str] | None = None) -> dict:
    import httpx
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))}
    cmd = [sys.executable, "-m", "kv_cache.cli", "serve", "--model", args.model, "--store", str(store / name),
           "--port", str(port), "--api-key", KEY, "--request-timeout", "1200", "--log-level", "warning"]
    if max_batch is not None:
        cmd += ["--max-batch", str(max_batch), "--queue-size", str(max(16, 2 * args.clients))]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"{name}: the server exited: {server.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the server did not start in 300 s")
            time.sleep(0.3)
        row: dict = {"config": name, "method": method or "(document in every request)"}
        cid = None
        story_ids: list[str] = []
        for story in stories or []:  # --batching-contexts: one stored context per story
            r = httpx.post(base + "/v1/contexts", headers={"Authorization": f"Bearer {KEY}"}, timeout=1200,
                           json={"document": story, "method": method})
            r.raise_for_status()
            story_ids.append(r.json()["id"])
            row.setdefault("context_tokens", []).append(r.json()["tokens"])
        if method is not None and not stories:
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/contexts", headers={"Authorization": f"Bearer {KEY}"}, timeout=1200,
                           json={"document": doc, "method": method})
            r.raise_for_status()
            desc = r.json()
            cid = desc["id"]
            row.update(context_tokens=desc["tokens"], kv_bytes=desc["bytes"], fp16_bytes=desc["fp16_bytes"],
                       ratio=desc["ratio"], prefill_s=desc["prefill_seconds"],
                       compress_request_s=time.perf_counter() - t0)

        def ask(client, question: str, context: str | None = None) -> dict:
            context = context or cid
            content = question if context or not doc else f"{doc}\n\n{question}"
            t0 = time.perf_counter()
            first, tokens, text = None, 0, []
            stream = client.chat.completions.create(
                model=args.model, messages=[{"role": "user", "content": content}], temperature=0,
                max_tokens=args.max_tokens, stream=True, stream_options={"include_usage": True},
                extra_body={"context_id": context} if context else None)
            for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - t0
                    text.append(ch.choices[0].delta.content)
                if ch.usage is not None:
                    tokens = ch.usage.completion_tokens
                    prompt = ch.usage.prompt_tokens
            done = time.perf_counter() - t0
            return {"ttft": first if first is not None else done, "latency": done, "tokens": tokens,
                    "prompt_tokens": prompt, "answer": "".join(text), "question": question, "context": context}

        warm = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=1200)
        ask(warm, QUESTIONS[0], story_ids[0] if story_ids else None)
        results: list[dict] = []
        lock = threading.Lock()

        def client_loop(i: int) -> None:
            c = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=1200)
            pool = OPENINGS if not doc else QUESTIONS
            for k in range(args.questions):
                story = story_ids[i % len(story_ids)] if story_ids else None
                res = ask(c, pool[(i * args.questions + k) % len(pool)], story)
                with lock:
                    results.append(res)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        mem = _status(server.pid)
        ttft, lat = [r["ttft"] for r in results], [r["latency"] for r in results]
        row.update(answers=len(results), wall_s=wall, answers_per_s=len(results) / wall,
                   tokens_per_s=sum(r["tokens"] for r in results) / wall,
                   prompt_tokens=statistics.mean(r["prompt_tokens"] for r in results),
                   ttft_p50=_pct(ttft, 0.5), ttft_p95=_pct(ttft, 0.95), latency_p50=_pct(lat, 0.5),
                   latency_p95=_pct(lat, 0.95), rss_mib=mem.get("VmRSS"), peak_rss_mib=mem.get("VmHWM"),
                   sample_answer=results[0]["answer"],
                   answers_by_question=sorted({(story_ids.index(r["context"]) if r["context"] in story_ids else -1,
                                                r["question"], r["answer"]) for r in results}))
        return row
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        server.stderr.close()


def table(rows: list[dict], args: argparse.Namespace) -> str:
    head = ("| configuration | method | context KV bytes (vs fp16) | one-time prefill s | answers/s | tokens/s | "
            "TTFT p50 / p95 s | latency p50 / p95 s | RSS / peak MiB |")
    lines = [f"# kvcache serve: {args.clients} clients x {args.questions} questions, {args.model}, "
             f"{args.context}-token document ({DOCUMENT}), max_tokens {args.max_tokens}, greedy, streaming", "",
             head, "|" + "---|" * 9]
    for r in rows:
        kv = (f"{r['kv_bytes'] / 2**20:.1f} MiB ({r['ratio']:.2f}x smaller)" if "kv_bytes" in r else "none stored")
        pre = f"{r['prefill_s']:.2f}" if "prefill_s" in r else "every request"
        lines.append(f"| {r['config']} | `{r['method']}` | {kv} | {pre} | {r['answers_per_s']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | "
                     f"{r['latency_p50']:.2f} / {r['latency_p95']:.2f} | {r['rss_mib']:.0f} / "
                     f"{r['peak_rss_mib']:.0f} |")
    lines += ["", "Requests run one at a time on the server's single model worker; the clients queue. Ratios "
              "are against an fp16 cache of the same tokens (the model runs float32, so the full cache holds "
              "2x). Peak RSS includes loading the model and, for stored contexts, compressing the document."]
    return "\n".join(lines) + "\n"


def batching_table(rows: list[dict], args: argparse.Namespace) -> str:
    """The table of ``rows`` (one at a time, batched; per round), each round's ratios and their median."""
    pairs = [rows[i:i + 2] for i in range(0, len(rows), 2)]
    what = "chats without a stored context"
    if args.batching_contexts:
        what = (f"chats on stored contexts (2 stories of {' and '.join(map(str, rows[0]['context_tokens']))} tokens, "
                f"`{args.batch_method}`; client i asks story i % 2)")
    rounds = f", {len(pairs)} rounds (the two servers alternate)" if len(pairs) > 1 else ""
    lines = [f"# kvcache serve: batching, {args.clients} clients x {args.questions} {what}, "
             f"{args.model}, max_tokens {args.max_tokens}, greedy, streaming, OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'unset')}{rounds}", "",
             "| server | answers/s | tokens/s | TTFT p50 / p95 s | latency p50 / p95 s | peak RSS MiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['answers_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['ttft_p50']:.2f} / "
                     f"{r['ttft_p95']:.2f} | {r['latency_p50']:.2f} / {r['latency_p95']:.2f} | "
                     f"{r['peak_rss_mib']:.0f} |")
    lines.append("")
    speed, ttft = [], []
    for k, (one, many) in enumerate(pairs):
        same = one["answers_by_question"] == many["answers_by_question"]
        speed.append(many["answers_per_s"] / one["answers_per_s"])
        ttft.append(many["ttft_p50"] / one["ttft_p50"])
        head = f"round {k + 1}: " if len(pairs) > 1 else ""
        lines.append(f"{head}answers/s ratio (batched / one at a time): **{speed[-1]:.2f}x**; "
                     f"TTFT p50 ratio: {ttft[-1]:.2f}x; greedy answers identical: **{same}**.")
    if len(pairs) > 1:
        lines += ["", f"median over the rounds: answers/s ratio **{statistics.median(speed):.2f}x** "
                      f"(range {min(speed):.2f}-{max(speed):.2f}x), TTFT p50 ratio "
                      f"**{statistics.median(ttft):.2f}x** (range {min(ttft):.2f}-{max(ttft):.2f}x)."]
    return "\n".join(lines) + "\n"


def main_batching(args: argparse.Namespace) -> None:
    import tempfile

    rows = []
    method, stories = (args.batch_method, STORIES) if args.batching_contexts else (None, None)
    with tempfile.TemporaryDirectory() as store:
        for k in range(args.rounds):
            for name, mb in (("one at a time (--max-batch 1)", 1),
                             (f"batched (--max-batch {args.clients})", args.clients)):
                name = f"{name}, round {k + 1}" if args.rounds > 1 else name
                print(f"== {name} ...", flush=True)
                rows.append(run_config(name, method, "", args, Path(store), max_batch=mb, stories=stories))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = f"contexts_{args.batch_method.replace('+', '_').replace('@', '')}_" if args.batching_contexts else ""
    stem = f"bench_serve_batching_{kind}{args.model}_n{args.clients}_m{args.questions}_t{args.max_tokens}"
    stem += f"_r{args.rounds}" if args.rounds > 1 else ""
    (out / f"{stem}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    md = batching_table(rows, args)
    (out / f"{stem}.md").write_text(md)
    print(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--context", type=int, default=4096, help="document tokens [4096]")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--questions", type=int, default=2, help="questions per client [2]")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--method", default="q4+kvzip@0.3", help="the compressed configuration [q4+kvzip@0.3]")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--batching", action="store_true", help="compare --max-batch 1 and N on chats without a context")
    ap.add_argument("--batching-contexts", action="store_true",
                    help="compare --max-batch 1 and N on chats asking two stored contexts")
    ap.add_argument("--batch-method", default="q4", help="the stored contexts' method of --batching-contexts [q4]")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--batching*: alternate the two servers this many times; each round's ratios and their "
                         "median (a shared machine's load drifts between runs) [1]")
    args = ap.parse_args()
    if args.batching or args.batching_contexts:
        return main_batching(args)
    import tempfile

    doc = _document(args.model, args.context)
    rows = []
    with tempfile.TemporaryDirectory() as store:
        for name, method in (("re-prefill", None), ("full cache", "full"), ("compressed", args.method)):
            print(f"== {name} ...", flush=True)
            rows.append(run_config(name, method, doc, args, Path(store)))
            print(json.dumps(rows[-1], indent=1), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_serve_{args.model}_ctx{args.context}_n{args.clients}_m{args.questions}"
    (out / f"{stem}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    md = table(rows, args)
    (out / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
