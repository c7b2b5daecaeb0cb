"""Run several `vlprep` / `vltrain` commands one after another in this one Python process (run.sh's BATCH=1).

Usage: inprocess.py TOOL ARGS... [";" TOOL ARGS...]...   (TOOL: vlprep or vltrain; ";" is its own argument)

Each command is its console script's main() with those arguments, so it computes and writes what its own process
would. What is saved is the start-up each process pays before its work (Python, torch and transformers imports:
about 5 s of CPU per call) and the image encoder, which `vlprep features` keeps loaded from one call to the next.
On a demo of a few hundred images the start-up is most of a `vltrain eval`'s time. Each command is announced on
stderr as "$ TOOL ARGS"; the first that fails ends the batch with its exit status.
"""

import importlib
import shlex
import sys

TOOLS = {"vlprep": "vlprep.cli", "vltrain": "vltrain.cli"}


def commands(argv: list[str]) -> list[list[str]]:
    """['vltrain', 'eval', 'A', ';', 'vlprep', ...] -> [['vltrain', 'eval', 'A'], ['vlprep', ...]]."""
    out: list[list[str]] = [[]]
    for arg in argv:
        if arg == ";":
            out.append([])
        else:
            out[-1].append(arg)
    cmds = [c for c in out if c]
    bad = [c[0] for c in cmds if c[0] not in TOOLS]
    if not cmds or bad:
        sys.exit(f"usage: inprocess.py TOOL ARGS... [';' TOOL ARGS...]... with TOOL one of {', '.join(TOOLS)}"
                 + (f" (got {bad[0]!r})" if bad else ""))
    return cmds


def run(tool: str, args: list[str]) -> int:
    """`TOOL ARGS` as its main(): its exit status (typer exits 0 on success too)."""
    main = importlib.import_module(TOOLS[tool]).main
    argv, sys.argv = sys.argv, [tool, *args]
    try:
        main()
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # what `sys.exit("message")` prints before exiting 1
        return 1
    finally:
        sys.argv = argv
        sys.stdout.flush()
        sys.stderr.flush()


def main() -> int:
    for tool, *args in commands(sys.argv[1:]):
        print(f"$ {tool} {shlex.join(args)}", file=sys.stderr, flush=True)
        rc = run(tool, args)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
