"""Every supervisor start draws its own ``supervisor_run`` token, a field of all its events."""

from __future__ import annotations

import re

from elastic_trainer.errors import ConfigError
from elastic_trainer.supervisor import run


def test_every_supervisor_start_draws_its_own_run_token(monkeypatch, tmp_path) -> None:
    seen: list[dict] = []
    monkeypatch.setattr(run, "configure_logging", lambda **kw: seen.append(kw["static_fields"]))

    def stop_after_logging(cfg: object) -> None:
        raise ConfigError("stop here: logging is configured")

    monkeypatch.setattr(run, "claim_store_port", stop_after_logging)
    script = tmp_path / "train.py"
    script.write_text("")
    assert run.main([str(script)]) == 2
    assert run.main([str(script)]) == 2
    tokens = [fields["supervisor_run"] for fields in seen]
    assert all(re.fullmatch(r"[0-9a-f]{16}", t) for t in tokens) and len(set(tokens)) == 2
