"""The test-side c10d client speaks torch's real store protocol (else the attacks that use it
would prove nothing)."""

from __future__ import annotations

from torch.distributed import TCPStore

from tests.c10d_wire import Client


def test_the_wire_client_reads_and_writes_a_real_store() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = Client("127.0.0.1", store.port)
    client.set("planted", b"by another user")
    assert bytes(store.get("planted")) == b"by another user"
    store.set("ours", b"value")
    assert client.get("ours") == b"value"
