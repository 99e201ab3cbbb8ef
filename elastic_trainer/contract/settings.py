"""One declaration per setting: everything the command line, the environment, ``--help`` and
docs/command-line.md say about a setting comes from its ``Setting``.

A ``Setting`` is declared once, as the metadata of the dataclass field that carries the value
(``option(default, "--flag", ...)`` on ``RunConfig``, ``WorkerSettings`` or ``JobConfig``), or,
for a flag that is no single field (``--nnodes`` becomes two), in its command's tuple of
flag-only settings. From it come:

- the argparse option, in every spelling (``add_flags``), its help ending in the default;
- the environment: ``ELASTIC_TRAIN_<NAME>`` (read as the flag's default, so a flag wins), then
  torchrun's ``PET_<NAME>`` where it has one, then the default (``lookup``);
- the one check of one value (``parse``: text -> value, or ValueError saying what it
  expects; ``fix`` is the one line a bad value names). Cross-field checks stay in the
  dataclass's ``__post_init__``;
- the row of the flag table in docs/command-line.md (``doc_row``; a test compares them).

Adding a setting: one declaration here or on its dataclass, plus the code that uses it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Final, Literal

from elastic_trainer.errors import ConfigError

ENV_PREFIX = "ELASTIC_TRAIN_"
Kind = Literal["value", "switch", "toggle"]  # --x V · --x alone · --x / --no-x
VALUE: Final = "value"
SWITCH: Final = "switch"
TOGGLE: Final = "toggle"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


# --- parsers: text (a flag's value, a variable) -> a value, or ValueError naming what is wanted
def text(raw: str) -> str:
    if not raw.strip():
        raise ValueError("expected a non-empty value")
    return raw


def switch(raw: str) -> bool:
    """An on/off value: true/false, 1/0, yes/no, on/off."""
    low = raw.strip().lower()
    if low not in _TRUE + _FALSE:
        raise ValueError("expected true or false")
    return low in _TRUE


def positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise ValueError("expected an integer >= 1")
    return value


def non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("expected an integer >= 0")
    return value


def seconds(*, zero: bool) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw)
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            raise ValueError(f"expected a number of seconds {'>=' if zero else '>'} 0")
        return value

    return parse


def slowdown_factor(raw: str) -> float:
    """How many times slower than the others: a number above 1."""
    value = float(raw)
    if not (math.isfinite(value) and value > 1):
        raise ValueError("expected a slowdown factor > 1, e.g. 1.3 (30 % slower than the others)")
    return value


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return raw

    return parse


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One setting, declared once.

    ``flags``: every spelling (the first long one names the setting: ``--max-restarts`` ->
    ``max_restarts``, ``ELASTIC_TRAIN_MAX_RESTARTS``); none: the supervisor sets it itself.
    ``env_name``: our variable, where it is not ``ELASTIC_TRAIN_<NAME>`` or the setting has
    no flag; ``own_env=False``: no ``ELASTIC_TRAIN_*`` variable (torchrun's flags, the job's).
    ``pet``: torchrun's variable, read after ours. ``default``: the value when nothing is
    given; ``fallback``: a worker setting's value when neither the operator nor the script
    sets it (its ``default`` None is "the operator said nothing"); ``shown``: how ``--help``
    and the docs say the default where the value would not (None, or one chosen at run
    time). ``refused``: why a value other than ``accepted`` (torchrun's default) cannot be
    honoured, and what to use instead."""

    flags: tuple[str, ...] = ()
    help: str = ""
    default: Any = None
    fallback: Any = None
    shown: str | None = None
    parse: Callable[[str], Any] = str
    kind: Kind = VALUE
    env_name: str | None = None
    own_env: bool = True
    pet: str | None = None
    fix: str = ""
    metavar: str | None = None
    dest_name: str | None = None
    refused: str | None = None
    accepted: Any = None

    @property
    def flag(self) -> str | None:
        """The main spelling (None: not an operator's flag)."""
        return next((f for f in self.flags if f.startswith("--")), None)

    @property
    def dest(self) -> str:
        """The argparse destination: ``--max-restarts`` -> ``max_restarts``."""
        if self.dest_name is not None:
            return self.dest_name
        return (self.flag or "").removeprefix("--").replace("-", "_")

    @property
    def variable(self) -> str | None:
        """Our ``ELASTIC_TRAIN_*`` variable for it (None: none)."""
        if self.env_name is not None:
            return self.env_name
        return ENV_PREFIX + self.dest.upper() if self.flag and self.own_env else None

    @property
    def env(self) -> str | None:
        """The variable read first: ours, else torchrun's."""
        return self.variable or self.pet

    @property
    def variables(self) -> tuple[str, ...]:
        """Every variable read for it, in the order they count."""
        return tuple(v for v in (self.variable, self.pet) if v)

    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        value = self.default if self.default is not None else self.fallback
        if isinstance(value, bool) or self.kind != VALUE:
            return "on" if value else "off"
        if isinstance(value, float):
            return f"{value:g}"
        return "none" if value is None else str(value)

    def help_text(self) -> str:
        """``--help``'s line: what it does, then its default."""
        return f"{self.help} (default {self.default_text()})"

    def check(self, value: Any) -> str | None:
        """Why ``value`` (already typed) is not valid, or None: it must read back as itself."""
        try:
            read_back = self.parse(str(value))
        except ValueError as exc:
            return str(exc)
        return None if read_back == value else f"expected {type(read_back).__name__}"

    def read(self, raw: Any, source: str | None = None) -> Any:
        """``raw`` (text) parsed; ConfigError naming ``source`` (the flag), value and fix."""
        if not isinstance(raw, str):
            return raw  # already parsed by argparse
        try:
            return self.parse(raw)
        except ValueError as exc:
            name = source or self.flag or self.variable
            fix = self.fix or _PLAIN_FIX.get(self.parse) or str(exc)
            raise ConfigError(f"{name}={raw!r} is invalid: {fix}") from None

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        helptext = self.help_text().replace("%", "%%")  # argparse %-formats help
        if self.kind == TOGGLE:
            parser.add_argument(
                *self.flags, dest=self.dest, action=argparse.BooleanOptionalAction, help=helptext
            )
        elif self.kind == SWITCH:
            parser.add_argument(
                *self.flags, dest=self.dest, action="store_true", default=None, help=helptext
            )
        else:
            parser.add_argument(
                *self.flags,
                dest=self.dest,
                type=_arg_type(self),
                metavar=self.metavar,
                help=helptext,
            )

    def doc_row(self) -> tuple[str, str, str]:
        """(flag, env, default) cells of docs/command-line.md's flag table."""
        spellings = [f for f in self.flags if "_" not in f]
        first = f"{spellings[0]} {self.metavar}" if self.metavar else spellings[0]
        cells = [first, *spellings[1:]]
        if self.kind == TOGGLE:
            cells.append("--no-" + (self.flag or "").removeprefix("--"))
        env = ", ".join(f"`{v}`" for v in self.variables) or "–"
        flags = ", ".join(f"`{c}`" for c in cells)
        return flags.replace("|", "\\|"), env, self.default_text().replace("|", "\\|")


_PLAIN_FIX: dict[Any, str] = {int: "use an integer", float: "use a number"}


def _arg_type(how: Setting) -> Callable[[str], Any]:
    """argparse's ``type=``: plain int/float keep argparse's own message; ours say the fix."""
    if how.parse in (int, float, str):
        return how.parse

    def parse(raw: str) -> Any:
        try:
            return how.parse(raw)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid value {raw!r}: {how.fix or exc}") from None

    parse.__name__ = getattr(how.parse, "__name__", "value")
    return parse


def option(default: Any, *flags: str, **how: Any) -> Any:
    """A dataclass field whose ``Setting`` is declared with it (``setting_of`` reads it)."""
    return field(
        default=default, metadata={"setting": Setting(flags=flags, default=default, **how)}
    )


def setting_of(cls: type, name: str) -> Setting:
    """The ``Setting`` declared for field ``name`` of a settings dataclass."""
    return {f.name: f for f in fields(cls)}[name].metadata["setting"]


def declared(cls: type) -> dict[str, Setting]:
    """Field name -> ``Setting``, for every field of ``cls`` that declares one."""
    return {f.name: f.metadata["setting"] for f in fields(cls) if "setting" in f.metadata}


def flagged(cls: type) -> dict[str, Setting]:
    """The declared fields an operator sets with a flag."""
    return {name: how for name, how in declared(cls).items() if how.flag}


def add_flags(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    for how in settings:
        how.add_to(parser)


def env_defaults(settings: Iterable[Setting], env: Mapping[str, str]) -> dict[str, Any]:
    """Our ``ELASTIC_TRAIN_<NAME>`` variables, as parser defaults: argparse converts them like
    command-line values, and a flag still wins. A switch's variable reads true/false."""
    found: dict[str, Any] = {}
    for how in settings:
        raw = env.get(how.variable, "") if how.variable else ""
        if raw == "":
            continue
        found[how.dest] = _switch(how).read(raw, how.variable) if how.kind != VALUE else raw
    return found


def _switch(how: Setting) -> Setting:
    return Setting(flags=how.flags, parse=switch, fix="use true or false")


def lookup(ns: argparse.Namespace, env: Mapping[str, str], how: Setting) -> Any:
    """The flag's value (or our variable's, argparse's default), else torchrun's variable,
    else None: the caller's default."""
    given = getattr(ns, how.dest, None)
    if given is not None:
        return given
    raw = env.get(how.pet, "") if how.pet else ""
    return raw if raw != "" else None


def resolve(ns: argparse.Namespace, env: Mapping[str, str], how: Setting) -> Any:
    """``lookup`` parsed (a torchrun variable's text too), else the declared default."""
    raw = lookup(ns, env, how)
    if raw is None:
        return how.default
    if how.kind != VALUE:
        return _switch(how).read(raw, how.pet) if isinstance(raw, str) else raw
    return how.read(raw, how.flag)
