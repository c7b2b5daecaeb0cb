"""README's code map (its "Architecture" section) names every module of vlprep and vltrain, and nothing else.

The map is the one a newcomer reads first, so a module added, renamed or removed without the map following fails
here. A top-level module is a line `  name.py  what it holds` in its package's block; a subpackage is a line
`  name/  ...` whose text names each of its modules (`grit.py`, ...), on that line or the lines continuing it.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vlprep", "vltrain")


def map_blocks(readme: str) -> dict[str, dict[str, str]]:
    """{package: {entry ('x.py' or 'd/'): its text, continuation lines included}} from the Architecture section."""
    section = readme.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    blocks = {}
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        current, entries = None, None
        for line in block.splitlines():
            top = re.match(r"(\w+)/\s", line + " ")
            if top:
                current = top.group(1)
                entries = blocks.setdefault(current, {}) if current in PACKAGES else None
                name = None
                continue
            entry = re.match(r"  (\S+)\s*(.*)", line)
            if entries is not None and entry:
                name = entry.group(1)
                entries[name] = entry.group(2)
            elif entries is not None and name and line.startswith("    "):
                entries[name] += " " + line.strip()
    return blocks


def modules_on_disk(package: str) -> dict[str, list[str]]:
    """{entry: [its modules]}: 'x.py' -> [] for a module, 'd/' -> ['a.py', ...] for a subpackage."""
    root = ROOT / package
    found = {p.name: [] for p in root.glob("*.py") if p.name != "__init__.py"}
    for sub in sorted(p for p in root.iterdir() if (p / "__init__.py").is_file()):
        found[sub.name + "/"] = sorted(p.name for p in sub.glob("*.py") if p.name != "__init__.py")
    return found


def test_readme_code_map_names_every_module_and_only_those():
    blocks = map_blocks((ROOT / "README.md").read_text())
    problems = []
    for package in PACKAGES:
        mapped = blocks.get(package, {})
        disk = modules_on_disk(package)
        problems += [f"{package}/{name} is not in README's code map" for name in disk if name not in mapped]
        problems += [f"README's code map names {package}/{name}, which does not exist" for name in mapped
                     if name not in disk]
        for sub, files in disk.items():
            if sub in mapped:
                problems += [f"README's code map entry {package}/{sub} does not name {f}" for f in files
                             if f not in mapped[sub]]
    assert not problems, "\n".join(problems)


def test_the_map_reader_sees_a_missing_module(tmp_path):
    readme = "## Architecture\n\n```\nvlprep/   data\n  cli.py   app\n  dataset.py  reader\n```\n## Next\n"
    assert map_blocks(readme) == {"vlprep": {"cli.py": "app", "dataset.py": "reader"}}
