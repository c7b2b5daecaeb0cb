"""The arguments both CLIs share: the paths they take and write, `--version` and the help's layout. A dataset folder
argument may be a URL (s3://, gs://, http(s)://, and file:// for a local path; vlprep.objstore reads and writes
them); every other path (a config, a checkpoint, weights, a run folder) stays local, and a URL there is one line. An
OSError on an output folder is one line (`writing`).

The check reads the raw argument: `Path("s3://b/x")` is the local folder `s3:/b/x`, so a Path is too late to tell."""

import functools
import inspect
import re
from contextlib import contextmanager
from pathlib import Path
from typing import get_args, get_type_hints

from vlprep import VlprepError, cut, objstore, urls, version_line

# scheme:// with a scheme of 2+ characters: a Windows drive (C:/x, C:\x) is a local path
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(value) -> bool:
    return isinstance(value, str) and URL.match(value) is not None


LOCAL_ONLY = "only dataset folders may be URLs (s3://, gs://, http(s)://); give a local path"


def check_local(value: str, what: str = "") -> str:
    """`value` unchanged, or a VlprepError when it is a URL; `what` names the argument ("--out", "shards")."""
    if is_url(value):
        raise VlprepError(f"{what + ' ' if what else ''}{cut(urls.redact(value))}: {LOCAL_ONLY}")
    return value


def check_dataset(value: str, what: str = "", out: bool = False) -> str | Path:
    """A dataset folder argument: a local Path, or a URL of a scheme we read (`out`: write) as a str in its
    canonical form (vlprep.urls: s3a:// is s3://); file:///path is that Path. One line for any other scheme, and
    for credentials in an s3:// or gs:// URL (never echoed)."""
    if not is_url(value):
        return Path(value)
    kind = objstore.scheme(value)
    if kind == "file":
        return Path(urls.file_url_path(value))
    shown = f"{what + ' ' if what else ''}{cut(urls.redact(value))}"
    if kind not in objstore.SCHEMES:
        raise VlprepError(f"{shown}: unsupported URL scheme {kind}://; use s3://, gs://, http(s):// or file://")
    if out and kind not in objstore.WRITABLE:
        raise VlprepError(f"{shown}: {kind}:// is read-only here; write to s3://, gs:// or a local folder")
    try:
        return objstore.norm(value)
    except VlprepError as e:
        raise VlprepError(f"{what + ' ' if what else ''}{e}") from None


def _one_line(check, value, what: str = "", **kw):
    """A typer `parser=`: `check`'s VlprepError is one 'error:' line and exit status 2, before the command runs."""
    import typer
    from rich.console import Console

    try:
        return check(value, what, **kw)
    except VlprepError as e:
        Console(stderr=True, emoji=False).print(f"error: {urls.redact_text(str(e))}", style="bold red", highlight=False,
                                                markup=False,
                                                soft_wrap=True)
        raise typer.Exit(2) from None


def local_path(value, what: str = "") -> Path:
    """A typer `parser=` for path arguments: a URL is one 'error:' line and exit status 2, before the command runs."""
    return Path(_one_line(check_local, value, what))


def _holds_path(annotation) -> bool:
    return annotation is Path or any(_holds_path(a) for a in get_args(annotation))


def refuse_urls(app, datasets: dict[str, tuple[str, ...]] | None = None) -> None:
    """Give every Path argument and option of a typer app's commands a parser (call after the last command is
    defined): `datasets` names, per command, the parameters that are dataset folders and so may be URLs (`out`
    among them: written); every other one refuses a URL in one line, never the folder ./s3:/..."""
    import typer

    for command in app.registered_commands:
        hints = get_type_hints(command.callback)
        allowed = (datasets or {}).get(command.name or command.callback.__name__, ())
        for name, param in inspect.signature(command.callback).parameters.items():
            info = param.default
            if isinstance(info, typer.models.ParameterInfo) and _holds_path(hints.get(name)):
                option = isinstance(info, typer.models.OptionInfo)
                flag = next((d for d in info.param_decls or () if d.startswith("--")), "--" + name.replace("_", "-"))
                what = flag if option else name.upper()
                if name in allowed:
                    info.parser = functools.partial(_one_line, check_dataset, what=what, out=name == "out")
                else:
                    info.parser = functools.partial(local_path, what=what)


def tidy_help(app) -> None:
    """Help that reads as a usage line should (call after the last command is defined, as refuse_urls): a bool flag
    shows `--flag` (off by default) or `--flag/--no-flag` (on by default) without typer's `<bool>` type beside it,
    and the usage line names the arguments in capitals, `vlprep view [OPTIONS] DATASET`, instead of typer's
    `{dataset}`. Without the `--no-flag` column of the flags that are off anyway, the help text keeps most of an
    80-column terminal (`vlprep filter --help` wrapped it into a column 26 wide). Parsing and errors are typer's."""
    import typer
    from typer.core import TyperCommand, TyperGroup

    class FlagHelp:
        def get_help_option(self, ctx):
            option = super().get_help_option(ctx)
            if option is not None:
                option.metavar = ""  # --help is a flag too
            return option

    class Group(FlagHelp, TyperGroup):
        pass

    class Command(FlagHelp, TyperCommand):
        def collect_usage_pieces(self, ctx) -> list[str]:
            pieces = [self.options_metavar] if self.options_metavar else []
            for param in self.get_params(ctx):
                if param.param_type_name == "argument":
                    name = param.metavar or param.name.upper()
                    pieces.append((name if param.required else f"[{name}]") + ("..." if param.nargs != 1 else ""))
            return pieces

    if isinstance(app.info.cls, typer.models.DefaultPlaceholder) or app.info.cls in (None, TyperGroup):
        app.info.cls = Group  # typer's default group; an app's own class is left alone
    for command in app.registered_commands:
        if command.cls in (None, TyperCommand):  # typer's default; a command's own class is left alone
            command.cls = Command
        hints = get_type_hints(command.callback)
        for name, param in inspect.signature(command.callback).parameters.items():
            info = param.default
            if isinstance(info, typer.models.OptionInfo) and hints.get(name) is bool:
                if info.metavar is None:
                    info.metavar = ""  # no type column: the flag says it all
                if info.default is False and not info.param_decls:  # off unless given: `--flag`, no `--no-flag`
                    info.param_decls = ("--" + name.replace("_", "-"),)


def _touches(filename, out: Path) -> bool:
    if is_url(str(out)):
        return False
    a = Path(filename).resolve()
    b = Path(out).resolve()
    return a.is_relative_to(b) or b.is_relative_to(a)


@contextmanager
def writing(out: Path, error: type[Exception] = VlprepError):
    """An OSError on OUT or a folder above it (a file in the way, read-only, disk full) is one line, raised as
    `error` (each CLI's own user-error class); others pass."""
    try:
        yield
    except OSError as e:
        if e.filename is None or not _touches(e.filename, out):
            raise
        raise error(f"cannot write {out}: {(e.strerror or type(e).__name__).lower()}") from None


def version_option(tool: str):
    """The eager `--version` option of a typer app's callback: prints `tool`'s version line and exits."""
    import typer

    def show(value: bool) -> None:
        if value:
            print(version_line(tool))
            raise typer.Exit()

    return typer.Option(False, "--version", callback=show, is_eager=True, metavar="",
                        help="Print the version (and torch's and transformers') and exit.")
