"""Put the tables kept in pipelines/results/ into pipelines/README.md, so the README's tables are never edited by hand.

    .venv/bin/python pipelines/readme_tables.py          # write them in
    .venv/bin/python pipelines/readme_tables.py --check  # exit 1 when the README's tables differ from results/

The README marks each generated block with a pair of HTML comments, `<!-- begin NAME -->` and `<!-- end NAME -->`:
`results/RECIPE.md` (a recipe's table.md as `ablation.py --rescore results/RECIPE.json` writes it),
`results/mechanisms.md` (as `mechanisms.py --rescore results/mechanisms.json` writes it), `results/error-rates.md`
(as `error_rates.py --out results/error-rates.md` writes it) and `verdict counts`, the number of findings of each
verdict per results file, counted from its JSON. Everything outside the markers (the
readings under each table) is prose, kept by hand.
"""

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module pipelines/verdicts.py
import verdicts  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
ORDER = ("fistful", "grit", "fistful-pseudo", "tonics", "softmask", "combined", "clipscore", "mechanisms")
COUNTED = ("agrees", verdicts.SMALLER, verdicts.LARGER, "disagrees", "rules out the paper's effect",
           verdicts.EQUIVALENT, verdicts.NOT_EQUIVALENT, "inconclusive", verdicts.NAN_METRIC, verdicts.NO_VARIANCE)
SHORT = {verdicts.SMALLER: "agrees in direction, smaller", verdicts.LARGER: "agrees in direction, larger",
         verdicts.EQUIVALENT: "equivalent within the margin", verdicts.NO_VARIANCE: "no variance"}


def counts_table(results: dict[str, dict]) -> str:
    """Per results file: its seeds, the findings of each verdict (columns no file has are left out), its tests."""
    kinds = {name: [verdicts.kind(f["verdict"]) for f in r["findings"]] for name, r in results.items()}
    shown = [k for k in COUNTED if any(k in ks for ks in kinds.values())]
    head = ["results", "seeds"] + [SHORT.get(k, k) for k in shown] + ["tests (one Holm family)"]
    md = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, r in results.items():
        seeds = r.get("meta", {}).get("seeds") or r.get("seeds") or sorted({row["seed"] for row in r["rows"]})
        plan = r.get("meta", {}).get("seed_plan")
        seed_text = f"{len(seeds)}" + (" (plan not recorded)" if plan is None else f" ({plan['status']})")
        md.append(f"| `{name}` | {seed_text} | " + " | ".join(str(kinds[name].count(k)) for k in shown)
                  + f" | {verdicts.family_size(r['findings'])} |")
    return "\n".join(md) + "\n"


def blocks(results_dir: Path = RESULTS) -> dict[str, str]:
    """{marker name: the text between its markers}, from the results files."""
    out = {}
    loaded = {}
    others = sorted(p.stem for p in results_dir.glob("*.json") if p.stem not in ORDER)  # a new recipe's, after
    for name in (*ORDER, *others):
        md, js = results_dir / f"{name}.md", results_dir / f"{name}.json"
        if md.is_file() and js.is_file():
            out[f"results/{name}.md"] = md.read_text()
            loaded[name] = json.loads(js.read_text())
    out["verdict counts"] = counts_table(loaded)
    if (results_dir / "error-rates.md").is_file():  # pipelines/error_rates.py --out results/error-rates.md
        out["results/error-rates.md"] = (results_dir / "error-rates.md").read_text()
    return out


def splice(readme: str, generated: dict[str, str]) -> str:
    """The README with the text between each pair of markers replaced; a ValueError names a marker it lacks."""
    for name, text in generated.items():
        pattern = re.compile(rf"(<!-- begin {re.escape(name)} -->\n).*?(<!-- end {re.escape(name)} -->)", re.S)
        if not pattern.search(readme):
            raise ValueError(f"the README has no <!-- begin {name} --> ... <!-- end {name} --> block")
        readme = pattern.sub(lambda m: m.group(1) + "\n" + text + "\n" + m.group(2), readme, count=1)
    return readme


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare: exit 1 when the README's tables differ")
    args = ap.parse_args(argv)
    old = README.read_text()
    try:
        new = splice(old, blocks())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new != old:
            print("pipelines/README.md: its tables differ from pipelines/results/ "
                  "(run .venv/bin/python pipelines/readme_tables.py)", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    print(f"wrote the tables of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
