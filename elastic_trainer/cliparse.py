"""argparse for our commands: a usage error is one ``ConfigError`` line, never a usage page.

Every command prints errors as ``elastic-train: error: <problem and fix>`` and exits 2; the
message here names the command's ``--help`` instead of repeating the program name.
"""

from __future__ import annotations

import argparse
from typing import NoReturn

from elastic_trainer.errors import ConfigError


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see '{self.prog} --help')")
