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
    try:
        code = run(argv)
    except SystemExit as e:  # a SIGTERM / SIGINT ends launch_server so (its cleanup done)
        if not isinstance(e.code, int | None):
            raise
        code = e.code or 0
    # Past this point the runtime's children are stopped and reaped and its sockets removed
    # (launch_server's cleanup). What is left is the interpreter's own teardown: freeing every
    # module and object torch and transformers made, seconds of CPU on a loaded machine, which
    # a caller waiting for this process to end (Runtime.shutdown, a supervisor's restart)
    # waits through. Join the threads, run the atexit handlers and flush as a normal exit
    # does, then leave.
    import atexit
    import logging
    import os
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
