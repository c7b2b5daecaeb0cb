"""The paths the CLIs take and write. Remote paths (s3://, gs://, http(s)://...) are refused until object storage
is supported, and an OSError on an output folder is one line (`writing`).

The check reads the raw argument: `Path("s3://b/x")` is the local folder `s3:/b/x`, so a Path is too late to tell."""

import functools
import inspect
import re
from contextlib import contextmanager
from pathlib import Path
from typing import get_args, get_type_hints

from vlprep import VlprepError, cut

# scheme:// with a scheme of 2+ characters: a Windows drive (C:/x, C:\x) is a local path
URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(value) -> bool:
    return isinstance(value, str) and URL.match(value) is not None


def check_local(value: str, what: str = "") -> str:
    """`value` unchanged, or a VlprepError when it is a URL; `what` names the argument ("--out", "shards")."""
    if is_url(value):
        raise VlprepError(f"{what + ' ' if what else ''}{cut(value)}: remote paths (s3://, gs://, http(s)://...) are "
                          "not supported yet; copy the data to a local path")
    return value


def local_path(value, what: str = "") -> Path:
    """A typer `parser=` for path arguments: a URL is one 'error:' line and exit status 2, before the command runs."""
    import typer
    from rich.console import Console

    try:
        return Path(check_local(value, what))
    except VlprepError as e:
        Console(stderr=True, emoji=False).print(f"error: {e}", style="bold red", highlight=False, markup=False,
                                                soft_wrap=True)
        raise typer.Exit(2) from None


def _holds_path(annotation) -> bool:
    return annotation is Path or any(_holds_path(a) for a in get_args(annotation))


def refuse_urls(app) -> None:
    """Give every Path argument and option of a typer app's commands the `local_path` parser (call after the last
    command is defined): no command can take a URL for a folder."""
    import typer

    for command in app.registered_commands:
        hints = get_type_hints(command.callback)
        for name, param in inspect.signature(command.callback).parameters.items():
            info = param.default
            if isinstance(info, typer.models.ParameterInfo) and _holds_path(hints.get(name)):
                option = isinstance(info, typer.models.OptionInfo)
                flag = next((d for d in info.param_decls or () if d.startswith("--")), "--" + name.replace("_", "-"))
                info.parser = functools.partial(local_path, what=flag if option else name.upper())


def _touches(filename, out: Path) -> bool:
    a, b = Path(filename).resolve(), Path(out).resolve()
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
