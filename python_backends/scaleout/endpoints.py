"""Where a ``pd`` server's encoders are: ``HOST:PORT,...``, ``dns:NAME:PORT`` or ``file:PATH``.

Who calls what: membership (``scaleout/membership.py``) asks :meth:`EndpointSource.current`
every few seconds, admits what it finds and gives the admitted ones to the router. A DNS name is
resolved each time (a Kubernetes headless Service answers one A record per ready pod), a file is
read each time (one address per line or comma-separated, ``#`` comments), so encoders join and
leave without a restart. A lookup that fails answers no encoders (logged, and kept in
``problem`` for the error requests get), never an exception: the server keeps serving, and
requests get one clear UNAVAILABLE error until encoders are back. See docs/scale-out.md.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class EndpointSpecError(ValueError):
    """The endpoint list cannot be read as written; the message says the accepted forms."""


def parse_address(text: str) -> str:
    """``HOST:PORT`` checked (port 1-65535) and normalised."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointSpecError(f"encoder address {text.strip()!r} is not HOST:PORT with a port 1-65535")
    return f"{host}:{int(port)}"


def parse_addresses(text: str) -> list[str]:
    """Addresses separated by commas or lines, ``#`` comments and blanks ignored, in order, once."""
    items = [item for line in text.splitlines() for item in line.split("#", 1)[0].split(",")]
    return list(dict.fromkeys(parse_address(item) for item in items if item.strip()))


class EndpointSource(Protocol):
    @property
    def description(self) -> str: ...

    @property
    def problem(self) -> str:
        """Why the last lookup found no encoders ("" when it found some or cannot fail)."""
        ...

    async def current(self) -> list[str]:
        """The encoder addresses now (``HOST:PORT``)."""
        ...


@dataclass
class StaticEndpoints:
    addresses: list[str]
    problem: str = ""

    @property
    def description(self) -> str:
        return ",".join(self.addresses)

    async def current(self) -> list[str]:
        return list(self.addresses)


Resolver = Callable[..., Awaitable[list[tuple[Any, ...]]]]


@dataclass
class DnsEndpoints:
    name: str
    port: int
    resolve: Resolver | None = None  # default: the event loop's getaddrinfo
    problem: str = field(default="", compare=False)

    @property
    def description(self) -> str:
        return f"dns:{self.name}:{self.port}"

    async def current(self) -> list[str]:
        resolve = self.resolve or asyncio.get_running_loop().getaddrinfo
        try:
            answers = await resolve(self.name, self.port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            problem = f"{self.description} resolves to nothing ({exc})"
            if problem != self.problem:
                log.warning("encoders: %s", problem)
            self.problem = problem
            return []
        hosts = sorted({str(sockaddr[0]) for *_, sockaddr in answers})
        self.problem = "" if hosts else f"{self.description} resolves to no address"
        return [f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}" for host in hosts]


@dataclass
class FileEndpoints:
    path: Path
    problem: str = field(default="", compare=False)

    @property
    def description(self) -> str:
        return f"file:{self.path}"

    async def current(self) -> list[str]:
        try:
            addresses = parse_addresses(self.path.read_text())
        except (OSError, EndpointSpecError) as exc:
            problem = f"{self.description}: {exc}"
            if problem != self.problem:
                log.warning("encoders: %s", problem)
            self.problem = problem
            return []
        self.problem = "" if addresses else f"{self.description} lists no encoder"
        return addresses


def endpoint_source(spec: str) -> EndpointSource:
    """The source a ``--remote-encoders`` value names; a malformed one fails at load."""
    spec = spec.strip()
    if spec.startswith("dns:"):
        name, sep, port = spec[4:].rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise EndpointSpecError(f"{spec!r}: write dns:NAME:PORT (e.g. dns:triton-epd-encoder:8001)")
        return DnsEndpoints(name, int(port))
    if spec.startswith("file:"):
        if not spec[5:]:
            raise EndpointSpecError(f"{spec!r}: write file:PATH (one HOST:PORT per line)")
        return FileEndpoints(Path(spec[5:]))
    addresses = parse_addresses(spec)
    if not addresses:
        raise EndpointSpecError("no encoder addresses: write HOST:PORT,..., dns:NAME:PORT or file:PATH")
    return StaticEndpoints(addresses)
