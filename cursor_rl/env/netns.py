"""A sandbox's network: a namespace with only loopback, plus forwarders for allowed endpoints.

The allow-list is enforced by what exists in the namespace, not by inspecting
commands: the namespace has a loopback interface and nothing else (no route, no
DNS server, no veth), so a sandboxed process can reach exactly the TCP endpoints
the harness placed in it.

Design choices:

1. **Forwarders instead of a veth and firewall rules.** For each allowed
   ``host:port`` the harness resolves the host up front, adds each of its addresses
   to the namespace's loopback and listens there (a socket created after ``setns``
   into the namespace); every accepted connection is relayed to the real address
   from the host's namespace. Inside, ``pypi.org:443`` answers at its usual address
   (TLS and SNI unchanged) while every other address or port has no route or no
   listener. Nothing on the host changes: no ``ip_forward``, NAT or iptables rules,
   no extra package.
2. **No DNS.** The sandbox's ``/etc/hosts`` (``hosts_file``) maps the allowed names to
   their addresses resolved up front and ``/etc/resolv.conf`` names no server, so
   names cannot be resolved, or data exfiltrated, through DNS.
3. **The sandboxed user cannot change any of it.** The namespace belongs to the
   initial user namespace and sandboxed processes run as an unprivileged uid without
   capabilities, so they cannot add addresses, routes or interfaces; a user
   namespace of their own would only give them another empty network.
4. **TCP only.** Allowed endpoints are package indexes and similar services; UDP,
   ICMP and raw sockets have nowhere to go.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import socket
import subprocess
import threading
from collections.abc import Sequence

NETNS_DIR = "/run/netns"  # where `ip netns` keeps its namespaces
_CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Splits ``host:port`` or ``[v6addr]:port``.

    Raises:
      ValueError: no port, or a port outside 1..65535.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"allow_hosts entry {endpoint!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def resolve_endpoints(allow_hosts: Sequence[str]) -> tuple[list[tuple[str, int]], dict[str, set]]:
    """Resolves the allow-list up front.

    Returns:
      ((address, port) pairs to forward, {host name: its addresses} for /etc/hosts).

    Raises:
      ValueError: a malformed entry or a host that does not resolve.
    """
    endpoints: set[tuple[str, int]] = set()
    names: dict[str, set] = {}
    for entry in allow_hosts:
        host, port = parse_endpoint(entry)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise ValueError(f"allow_hosts entry {entry!r} does not resolve: {e}") from e
        addresses = {info[4][0] for info in infos}
        endpoints |= {(a, port) for a in addresses}
        if not _is_address(host):
            names.setdefault(host, set()).update(addresses)
    return sorted(endpoints), names


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def hosts_file(names: dict[str, set]) -> str:
    """``/etc/hosts`` for a sandbox: loopback plus the allowed names (choice 2)."""
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    lines += [f"{addr} {name}" for name, addrs in sorted(names.items()) for addr in sorted(addrs)]
    return "\n".join(lines) + "\n"


def _ip(*args: str):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _relay(src: socket.socket, dst: socket.socket):
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class NetworkNamespace:
    """A named network namespace (``ip netns``) with forwarders for ``endpoints``.

    Args:
      name: the namespace name (unique per sandbox slot).
      endpoints: (address, port) pairs reachable from inside (``resolve_endpoints``).
    """

    def __init__(self, name: str, endpoints: Sequence[tuple[str, int]]):
        self.name = name
        self.path = os.path.join(NETNS_DIR, name)
        self._endpoints = list(endpoints)
        self._listeners: list[socket.socket] = []
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    @staticmethod
    def remove_stale(name: str) -> None:
        """Deletes namespace ``name`` if a crashed harness left it behind."""
        if os.path.exists(os.path.join(NETNS_DIR, name)):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)

    def open(self) -> NetworkNamespace:
        """Creates the namespace, brings loopback up and starts the forwarders."""
        _ip("netns", "add", self.name)
        try:
            _ip("-n", self.name, "link", "set", "lo", "up")
            for address, _ in self._endpoints:
                ip = ipaddress.ip_address(address)
                if not ip.is_loopback:  # 127/8 and ::1 are already on lo
                    _ip("-n", self.name, "addr", "add", f"{ip}/{ip.max_prefixlen}", "dev", "lo")
            self._listeners = self._listen_inside()
            for listener, endpoint in zip(self._listeners, self._endpoints):
                threading.Thread(
                    target=self._accept, args=(listener, endpoint), daemon=True
                ).start()
        except BaseException:
            self.close()
            raise
        return self

    def _listen_inside(self) -> list[socket.socket]:
        """Listening sockets bound inside the namespace (made by a thread that entered it)."""
        result: dict[str, object] = {}

        def enter_and_listen():
            # setns affects only this thread, which ends here; the sockets keep the namespace.
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    if _libc.setns(fd, _CLONE_NEWNET) != 0:
                        err = ctypes.get_errno()
                        raise OSError(err, f"setns into {self.path}: {os.strerror(err)}")
                finally:
                    os.close(fd)
                socks = []
                for address, port in self._endpoints:
                    family = socket.AF_INET6 if ":" in address else socket.AF_INET
                    s = socket.socket(family, socket.SOCK_STREAM)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((address, port))
                    s.listen(64)
                    socks.append(s)
                result["socks"] = socks
            except BaseException as e:  # surfaced in the calling thread
                result["error"] = e

        thread = threading.Thread(target=enter_and_listen)
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["socks"]

    def _accept(self, listener: socket.socket, endpoint: tuple[str, int]):
        while True:
            try:
                inside, _ = listener.accept()
            except OSError:  # listener closed
                return
            threading.Thread(target=self._forward, args=(inside, endpoint), daemon=True).start()

    def _forward(self, inside: socket.socket, endpoint: tuple[str, int]):
        try:
            outside = socket.create_connection(endpoint, timeout=10)
        except OSError:
            inside.close()
            return
        outside.settimeout(None)
        with self._lock:
            if self._closed:
                inside.close()
                outside.close()
                return
            self._conns |= {inside, outside}
        back = threading.Thread(target=_relay, args=(outside, inside), daemon=True)
        back.start()
        _relay(inside, outside)
        back.join()
        with self._lock:
            self._conns -= {inside, outside}
        inside.close()
        outside.close()

    def close(self) -> None:
        """Stops the forwarders, drops open connections and deletes the namespace."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in self._listeners + conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.remove_stale(self.name)
