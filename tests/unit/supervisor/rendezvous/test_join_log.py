"""A round's join log: signed lines, each node once in the order it asked; whatever someone
else appended breaks only its own line; a log too long for a round is not read."""

from __future__ import annotations

import json

from elastic_trainer.contract import auth
from elastic_trainer.supervisor.rendezvous import join_log

KEY = auth.JobKey.generate()
LOG = join_log.log_key("job", 3)


def _log(*nodes: list) -> bytes:
    return b"".join(join_log.line(KEY, LOG, n) for n in nodes)


def test_nodes_come_back_once_each_in_the_order_they_asked() -> None:
    raw = _log(["b", 2, 0], ["a", 1, 0], ["b", 2, 0], ["a", 1, 1])
    assert join_log.parse(KEY, LOG, raw, max_nodes=4) == (
        [["b", 2, 0], ["a", 1, 0], ["a", 1, 1]],
        0,
    )


def test_lines_not_signed_for_this_log_are_refused_and_break_nothing_else() -> None:
    other_job = auth.JobKey.generate()
    forged = join_log.line(other_job, LOG, ["evil", 6, 6])
    other_round = join_log.line(KEY, join_log.log_key("job", 2), ["old", 5, 0])
    # bytes appended without a newline of their own run into the next line's leading one
    raw = _log(["a", 1, 0]) + b"junk-with-no-newline" + forged + other_round + _log(["b", 2, 0])
    nodes, refused = join_log.parse(KEY, LOG, raw, max_nodes=4)
    assert nodes == [["a", 1, 0], ["b", 2, 0]]
    assert refused == 3


def test_a_signed_line_that_is_not_a_node_entry_is_refused() -> None:
    def signed(payload: bytes) -> bytes:
        return b"\n" + auth.sign_value(KEY, LOG, payload) + b"\n"

    bad = [b"[1,2,3]", b'["a",-1,0]', b'["a\\n",1,0]', b'"a"', b"{", json.dumps(["a", 1]).encode()]
    nodes, refused = join_log.parse(KEY, LOG, b"".join(map(signed, bad)), max_nodes=8)
    assert (nodes, refused) == ([], len(bad))


def test_a_log_longer_than_a_round_could_hold_is_not_read() -> None:
    raw = _log(["a", 1, 0]) + b"x" * join_log.max_log_bytes(2)
    assert join_log.parse(KEY, LOG, raw, max_nodes=2) == ([], 1)
    # the longest line a node can write fits many times over
    longest = join_log.line(KEY, LOG, ["h" * 255, 2**63 - 1, 2**63 - 1])
    assert len(longest) <= join_log.MAX_LINE_BYTES
