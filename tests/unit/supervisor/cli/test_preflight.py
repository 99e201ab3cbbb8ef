"""The generic entrypoint preflight: the supervisor runs a script's own checks, knowing no job."""

from __future__ import annotations

import textwrap

import pytest

from elastic_trainer.contract.config import Entrypoint
from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor.cli import preflight


def script(tmp_path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


CHECKS = """
    import argparse, sys

    def preflight(argv, world_sizes):
        parser = argparse.ArgumentParser()
        parser.add_argument("--batch", type=int, default=8)
        batch = parser.parse_args(argv).batch
        if batch % world_sizes[0]:
            raise ValueError(f"--batch {batch} does not split over {world_sizes[0]} workers")
        return [f"no split over {w}" for w in world_sizes[1:] if batch % w]

    if __name__ == "__main__":
        open(sys.argv[0] + ".trained", "w").close()  # training must not run in a preflight
"""


def test_a_script_without_preflight_is_not_run_at_all(tmp_path) -> None:
    path = script(tmp_path, "raise SystemExit('this must never run')\n")
    assert preflight.run(Entrypoint(script=path), [1]) == []


def test_warnings_come_back_and_training_never_starts(tmp_path) -> None:
    path = script(tmp_path, CHECKS)
    warnings = preflight.run(Entrypoint(script=path, args=("--batch", "6")), [2, 3, 4])
    assert warnings == ["no split over 4"]
    assert not (tmp_path / "train.py.trained").exists()


def test_a_refusal_is_one_config_error_line(tmp_path) -> None:
    path = script(tmp_path, CHECKS)
    with pytest.raises(ConfigError, match=r"^--batch 6 does not split over 4 workers$"):
        preflight.run(Entrypoint(script=path, args=("--batch", "6")), [4])


def test_an_argument_parser_exit_names_its_own_error(tmp_path) -> None:
    path = script(tmp_path, CHECKS)
    with pytest.raises(ConfigError, match="invalid int value: 'x'"):
        preflight.run(Entrypoint(script=path, args=("--batch", "x")), [1])


def test_the_builtin_job_is_checked_through_the_same_door() -> None:
    """A module entrypoint: found by its spec, refused with the job's own line (vit_b_16
    cannot take 32x32 images), and the supervisor never imported the job itself."""
    entry = Entrypoint(args=("--model", "vit_b_16"))
    with pytest.raises(ConfigError, match="vit_b_16"):
        preflight.run(entry, [1])
