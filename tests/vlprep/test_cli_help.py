"""Both CLIs' --help at 80 columns: flags without a `<bool>` type, usage lines that name the arguments in capitals,
and `vlprep filter`'s help text in a column wide enough to read (vlprep.cliargs.tidy_help)."""

import re

import pytest
from typer.testing import CliRunner

from vlprep.cli import app as vlprep_app
from vltrain.cli import app as vltrain_app

APPS = {"vlprep": vlprep_app, "vltrain": vltrain_app}
COMMANDS = [(tool, c.name or c.callback.__name__) for tool, app in APPS.items() for c in app.registered_commands]


def help_text(tool: str, *args: str) -> str:
    r = CliRunner().invoke(APPS[tool], [*args, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": None})
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("tool", APPS)
def test_top_level_help_has_flags_without_a_type(tool):
    out = help_text(tool)
    assert "<bool>" not in out and re.search(r"--version +Print the version", out) and "Usage: " in out


@pytest.mark.parametrize("tool,command", COMMANDS)
def test_command_help_shows_flags_and_argument_names(tool, command):
    out = help_text(tool, command)
    assert "<bool>" not in out, out
    usage = next(line for line in out.splitlines() if "Usage:" in line).split("Usage:", 1)[1].split()
    assert usage[1] == command and usage[2] == "[OPTIONS]", usage
    for piece in usage[3:]:  # DATASET, [SHARDS]..., CHECKPOINT: each a capitalised name, never typer's {dataset}
        assert re.fullmatch(r"\[?[A-Z][A-Z0-9_]*\]?(\.\.\.)?", piece), usage


def test_usage_of_view_and_flags_of_filter():
    assert re.search(r"Usage: root view \[OPTIONS\] DATASET\s*$", help_text("vlprep", "view"), re.M)
    out = help_text("vlprep", "filter")
    assert re.search(r"│ --overwrite +Replace", out) and "--no-overwrite" not in out
    # the help column starts before column 40 (it began at column 53 beside `--overwrite --no-overwrite <bool>`)
    keys = next(line for line in out.splitlines() if line.startswith("│ --keys "))
    overwrite = next(line for line in out.splitlines() if line.startswith("│ --overwrite "))
    assert keys.index("Rule 1") == overwrite.index("Replace") < 40, (keys, overwrite)


def test_flags_parse_as_before():
    """A flag given is True, left out False; `--no-FLAG` of a flag that is off by default is an unknown option."""
    r = CliRunner().invoke(vlprep_app, ["filter", "in", "out", "--no-overwrite"], env={"COLUMNS": "80"})
    assert r.exit_code == 2 and "No such option" in r.output
