"""The workers' process-group store, hosted by global rank 0 on the job's address only.

Each attempt's workers meet in a fresh c10d store at ``MASTER_ADDR:MASTER_PORT`` (the
supervisor sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a store shared across attempts let
a restarted rank read the dead rank 0's address). torch's ``init_process_group(env://)`` has
rank 0 host it, bound to every interface whatever ``MASTER_ADDR`` is: a loopback-only job
opened a port to the whole network. So before the script runs, rank 0's bootstrap binds the
port on ``MASTER_ADDR``'s own address, hands the socket to a ``TCPStore`` server
(``master_listen_fd``), and sets ``TORCHELASTIC_USE_AGENT_STORE=True`` in its own environment:
torch's ``_create_c10d_store`` then makes every rank a client of the store that serves at
exactly that ``MASTER_ADDR:MASTER_PORT`` (and a script's own ``TCPStore(is_master=True)``
there is forgiven its failed bind, as under torchrun's agent store). Unmodified scripts see
nothing else change.

The address is bound as the rendezvous store's is (``elastic_trainer.listeners``): every
interface only where ``MASTER_ADDR`` cannot be bound as given (a name this machine resolves
to loopback while the others reach it elsewhere, or an address that is not on this machine),
torch's own behaviour then, as before.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from elastic_trainer import listeners

ENV_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
LISTEN_BACKLOG = 512

_hosted: Any = None  # the server, alive as long as this worker


def host_for_rank0(environ: MutableMapping[str, str] = os.environ) -> Any:
    """Rank 0 of a launched group: the store, serving on MASTER_ADDR's address; else None."""
    global _hosted
    if environ.get("RANK") != "0" or environ.get(ENV_USE_AGENT_STORE) == str(True):
        return None
    addr, port_text = environ.get("MASTER_ADDR", ""), environ.get("MASTER_PORT", "")
    if not addr or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        return None  # not launched (a script run by hand): torch decides, as it would
    from torch.distributed import TCPStore

    port = int(port_text)
    try:
        listener = listeners.bound_listener(addr, port)
    except OSError:
        return None  # the port is taken or the name does not resolve: torch says so itself
    try:
        listener.listen(LISTEN_BACKLOG)
        store = TCPStore(
            addr,
            port,
            world_size=int(environ.get("WORLD_SIZE", "1") or 1),
            is_master=True,
            wait_for_workers=False,
            multi_tenant=True,
            master_listen_fd=listener.fileno(),
            use_libuv=True,
        )
    except BaseException:
        listener.close()  # torch did not take it
        raise
    listener.detach()  # the TCPStore owns the descriptor now
    environ[ENV_USE_AGENT_STORE] = str(True)
    _hosted = store
    return store
