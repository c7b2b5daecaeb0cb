"""Building a run's config: a preset, then a YAML file, then `--set key=value`, then explicit CLI flags, each
applied over the last (typed, with unknown keys refused in one line); and a config saved in a checkpoint read back.
"""

import copy
import sys
from dataclasses import is_dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from vlprep import cut
from vlprep.userfile import FileTooLarge, NotARegularFile, read_regular
from vltrain.config import PRESETS, Config, ConfigError, shown, validate


def _valid_keys(obj) -> list[str]:
    return [f.name for f in fields(obj)]


def _coerce(value, typ, key: str):
    """Coerce a YAML-parsed value to a dataclass field's annotated type; a value of another type is a ConfigError."""
    origin = get_origin(typ)
    if origin is None and typ in (int, float, str, bool):
        if typ is bool and not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {shown(value)}")
        if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{key}: expected an integer, got {shown(value)}")
        if typ is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{key}: expected a number, got {shown(value)}")
        if typ is str and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise ConfigError(f"{key}: expected a string, got {shown(value)}")  # a bare 2024 is the string "2024"
        return typ(value)
    if origin is list:
        if isinstance(value, dict):
            raise ConfigError(f"{key}: expected a list, got {shown(value)}")
        if not isinstance(value, list):
            value = [value]
        (inner,) = get_args(typ) or (Any,)
        return [_coerce(v, inner, key) if inner is not Any else v for v in value]
    args = [a for a in get_args(typ) if a is not type(None)]
    if args and type(None) in get_args(typ):  # Optional[X]
        return None if value is None else _coerce(value, args[0], key)
    if args:  # X | Y: a value of one of them as it is
        if not any(isinstance(value, a) and not (a is not bool and isinstance(value, bool)) for a in args):
            raise ConfigError(f"{key}: expected {' or '.join(a.__name__ for a in args)}, got {shown(value)}")
        return value
    if isinstance(typ, type) and not isinstance(value, typ):
        raise ConfigError(f"{key}: expected a {'mapping' if typ is dict else typ.__name__}, got {shown(value)}")
    return value


# Keys that moved: old name -> new name. The old one still works (YAML, --set, checkpoints) with a note.
MOVED = {"data.masked_text_all": "loss.masked_text_all"}


def upgrade(overrides: dict[str, Any], note: bool = False) -> dict[str, Any]:
    """`overrides` (dotted or nested) with every MOVED key under its new name; `note` prints one line per key."""
    out = copy.deepcopy(overrides)
    for old, new in MOVED.items():
        section, key = old.split(".")
        nested = out.get(section)
        found = [(out, old)] if old in out else []
        found += [(nested, key)] if isinstance(nested, dict) and key in nested else []
        for holder, name in found:
            value = holder.pop(name)
            new_section, new_key = new.split(".")
            if isinstance(out.get(new_section), dict):
                out[new_section].setdefault(new_key, value)
            else:
                out.setdefault(new, value)
            if note:
                print(f"note: {old} is now {new}; the old key still works but is deprecated", file=sys.stderr)
    return out


def apply_overrides(cfg, overrides: dict[str, Any], where: str = "") -> None:
    """Set dotted keys ('model.embed_dim') or nested dicts on `cfg` in place; unknown keys raise ConfigError."""
    if not where:
        overrides = upgrade(overrides, note=True)
    for dotted, value in overrides.items():
        head, _, rest = str(dotted).partition(".")
        names = _valid_keys(cfg)
        if head not in names:
            full = cut(f"{where}.{head}" if where else str(head))
            raise ConfigError(f"unknown config key {full}; valid keys{' of ' + where if where else ''}: "
                              f"{', '.join(names)}")
        current = getattr(cfg, head)
        path = f"{where}.{head}" if where else head
        if is_dataclass(current):
            if rest:
                apply_overrides(current, {rest: value}, path)
            elif isinstance(value, dict):
                apply_overrides(current, value, path)
            else:
                raise ConfigError(f"{path} is a section; set one of its keys: {', '.join(_valid_keys(current))}")
            continue
        if rest:
            raise ConfigError(f"{path} is not a section; it has no key {shown(rest)}")
        hints = get_type_hints(type(cfg))
        setattr(cfg, head, _coerce(value, hints[head], path))


YAML_NODES = 10_000  # a config has about 80 keys: more values than this once aliases expand is an alias bomb


class _Budget(yaml.YAMLError):
    pass


def _expanded(node, sizes: dict) -> int:
    """How many nodes `node` stands for with every alias expanded (a shared node counts each time it is used);
    stops counting past YAML_NODES. A node that contains itself counts as too many."""
    if id(node) in sizes:
        if sizes[id(node)] is None:
            raise _Budget("a recursive alias")
        return sizes[id(node)]
    sizes[id(node)] = None
    children = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else (
        node.value if isinstance(node, yaml.SequenceNode) else [])
    n = 1
    for child in children:
        n += _expanded(child, sizes)
        if n > YAML_NODES:
            break
    sizes[id(node)] = n
    return n


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases expand past YAML_NODES nodes, before building anything."""

    def construct_document(self, node):
        if _expanded(node, {}) > YAML_NODES:
            raise _Budget(f"its aliases expand to more than {YAML_NODES:,} values")
        return super().construct_document(node)


def _load_yaml(text: str, where: str):
    """YAML text -> Python values, or a one-line ConfigError starting with `where`."""
    try:
        return yaml.load(text, Loader=_Loader)
    except _Budget as e:
        raise ConfigError(f"{where}: refused: {e} (an alias bomb?); write the values out") from None
    except RecursionError:
        raise ConfigError(f"{where}: refused: nested too deeply") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML ({cut(str(e).splitlines()[0], 120)})") from None


def parse_set(items: list[str]) -> dict[str, Any]:
    """['loss.itm=0', 'model.momentum=false'] -> {'loss.itm': 0, 'model.momentum': False} (values parsed as YAML)."""
    out = {}
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set expects key=value, got {shown(item)}")
        out[key.strip()] = _load_yaml(raw, f"--set {cut(key.strip())}") if raw.strip() else ""
    return out


def load_config(preset: str | None = None, config_file: str | Path | None = None, sets: list[str] | None = None,
                **explicit) -> Config:
    """Build the run config; `explicit` holds CLI flags the user actually gave (None values are ignored). The config
    records the keys the file, --set and the flags gave (user_set), so a derived default never overrides them."""
    cfg = Config()
    preset = preset or cfg.preset
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    cfg.preset = preset
    apply_overrides(cfg, PRESETS[preset])
    data = {}
    if config_file is not None:
        path = Path(config_file)
        data = _load_yaml(read_config_file(path), str(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys")
        if "preset" in data and data["preset"] != preset:
            raise ConfigError(f"{path} sets preset {shown(data['preset'])}; pass it with --preset instead")
        apply_overrides(cfg, data)
    sets = parse_set(sets or [])
    apply_overrides(cfg, sets)
    flags = {k: v for k, v in explicit.items() if v is not None}
    apply_overrides(cfg, flags)
    validate(cfg)
    given = set_keys(cfg, data) | set_keys(cfg, sets) | set_keys(cfg, flags)
    cfg.__dict__[USER_KEYS] = frozenset(given)  # not a field: no checkpoint or printed config holds it
    return cfg


USER_KEYS = "_user_keys"  # a loaded Config's record of the dotted keys the user gave (user_set)


def set_keys(cfg, overrides: dict[str, Any], where: str = "") -> set[str]:
    """The dotted keys ('data.max_len') that `overrides` (dotted or nested, as apply_overrides takes them) sets."""
    keys = set()
    for dotted, value in upgrade(overrides).items():
        head, _, rest = str(dotted).partition(".")
        path = f"{where}.{head}" if where else head
        current = getattr(cfg, head, None)
        if is_dataclass(current) and (rest or isinstance(value, dict)):
            keys |= set_keys(current, {rest: value} if rest else value, path)
        else:
            keys.add(path)
    return keys


def user_set(cfg, dotted: str) -> bool:
    """Whether the user chose `dotted` ('data.max_len'): load_config saw it in --config, --set or a flag, or its value
    is not its preset's (a Config built or changed in code). A preset's value is no user's choice: a value a run
    derives (a CLIP tower's context length) may replace it."""
    if dotted in cfg.__dict__.get(USER_KEYS, ()):
        return True
    preset = Config()
    apply_overrides(preset, PRESETS.get(cfg.preset, {}), "")
    section, _, key = dotted.rpartition(".")
    now = cfg
    for name in section.split(".") if section else ():
        now, preset = getattr(now, name), getattr(preset, name)
    return getattr(now, key) != getattr(preset, key)


CONFIG_BYTES = 1 << 20  # a config file is a few KB


def read_config_file(path: Path) -> str:
    """The text of a --config file; a missing file, a folder, a FIFO or device (never opened for a blocking read), an
    unreadable or oversized file is a ConfigError."""
    try:
        return read_regular(path, CONFIG_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except NotARegularFile as e:
        if e.kind == "a folder":
            raise ConfigError(f"--config {path} is a folder; give a YAML file") from None
        raise ConfigError(f"--config {path} is not a regular file ({e.kind}); give a YAML file") from None
    except FileTooLarge as e:
        raise ConfigError(f"--config {path}: {e.size:,} bytes; a config file is at most {CONFIG_BYTES:,}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror or type(e).__name__}") from None


def from_dict(data: dict) -> Config:
    """Rebuild a Config saved in a checkpoint (keys unknown to this version raise ConfigError)."""
    cfg = Config()
    apply_overrides(cfg, upgrade(data))
    return cfg

