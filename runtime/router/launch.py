"""`loom router [flags]`: parse RouterArgs and serve the router app with uvicorn."""

from __future__ import annotations

import argparse
import logging

from loom.runtime.router.args import RouterArgs


def parse_args(argv: list[str], prog: str = "loom router") -> RouterArgs:
    parser = argparse.ArgumentParser(
        prog=prog, description="Route native and OpenAI API requests over several loom servers"
    )
    RouterArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        return RouterArgs.from_cli_args(ns)
    except ValueError as e:
        parser.error(str(e))


def run(argv: list[str], prog: str = "loom router") -> int:
    args = parse_args(argv, prog)
    import uvicorn

    from loom.runtime.router.app import create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s router %(levelname)s %(message)s"
    )
    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(run(sys.argv[1:], prog="python -m loom.runtime.router.launch"))
