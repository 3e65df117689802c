"""One way to configure a sluicegate process, the gateway's and the workers' alike: a flag wins
over its environment variable, which wins over the `--config` TOML file, which wins over the
settings dataclass's default.

The settings dataclass is the schema: its fields are the TOML keys, their annotations the types
a file or a variable must give, and the argparse flag with the field's name as `dest` is the
setting's flag (`SLUICE_<FLAG>` its variable). A key the schema lacks, a value of the wrong type
or outside the flag's choices is a `ConfigError` naming it, so a typo in a file fails the start
instead of being ignored. Torch-free: the gateway validates its workers' settings with it.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

CONFIG_ENV = "SLUICE_CONFIG"
ENV_PREFIX = "SLUICE_"
T = TypeVar("T")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and where it came from."""


def setting(default: Any, doc: str) -> Any:
    """A settings field with its help text, for a setting that has no flag to carry one (the
    generated reference prints it, and a test fails on a setting with none). A table's field
    says the same with `field(default_factory=dict, metadata={"help": …})`."""
    return field(default=default, metadata={"help": doc})


@dataclass(frozen=True, slots=True)
class Setting:
    """One field of a settings dataclass, as the loader and the reference see it."""

    key: str  # the field's name and its TOML key
    env: str | None  # its environment variable; None for a table (TOML only)
    flag: str | None  # its command-line flag; None: environment and file only
    hint: Any  # its annotated type
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def kind(self) -> Any:
        """The type a given value must have: `int | None` → int, `list[str]` → list."""
        return _origin(self.hint)


def describe(cls: type, parser: argparse.ArgumentParser | None = None) -> list[Setting]:
    """The settings of dataclass `cls`, in field order, with the flag of `parser` whose `dest`
    is the field's name. A setting's variable is `SLUICE_` and its flag's name (its key's where
    it has no flag), so `--step-time-target` reads `SLUICE_STEP_TIME_TARGET`."""
    hints = typing.get_type_hints(cls)
    # NOTE: argparse has no public list of a parser's actions; `_actions` is stable since 3.2.
    actions = {a.dest: a for a in parser._actions if a.option_strings} if parser else {}
    found = []
    for f in fields(cls):
        action = actions.get(f.name)
        # NOTE: a boolean flag's `--no-` twin is its off switch, not its name
        names = [o for o in action.option_strings if not o.startswith("--no-")] if action else []
        flag = max(names, key=len) if names else None
        name = flag[2:] if flag else f.name
        table = _origin(hints[f.name]) is dict
        default = f.default_factory() if f.default is MISSING else f.default
        choices = tuple(action.choices) if action and action.choices else None
        found.append(
            Setting(
                key=f.name,
                env=None if table else ENV_PREFIX + name.upper().replace("-", "_"),
                flag=flag,
                hint=hints[f.name],
                default=default,
                help=f.metadata.get("help") or (action.help if action else "") or "",
                choices=choices,
            )
        )
    return found


def read_toml(path: str) -> dict[str, Any]:
    """The file's top-level table; a missing or broken file is a ConfigError naming it."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror}") from None


def config_file(flags: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[dict, str]:
    """The `--config` file's table (else `SLUICE_CONFIG`'s; else empty) and its name for
    messages."""
    path = flags.get("config") or environ.get(CONFIG_ENV)
    if not path:
        return {}, "config"
    return read_toml(path), path


def check_keys(table: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """ConfigError for the first key of `table` that is not in `known`, with the nearest known
    key as a suggestion."""
    known = list(known)
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")


def resolve(
    settings: list[Setting],
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    table: Mapping[str, Any],
    where: str,
) -> dict[str, Any]:
    """The value each setting was given, by precedence: its flag (None or [] when not given),
    its variable, its key in `table` (`where` names it in errors). Settings given nowhere are
    left out, so the dataclass's defaults apply."""
    table = {key.replace("-", "_"): value for key, value in table.items()}
    check_keys(table, [s.key for s in settings], where)
    values: dict[str, Any] = {}
    for s in settings:
        given = flags.get(s.key)
        if given is not None and given != []:
            values[s.key] = given
        elif s.env is not None and s.env in environ:
            values[s.key] = _checked(s, _from_env(s, environ[s.env]), s.env)
        elif s.key in table:
            values[s.key] = _checked(s, _from_toml(s, table[s.key], where), where)
    return values


def build(cls: Callable[..., T], values: Mapping[str, Any]) -> T:
    """`cls(**values)`, its own validation's ValueError turned into a ConfigError."""
    try:
        return cls(**values)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _origin(hint: Any) -> Any:
    """`int | None` → int, `list[str]` → list: the type a given value must have."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return typing.get_origin(hint) or hint


_KINDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list of strings",
    dict: "a table",
}


def _from_toml(s: Setting, value: Any, where: str) -> Any:
    kind = s.kind
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list) and all(isinstance(v, str) for v in value),
        dict: isinstance(value, dict),
    }.get(kind, True)
    if not ok:
        raise ConfigError(f"{where}: {s.key!r} must be {_KINDS[kind]}, not {value!r}")
    return float(value) if kind is float else value


def _from_env(s: Setting, text: str) -> Any:
    kind = s.kind
    if kind is list:
        return [v.strip() for v in text.split(",") if v.strip()]
    if kind is bool:
        if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ConfigError(f"{s.env}: {s.key} must be {_KINDS[bool]}, not {text!r}")
        return text.lower() in ("1", "true", "yes", "on")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{s.env}: {s.key} must be {_KINDS[kind]}, not {text!r}") from None
    return text


def _checked(s: Setting, value: Any, where: str) -> Any:
    if s.choices is not None and value not in s.choices:
        raise ConfigError(
            f"{where}: {s.key!r} must be one of {', '.join(s.choices)}, not {value!r}"
        )
    return value
