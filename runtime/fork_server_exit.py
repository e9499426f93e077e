"""Imported first by each of loom's fork servers (runtime/process.py `_fork_server`), nowhere
else: it makes the server leave without the interpreter's teardown.

A fork server stops when its owner closes its alive pipe: it raises SystemExit, and the
interpreter then frees every module its preload imported (torch, transformers: 0.7 s idle, up
to ~1.9 s on a loaded machine), while the owner waits on its pid (`ForkServer._stop`): every
Engine or server stop paid that. Registered before the preload imports anything, this exit
handler runs last (atexit is last in, first out), so the preload's own handlers still run;
then the process leaves. A child forked from the server never runs it: forkserver's child
path ends in os._exit."""

import atexit
import os
import sys


def _leave() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced: nothing to keep
            pass
    os._exit(0)


atexit.register(_leave)
