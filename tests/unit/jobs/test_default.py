"""The default job's entry point: bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import pytest

from elastic_trainer.errors import ConfigError, DatasetError
from elastic_trainer.jobs.default import main, preflight


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--model", "resnet9000"], "list_models"),
        (["--dataset", "imagefolder", "--data-dir", "/no/such/dir"], "/no/such/dir"),
        (["--dataset", "cifar10", "--data-dir", "{tmp}"], "--download"),
        (["--lr", "-1"], "--lr"),
        (["--global-batch-size", "0"], "--global-batch-size"),
        (["--train-samples", "10", "--global-batch-size", "16"], "--global-batch-size 16"),
        (["--epochs", "x"], "--epochs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, words) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and words in err


def test_preflight_checks_without_training(tmp_path) -> None:
    assert preflight(["--train-samples", "32", "--global-batch-size", "16"], [1, 2]) == []
    with pytest.raises(ConfigError, match="resnet9000"):
        preflight(["--model", "resnet9000"])
    with pytest.raises(DatasetError):
        preflight(["--dataset", "imagefolder", "--data-dir", str(tmp_path)])


def _restored(*, restored_step, epoch_done, epoch, last_evaluated, step=12, epochs=4):
    from types import SimpleNamespace

    from elastic_trainer.jobs.config import JobConfig
    from elastic_trainer.jobs.default import _restored_before_evaluation
    from elastic_trainer.jobs.recipe import BestModels

    best = BestModels(last_evaluated_step=last_evaluated)
    session = SimpleNamespace(
        restored_step=restored_step,
        step=step,
        sampler=SimpleNamespace(epoch_done=epoch_done, epoch=epoch),
    )
    trainer = SimpleNamespace(best=best)
    return _restored_before_evaluation(trainer, session, JobConfig(epochs=epochs))


def test_a_snapshot_from_an_epochs_end_is_evaluated_after_the_restore() -> None:
    # saved on the epoch's last step, before its evaluation: evaluate first
    assert _restored(restored_step=12, epoch_done=True, epoch=1, last_evaluated=6)
    # already evaluated before the snapshot, restored mid-epoch, or a fresh start: do not
    assert not _restored(restored_step=12, epoch_done=True, epoch=1, last_evaluated=12)
    assert not _restored(restored_step=9, epoch_done=False, epoch=1, last_evaluated=6, step=9)
    assert not _restored(restored_step=None, epoch_done=False, epoch=0, last_evaluated=None)


def test_preflight_refuses_models_that_cannot_take_the_images() -> None:
    """vit_b_16 is a classification model: the name passes, the 32x32 input does not."""
    with pytest.raises(ConfigError, match="vit_b_16"):
        preflight(["--model", "vit_b_16"])


def test_preflight_checks_the_world_sizes_the_job_may_run_at() -> None:
    flags = ["--global-batch-size", "64"]
    with pytest.raises(ConfigError, match="not divisible by the world size 3"):
        preflight(flags, [3])  # --nproc-per-node 3: it cannot even start
    (warning,) = preflight(flags, [1, 2, 3, 4])  # may reach 3 later: said up front
    assert "world size 3" in warning
