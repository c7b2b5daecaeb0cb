"""benchmarks/, pipelines/ and examples/ use vlprep and vltrain only through the public library API.

The public API is what docs/API.md lists: every backticked dotted name `vlprep.x.y` / `vltrain.x.y` in it. A script
that reaches for anything else (a private `_name`, a module's internals that no page documents) breaks silently the
day that internal changes, so it fails here instead. Imports are read with ast wherever they are (top level or inside
a function); `import vlprep.bow` followed by `vlprep.bow.name` counts `vlprep.bow.name`. Shell scripts are read for
the `from vl... import ...` lines of the Python they embed.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USERS = ("benchmarks", "pipelines", "examples")
PACKAGES = ("vlprep", "vltrain")


def public_names(api_doc: str) -> set[str]:
    """Every `vlprep...` / `vltrain...` dotted name in backticks in the API page (call parentheses dropped)."""
    return {m.group(1) for m in re.finditer(r"`((?:vlprep|vltrain)(?:\.\w+)*)(?:\([^`]*\))?`", api_doc)}


def _dotted(node) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def used_names(source: str) -> set[str]:
    """The project names a Python file imports: 'pkg.mod.name' for from-imports and for attributes it reads off an
    imported project module, 'pkg.mod' for a module imported and used only as a whole."""
    tree = ast.parse(source)
    found, aliases = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                found.add(f"{node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    bound = alias.asname or alias.name.split(".")[0]
                    aliases[bound] = alias.name if alias.asname else bound
    # attributes read off an imported module: the longest dotted chain that starts at an alias
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name and name.split(".")[0] in aliases:
                head, _, rest = name.partition(".")
                found.add(f"{aliases[head]}.{rest}")
    return found


def script_names(text: str) -> set[str]:
    """The from-imports of the Python a shell script embeds."""
    found = set()
    for m in re.finditer(r"from ((?:vlprep|vltrain)[\w.]*) import ([\w, ]+)", text):
        found |= {f"{m.group(1)}.{name.strip()}" for name in m.group(2).split(",") if name.strip()}
    return found


def user_files() -> list[Path]:
    return sorted(p for d in USERS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh") and p.is_file())


def covered(name: str, public: set[str]) -> bool:
    """Public: listed; or a module or class some listed name lies under; or an attribute or method of a listed
    class or function. Never a name with a private part."""
    if any(part.startswith("_") and not part.startswith("__") for part in name.split(".")):
        return False
    parts = name.split(".")
    listed_prefix = any(".".join(parts[:i]) in public for i in range(3, len(parts)))
    return name in public or listed_prefix or any(p.startswith(name + ".") for p in public)


def resolves(name: str) -> bool:
    """The name exists: its longest importable module prefix has the rest as attributes."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_scripts_use_only_the_documented_api():
    public = public_names((ROOT / "docs" / "API.md").read_text())
    problems = []
    for path in user_files():
        text = path.read_text()
        names = used_names(text) if path.suffix == ".py" else script_names(text)
        for name in sorted(names):
            if not covered(name, public):
                problems.append(f"{path.relative_to(ROOT)}: {name} is not in docs/API.md's public API")
            elif not resolves(name):
                problems.append(f"{path.relative_to(ROOT)}: {name} does not exist")
    assert not problems, f"{len(problems)} private uses:\n" + "\n".join(problems)


def test_the_reader_finds_from_imports_module_attributes_and_private_names():
    source = ("import vlprep.bow\nimport vltrain.train as vt\nfrom vltrain.config import load_config as lc\n"
              "def f():\n    from vlprep.dataset import _secret\n    return vlprep.bow.bow, vt.train, lc\n")
    names = used_names(source)
    assert {"vlprep.bow.bow", "vltrain.train.train", "vltrain.config.load_config", "vlprep.dataset._secret"} <= names
    public = {"vlprep.bow.bow", "vltrain.config.load_config", "vltrain.api.Model"}
    assert covered("vltrain.config.load_config", public)
    assert covered("vltrain.api.Model.encode_texts", public)
    assert not covered("vlprep.dataset._secret", public | {"vlprep.dataset._secret"})
    assert not covered("vltrain.train.train", public)
    assert resolves("vltrain.config.Config") and not resolves("vltrain.config.no_such_name")
    assert script_names("python -c 'from vltrain.data import data_signature, x'") == {
        "vltrain.data.data_signature", "vltrain.data.x"}


def test_every_name_the_api_page_lists_exists():
    missing = sorted(n for n in public_names((ROOT / "docs" / "API.md").read_text()) if not resolves(n))
    assert not missing, f"docs/API.md lists names that do not exist: {missing}"
