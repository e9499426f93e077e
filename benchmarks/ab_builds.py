"""Two builds of loom, one benchmark: the same command run in an old checkout and in this one,
alternating (the side that runs first swaps every round), and per figure the new / old ratio
of each round, their median and range.

Each side runs `python SCRIPT ARGS` from its own checkout's root, with a `sitecustomize` (in a
temp folder put first on PYTHONPATH, so the benchmark's subprocesses inherit it) whose
meta-path finder maps `loom` and its four folders (pyproject's package-dir) to that checkout,
ahead of whatever loom the venv has installed. Every figure is a regex with one group, searched
in the side's stdout (the first match); a figure missing from a run fails it.

    python benchmarks/ab_builds.py --old /tmp/old --rounds 3 \
        --figure 'json=bundled-json batch  1.*?in-process wall ([0-9.]+)' \
        -- benchmarks/bench_spec.py --rounds 1 --batches 1 --no-plot
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parents[1]

SITECUSTOMIZE = """\
import importlib.machinery
import importlib.util
import os
import sys

ROOT = {root!r}
FOLDERS = {folders!r}  # import name -> folder under ROOT


class _Finder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname not in FOLDERS:
            return None
        location = os.path.join(ROOT, FOLDERS[fullname])
        init = os.path.join(location, "__init__.py")
        if os.path.exists(init):
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[location]
            )
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)  # namespace
        spec.submodule_search_locations = [location]
        return spec


sys.meta_path.insert(0, _Finder)
"""


def side_env(root: Path, tmp: Path) -> dict[str, str]:
    folders = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    site = tmp / root.name.replace("/", "_")
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(root=str(root), folders=dict(folders))
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run(root: Path, env: dict, command: list[str], figures: dict[str, re.Pattern]) -> dict:
    check = "import loom.runtime.req as m, sys; sys.stdout.write(m.__file__)"
    where = subprocess.run(
        [sys.executable, "-c", check], cwd=root, env=env, capture_output=True, text=True
    ).stdout
    assert where.startswith(str(root)), f"{root}: loom imported from {where!r}"
    res = subprocess.run(
        [sys.executable, *command], cwd=root, env=env, capture_output=True, text=True
    )
    if res.returncode != 0:
        raise RuntimeError(f"{root}: {command} failed:\n{res.stderr[-3000:]}")
    out = {}
    for name, pattern in figures.items():
        m = pattern.search(res.stdout)
        if m is None:
            raise RuntimeError(f"{root}: figure {name!r} not in the output:\n{res.stdout[-3000:]}")
        out[name] = float(m.group(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--old", required=True, help="the old checkout's root (e.g. a git worktree)")
    ap.add_argument("--new", default=str(HERE), help="the new checkout's root (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--figure", action="append", required=True, help="NAME=REGEX, one group")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS (from each root)")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    figures = {}
    for spec in args.figure:
        name, _, regex = spec.partition("=")
        figures[name] = re.compile(regex, re.S)
    roots = {"old": Path(args.old).resolve(), "new": Path(args.new).resolve()}
    got: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {k: side_env(r, Path(tmp) / k) for k, r in roots.items()}
        for i in range(args.rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for side in order:
                t0 = time.monotonic()
                got[side].append(run(roots[side], envs[side], command, figures))
                print(
                    f"round {i + 1} {side}: {got[side][-1]} ({time.monotonic() - t0:.0f} s, "
                    f"loadavg {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    print(f"command: python {' '.join(command)}; old {roots['old']}, new {roots['new']}")
    for name in figures:
        ratios = [n[name] / o[name] for n, o in zip(got["new"], got["old"]) if o[name]]
        olds = [o[name] for o in got["old"]]
        news = [n[name] for n in got["new"]]
        spread = (
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
            if ratios
            else "n/a"
        )
        print(
            f"{name}: new/old {spread} over {len(ratios)} rounds | old {olds} | new {news} | "
            f"loadavg {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
