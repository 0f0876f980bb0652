"""What a fault-tolerant replica group listens on, and who may read from it.

torchft's Manager opens two servers in rank 0 of each group: its manager server (gRPC: the quorum,
the commit votes) on every interface, and an HTTP checkpoint server, also on every interface, that
streams the whole model and optimizer state to a recovering peer without asking who it is. Here:

- both listen on the job's own address (``DTLAB_FT_HOST``: 127.0.0.1 for ``dtlab train`` on one
  node, the pod's IP in a Kubernetes job, the node's name in a Slurm job), not on every interface
  (:func:`bind_host`: a name that resolves to a loopback address here, as a Debian host's own name
  does, while its peers reach it by another, is the one case left on every interface);
- the checkpoint server answers only under a path that holds a secret of its own, made when it
  starts: the peers learn its address, secret included, from the quorum (torchft's checkpoint
  metadata), and a process outside the job that finds the port gets 403.

torchft 0.2's classes are reached where they are built (the manager server's ``bind`` is fixed in
``Manager.__init__``; the HTTP server's address in ``HTTPTransport.__init__``): :func:`bound_manager`
checks the version it was written for.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
from collections.abc import Iterator
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

TESTED_TORCHFT = ("0.2.",)  # the torchft releases whose internals this module reaches

__all__ = ["bind_host", "bound_manager", "bound_store", "checkpoint_transport", "new_secret"]


def new_secret() -> str:
    """A new secret for a checkpoint server's path (URL-safe)."""
    return secrets.token_urlsafe(24)


def bind_host(host: str) -> str | None:
    """The address to listen on for a job that names this machine ``host``: ``host`` itself when
    it is an address; a name's address here; None (every interface) for a name other than
    localhost that resolves to a loopback address here (its peers resolve it to another)."""
    import ipaddress

    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    try:
        address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return None
    if ipaddress.ip_address(address).is_loopback and host != "localhost":
        return None
    return str(address)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def checkpoint_transport(host: str, secret: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, listening on ``host`` only (:func:`bind_host`), serving
    only requests whose path starts with ``/<secret>/`` (others: 403), and telling its peers that
    address."""
    from torchft.checkpointing import http_transport

    bind = bind_host(host)

    class _Guarded(ThreadingHTTPServer):
        address_family = _family(bind) if bind is not None else socket.AF_INET6
        request_queue_size = 1024

        def __init__(self, address: Any, handler: Any) -> None:
            class _Checked(handler):  # type: ignore[misc, valid-type]
                def parse_request(self) -> bool:
                    if not super().parse_request():
                        return False
                    path = str(self.path)  # type: ignore[has-type]
                    head, _, rest = path.lstrip("/").partition("/")
                    if not hmac.compare_digest(head.encode(), secret.encode()):
                        self.send_error(403, "not this job's")
                        return False
                    self.path = "/" + rest  # torchft's own path: /checkpoint/STEP/KEY
                    return True

                def log_message(self, *args: Any) -> None:  # torchft's requests, not the log's
                    return None

            super().__init__((bind if bind is not None else "", address[1]), _Checked)

    class _Transport(http_transport.HTTPTransport):  # type: ignore[misc]
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            where = f"[{host}]" if ":" in host else host
            return f"http://{where}:{port}/{secret}/checkpoint/"

    with _swapped(http_transport, "_IPv6HTTPServer", _Guarded):
        return _Transport(timeout=timeout, num_chunks=0)


@contextlib.contextmanager
def bound_manager(host: str) -> Iterator[None]:
    """While torchft's Manager is built: its manager server listens on ``host`` (torchft binds it
    to every interface, ``[::]:PORT``). A RuntimeError on a torchft this was not written for."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    from torchft import manager

    try:
        version = installed("torchft")
    except PackageNotFoundError:
        version = ""
    if not version.startswith(TESTED_TORCHFT):
        raise RuntimeError(
            f"torchft {version or '(unknown version)'}: dtlab binds the manager server on the job's "
            f"address through torchft {', '.join(v + 'x' for v in TESTED_TORCHFT)}'s internals; "
            "install torchft==0.2.0"
        )
    real, bind = manager.ManagerServer, bind_host(host)

    def bound(*args: Any, **kwargs: Any) -> Any:
        if bind is not None:
            port = str(kwargs.get("bind", ":0")).rsplit(":", 1)[1]
            kwargs["bind"] = f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"
        return real(*args, **kwargs)

    with _swapped(manager, "ManagerServer", bound):
        yield


def bound_store(host: str) -> Any:
    """A TCPStore server that listens on ``host`` only (:func:`bind_host`; TCPStore itself binds
    every interface): its socket made here and handed over."""
    import torch.distributed as dist

    bind = bind_host(host)
    if bind is None:
        return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    sock = socket.socket(_family(bind))
    sock.bind((bind, 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return dist.TCPStore(
        host, port, is_master=True, multi_tenant=True, master_listen_fd=sock.detach()
    )


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)
