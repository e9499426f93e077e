"""`python -m loom.launch_server --model-path ...`: run the HTTP server (SGLang's entry point)."""

from __future__ import annotations

import argparse
import sys


def build_parser(prog: str = "python -m loom.launch_server") -> argparse.ArgumentParser:
    from loom.runtime.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=prog, description="Serve a model over SGLang's native API and the OpenAI API."
    )
    ServerArgs.add_cli_args(parser)
    return parser


def run(argv: list[str] | None = None, prog: str = "python -m loom.launch_server") -> int:
    from loom.runtime.server.launch import launch_server
    from loom.runtime.server_args import ServerArgs

    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))
    try:
        return launch_server(args)
    except (ValueError, RuntimeError) as e:  # start-up failures: say what, without a traceback
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
