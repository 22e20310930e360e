"""``kvcache`` command line. Subcommands: ``demo`` (the README's main job)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``kvcache demo [...]``; unknown subcommands list the known ones."""
    from . import demo

    commands = {"demo": demo.main}
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print("usage: kvcache {" + ",".join(commands) + "} [options]\n  demo  print the compression bill of a real model's KV cache")
        return
    if args[0] not in commands:
        raise SystemExit(f"kvcache: unknown command {args[0]!r}; known commands: {sorted(commands)}")
    commands[args[0]](args[1:])


if __name__ == "__main__":
    main()
