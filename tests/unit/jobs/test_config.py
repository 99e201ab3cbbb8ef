"""Flags of the default job: names, defaults, and one-line errors for bad values."""

from __future__ import annotations

import pytest

from elastic_trainer.errors import ConfigError
from elastic_trainer.jobs.config import JobConfig, parse_args


def test_defaults_are_the_documented_recipe() -> None:
    cfg = parse_args([])
    assert (cfg.model, cfg.dataset, cfg.epochs, cfg.global_batch_size) == (
        "resnet18",
        "synthetic",
        4,
        48,
    )
    # the quick start (--min-nodes 1 --max-nodes 4) runs at any of 1-4 nodes: no preflight warning
    assert all(cfg.global_batch_size % nodes == 0 for nodes in range(1, 5))
    assert cfg.amp is False and cfg.num_workers == 0 and cfg.max_steps is None


def test_every_documented_flag_parses() -> None:
    argv = (
        "--model mobilenet_v3_small --dataset cifar10 --data-dir /d --download "
        "--train-samples 100 --val-samples 20 --global-batch-size 32 --epochs 3 --max-steps 7 "
        "--eval-every 2 --lr 0.05 --amp --seed 9 --sample-log /tmp/s --num-workers 1"
    )
    cfg = parse_args(argv.split())
    assert cfg == JobConfig(
        model="mobilenet_v3_small",
        dataset="cifar10",
        data_dir="/d",
        download=True,
        train_samples=100,
        val_samples=20,
        global_batch_size=32,
        epochs=3,
        max_steps=7,
        eval_every=2,
        lr=0.05,
        amp=True,
        seed=9,
        sample_log="/tmp/s",
        num_workers=1,
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--lr", "-0.1"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--global-batch-size", "0"], "--global-batch-size"),
        (["--epochs", "0"], "--epochs"),
        (["--train-samples", "0"], "--train-samples"),
        (["--val-samples", "-5"], "--val-samples"),
        (["--max-steps", "0"], "--max-steps"),
        (["--eval-every", "0"], "--eval-every"),
        (["--num-workers", "-1"], "--num-workers"),
        (["--warmup-epochs", "9"], "--warmup-epochs"),
        (["--dataset", "mnist"], "--dataset"),
        (["--dataset", "cifar10"], "--data-dir"),
        (["--epochs", "two"], "--epochs"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_values_are_one_line_config_errors(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert flag in message and "\n" not in message
    assert info.value.exit_code == 2


def test_an_abbreviated_flag_is_refused_naming_the_flag_it_may_mean() -> None:
    """Regression: argparse took --epoch=1 as --epochs silently (abbreviations), where the
    elastic-train command line refuses them and suggests the closest flag."""
    for argv in (["--epoch=1"], ["--epoch", "1"]):
        with pytest.raises(ConfigError, match="unknown option --epoch: did you mean --epochs"):
            parse_args(argv)
