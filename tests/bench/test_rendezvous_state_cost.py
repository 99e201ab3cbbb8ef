"""bench/rendezvous_state_cost.py: both arms really run torch's state holder on a real store,
and ours keeps the state it is given (a benchmark of a backend that lost the state would
measure nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from rendezvous_state_cost import MODES, backends, per_round_ms, per_sync_us, state_of

from elastic_trainer.supervisor import torch_compat


def test_each_arm_syncs_the_whole_state_through_the_store() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for name, make in backends(store, "t").items():
        for mode in MODES:
            assert per_sync_us(make, 16, 3, mode=mode) > 0, name
        stored, _ = make().get_state()
        import pickle

        state = pickle.loads(stored)
        expected = torch_compat.state_to_plain(state_of(16))
        assert torch_compat.state_to_plain(state)["participants"] == expected["participants"]
        assert per_round_ms(store, name, 1) > 0
