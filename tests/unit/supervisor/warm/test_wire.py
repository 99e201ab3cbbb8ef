"""The pool's end of its socket: a supervisor that is gone ends the pool, quietly."""

from __future__ import annotations

import socket

from elastic_trainer.supervisor.warm import wire


def test_a_peer_that_closed_with_our_message_unread_is_gone_not_an_error() -> None:
    """Regression: the pool's ready message unread (its supervisor ended on a bad flag while
    the pool imported) reset the socket, and the pool's traceback landed on the supervisor's
    stderr, glued to its one-line error."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        wire.send(ours, {"ready": True})
        theirs.close()
        assert wire.receive(ours) == (None, [])


def test_a_peer_that_closed_cleanly_is_gone() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        theirs.close()
        assert wire.receive(ours) == (None, [])
