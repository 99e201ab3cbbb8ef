"""argparse for our commands: a usage error is one ``ConfigError`` line, never a usage page.

Every command prints errors as ``elastic-train: error: <problem and fix>`` and exits 2; the
message here names the command's ``--help`` instead of repeating the program name.

Abbreviations are off: ``--max-node=4`` silently meaning ``--max-nodes`` hides typos, and an
abbreviation that stops being unique when a flag is added breaks scripts. An unknown option
is named with the closest real one instead.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

from elastic_trainer.errors import ConfigError

UNKNOWN_OPTION = "unknown option"


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see '{self.prog} --help')")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        ns, extras = self.parse_known_args(args, namespace)
        unknown = [x for x in extras if x.startswith("-") and x != "-"]
        if unknown:
            raise ConfigError(self.unknown_option(unknown[0]))
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def unknown_option(self, token: str) -> str:
        """One line naming ``token`` and, when one is close, the option meant."""
        name = token.split("=", 1)[0]
        known = [opt for action in self._actions for opt in action.option_strings]
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            return f"{UNKNOWN_OPTION} {name}: did you mean {close[0]}?"
        return f"{UNKNOWN_OPTION} {name} (see '{self.prog} --help')"
