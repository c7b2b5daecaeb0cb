"""The verdict of `make learns`: did the run learn? PASS when held-out R@1 is at least FACTOR times its chance level
in both directions (image->text and text->image), FAIL otherwise; the figures on one line either way.

    python scripts/learns.py RUN_DIR [--factor 10]     # exit 0 on PASS, 1 on FAIL, 2 when RUN_DIR has no verdict

It reads RUN_DIR/result.json, which `vltrain run` writes at its end with the last held-out evaluation and its
chance levels (`eval.chance`: what a model that ranks at random scores on the same images and captions). Standard
library only.
"""

import argparse
import json
import sys
from pathlib import Path

DIRECTIONS = {"i2t_r1": "image->text", "t2i_r1": "text->image"}


def verdict(ev: dict, factor: float) -> tuple[bool, str]:
    """(passed, line) for one held-out evaluation: every direction's R@1 at least `factor` x its chance R@1. A set so
    small that factor x chance exceeds 100% cannot show learning: FAIL, saying so."""
    parts, passed = [], True
    for key, name in DIRECTIONS.items():
        r1, chance = float(ev[key]), float(ev["chance"][key])
        need = factor * chance
        passed &= r1 >= need and need <= 100.0
        parts.append(f"{name} R@1 {r1:.1f} (chance {chance:.1f}, needs {need:.1f})")
    line = f"{'PASS' if passed else 'FAIL'}: held-out {'; '.join(parts)} on {ev.get('n_val', '?')} images"
    if any(factor * float(ev["chance"][k]) > 100.0 for k in DIRECTIONS):
        line += f"; the held-out set is too small for {factor:g}x chance"
    return passed, line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the run's output folder (holds result.json)")
    ap.add_argument("--factor", type=float, default=10.0, help="R@1 must reach this multiple of chance (default 10)")
    args = ap.parse_args(argv)
    if not args.factor > 0:
        print(f"error: --factor must be > 0, not {args.factor:g}", file=sys.stderr)
        return 2
    result = args.run / "result.json"
    try:
        ev = json.loads(result.read_text())["eval"]
        if not isinstance(ev, dict) or not all(k in ev and k in ev.get("chance", {}) for k in DIRECTIONS):
            raise KeyError("eval")
    except FileNotFoundError:
        print(f"error: {result} not found (did the run finish?)", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError, TypeError):
        print(f"error: {result} holds no held-out evaluation with chance levels (run with a held-out split: "
              "data.val_frac > 0)", file=sys.stderr)
        return 2
    passed, line = verdict(ev, args.factor)
    print(f"make learns: {line}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
