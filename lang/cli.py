"""The `loom` command: `loom serve [flags]` (the flags are ServerArgs' fields, SGLang's names)
and `loom router --worker-urls URL ... [flags]` (loom.runtime.router)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="loom", description="loom command line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("serve", help="serve a model over HTTP (native and OpenAI APIs)", add_help=False)
    sub.add_parser("router", help="route requests over several loom servers", add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        sys.exit(0 if argv else 2)
    if argv[0] == "serve":
        from loom.launch_server import run

        sys.exit(run(argv[1:], prog="loom serve"))
    if argv[0] == "router":
        from loom.runtime.router.launch import run as run_router

        sys.exit(run_router(argv[1:], prog="loom router"))
    parser.error(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main()
