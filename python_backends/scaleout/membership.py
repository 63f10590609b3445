"""Which remote encoder servers a ``pd`` server uses: discovery, admission, health (see
docs/scale-out.md).

Who calls what: :class:`RemoteEncoders` (``scaleout/remote.py``) calls
:meth:`Membership.refresh` every ``refresh_s`` on the ``epd`` event loop. A round re-reads the
endpoint source (``scaleout/endpoints.py``), admits newcomers, drops leavers and polls the
admitted ones' readiness; the router (``scaleout/routing.py``) is told the admitted addresses
and their readiness. At admission an encoder must answer the local content key for a probe
image: one with another checkpoint or preprocessing config, or a server without encoder models,
is refused (log line + counter) and checked again after ``refused_retry_s``; one not ready or
not reachable yet is tried again each round.
"""

from __future__ import annotations

import logging
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from python_backends import contract
from python_backends.runtime.grpc_streams import StreamEnds
from python_backends.scaleout import wire
from python_backends.scaleout.endpoints import EndpointSource
from python_backends.scaleout.routing import Router
from python_backends.scaleout.stats import ScaleoutStats
from python_backends.store import KeyConfig

log = logging.getLogger(__name__)


def probe_image(size: int = 56) -> bytes:
    """A small grey PNG (made here, no imaging library): every encoder must key it as we do."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes([(x * 4 + y * 2) % 256 for x in range(size)]) for y in range(size))
    header = struct.pack(">IIBBBBB", size, size, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


PROBE_IMAGE = probe_image()


class EncoderRefused(Exception):
    """An encoder server that must not be used (wrong role, checkpoint or preprocessing)."""


@dataclass
class EncoderServer:
    address: str
    client: Any  # tritonclient.grpc.aio.InferenceServerClient
    shares_store: bool  # same node and store path: it answers references into this server's store


class Membership:
    def __init__(
        self,
        source: EndpointSource,
        keys: KeyConfig,
        router: Router,
        stats: ScaleoutStats,
        *,
        node_id: str,
        store_path: str,
        refresh_s: float = 2.0,
        refused_retry_s: float = 30.0,
        connect: Callable[[str], Any] = wire.connect,
        ends: StreamEnds,
    ) -> None:
        self.source, self.keys, self.router, self.stats = source, keys, router, stats
        self.ends = ends  # the owner's streams still ending (wire.stream_one)
        self.node_id, self.store_path = node_id, store_path
        self.refresh_s, self.refused_retry_s = refresh_s, refused_retry_s
        self.connect = connect
        self.servers: dict[str, EncoderServer] = {}  # admitted, by address
        self.unreachable: dict[str, str] = {}  # address -> why it is not admitted yet (tried each refresh)
        self.refused_until: dict[str, float] = {}  # a refused address is checked again after refused_retry_s
        self.refused_why: dict[str, str] = {}

    async def admit(self, address: str) -> EncoderServer | None:
        """A checked server, or None while it is not ready; raises :class:`EncoderRefused`."""
        client = self.connect(address)
        try:
            if not await client.is_server_ready(client_timeout=2.0):
                await client.close()
                self.unreachable[address] = "not ready"
                return None
            config = await client.get_model_config(wire.ENCODER_MODEL, as_json=True, client_timeout=5.0)
        except Exception as exc:
            await client.close()
            if wire.status(exc) == "NOT_FOUND" or "unknown model" in str(exc):
                raise EncoderRefused(f"serves no {wire.ENCODER_MODEL}: not an encoder-role server ({exc})") from None
            if "is restricted" in str(exc):  # Triton's restricted protocol (builders/access.py)
                raise EncoderRefused(
                    f"it wants the encoder servers' key, which this server "
                    f"{'sends and it refused' if wire.peer_key() else 'was not given (--peer-key-file)'}"
                ) from None
            # Not reachable now (refused, no such host, timed out): tried again at the next refresh.
            self.unreachable[address] = f"not reachable ({' '.join(str(exc).split())[:200]})"
            return None
        parameters = {k: v.get("string_value", "") for k, v in config["config"].get("parameters", {}).items()}
        try:
            probe = [wire.image_input(PROBE_IMAGE)]
            answer = await wire.stream_one(client, wire.ENCODER_MODEL, probe, None, 60.0, self.ends)
        except Exception as exc:
            await client.close()
            raise EncoderRefused(f"could not encode the probe image: {exc}") from None
        theirs, ours = str(answer.as_numpy(contract.MM_HASH).reshape(-1)[0], "utf-8"), self.keys.key(PROBE_IMAGE)
        if theirs != ours:
            await client.close()
            raise EncoderRefused(
                f"keys the probe image as {theirs[:16]}..., this server as {ours[:16]}...: it serves another "
                "checkpoint, encoder build or preprocessing config"
            )
        same_node = parameters.get(contract.NODE_ID) == self.node_id
        shares = same_node and parameters.get(contract.STORE_PATH) == self.store_path
        return EncoderServer(address, client, shares)

    async def refresh(self) -> None:
        """One round: re-read the source, admit newcomers, drop leavers, poll readiness."""
        addresses = await self.source.current()
        self.stats.addresses_found = len(addresses)
        self.stats.lookup_failures += bool(self.source.problem)
        for address in [a for a in self.servers if a not in addresses]:
            await self.servers.pop(address).client.close()
        for address in [a for a in self.unreachable if a not in addresses]:
            del self.unreachable[address]
        for address in [a for a in self.refused_until if a not in addresses]:
            del self.refused_until[address]
            self.refused_why.pop(address, None)
        for address in addresses:
            server = self.servers.get(address)
            if server is not None:
                await self._poll(server)
                continue
            if time.monotonic() < self.refused_until.get(address, 0.0):
                continue  # refused a moment ago: not probed (nor logged) every round
            was = self.unreachable.pop(address, None)
            try:
                admitted = await self.admit(address)
            except EncoderRefused as exc:
                self.stats.refused[address] = self.stats.refused.get(address, 0) + 1
                self.refused_until[address] = time.monotonic() + self.refused_retry_s
                self.refused_why[address] = str(exc)
                log.error("encoder %s refused: %s (checked again in %g s)", address, exc, self.refused_retry_s)
                continue
            if admitted is None:
                if self.unreachable.get(address) != was:  # logged when the reason changes, not every round
                    log.warning("encoder %s %s; tried again every %g s", address, self.unreachable[address],
                                self.refresh_s)  # fmt: skip
                continue
            self.servers[address] = admitted
            where = "this node's store (by reference)" if admitted.shares_store else "another node (by value)"
            log.info("encoder %s admitted: %s", address, where)
        self.router.set_endpoints([a for a in addresses if a in self.servers])

    async def _poll(self, server: EncoderServer) -> None:
        try:
            ready = bool(await server.client.is_server_ready(client_timeout=2.0))
        except Exception as exc:
            ready = False
            if wire.status(exc) == "UNAVAILABLE":  # nothing listens there: counts like a failed call
                self.router.failed(server.address)
        self.router.set_ready(server.address, ready)

    def describe(self) -> str:
        """Every encoder's state for an error message: admitted ones (ready, breaker), addresses
        not admitted yet and why, and why the endpoint source found none."""
        parts = [self.router.describe()] if self.router.encoders else []
        parts += [f"{address}: {why}" for address, why in self.unreachable.items()]
        parts += [f"{address}: refused ({self.refused_why.get(address, 'another key config or not an encoder')})"
                  for address in self.refused_until]
        if self.source.problem:
            parts.append(self.source.problem)
        return "; ".join(parts) or self.router.describe()

    async def close(self) -> None:
        for server in self.servers.values():
            await server.client.close()
        self.servers.clear()
