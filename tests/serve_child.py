"""``kvcache serve`` in a child process that stops dead in the middle of a store write.

Used by tests/test_serve.py (kill during compression). ``python tests/serve_child.py PAUSE SKIP
MARKER -- <kvcache serve arguments>`` installs an audit hook (``sys.addaudithook``: it observes,
it changes nothing) and runs ``kvcache serve``. After ``SKIP`` context writes have gone through,
the next write stops at ``PAUSE``:

* ``open``: when the serializer opens its temporary file (``.tmp-<id>.kvc.tmp``); the hook
  leaves half a file there first, as a process killed in the middle of its write does;
* ``inner``: right before the serializer renames its finished file onto ``.tmp-<id>.kvc``;
* ``rename``: right before the store renames the finished ``.tmp-<id>.kvc`` onto ``<id>.kvc``.

It then creates ``MARKER`` and sleeps, waiting for the test's SIGKILL. With ``sleep-rename`` it
creates ``MARKER`` at the store's rename, sleeps 3 s (a write in progress when the test's SIGTERM
comes) and lets the write finish.
"""

import os
import sys
import time


def main() -> None:
    pause, skip, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rest = sys.argv[sys.argv.index("--") + 1:]
    seen = {"n": 0, "pausing": False}

    def hook(event, args):
        if seen["pausing"]:
            return
        if pause == "open" and event == "open" and args and isinstance(args[0], (str, os.PathLike)):
            name, mode = os.path.basename(os.fspath(args[0])), args[1] if len(args) > 1 else None
            hit = name.startswith(".tmp-ctx-") and name.endswith(".kvc.tmp") and isinstance(mode, str) and "w" in mode
        elif pause in ("inner", "rename", "sleep-rename") and event == "os.rename":
            dst = os.path.basename(os.fspath(args[1]))
            hit = dst.startswith(".tmp-ctx-") if pause == "inner" else dst.startswith("ctx-")
        else:
            return
        if hit:
            seen["n"] += 1
            if seen["n"] > skip:
                seen["pausing"] = True
                if pause == "open":
                    with open(args[0], "wb") as f:
                        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"__metadata__\"")  # a header cut short
                with open(marker, "w") as f:
                    f.write("paused\n")
                if pause == "sleep-rename":
                    time.sleep(3)
                    return
                time.sleep(600)

    sys.addaudithook(hook)
    from kv_cache.cli import main as kvcache

    sys.exit(kvcache(["serve", *rest]))


if __name__ == "__main__":
    main()
