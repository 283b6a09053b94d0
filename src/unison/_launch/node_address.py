"""This node's address as other nodes see it, and the network interface that carries it.

A multi-node launcher must tell the other nodes where its tasks listen. Its hostname is
a poor guide (it often resolves to ``127.0.1.1``); the address the node itself uses to
reach the master is the one that is routable from there, found by connecting a UDP
socket toward the master (no packet is sent) and reading its local end.

gloo picks the interface it listens on from the hostname too, and falls back to
loopback when the hostname resolves to a loopback address: peers on other nodes are then
told ``127.0.0.1``. The launcher therefore sets ``GLOO_SOCKET_IFNAME`` (torch's own
setting) to the interface holding the node address, unless the user set it.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

__all__ = ["address_toward", "interface_of"]

_SIOCGIFADDR = 0x8915


def address_toward(host: str, port: int) -> str:
    """The local address this machine uses to reach ``host:port``.

    Raises:
        ValueError: if ``host`` cannot be resolved; name it and the fix.
    """
    try:
        family, _, _, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise ValueError(
            f"--master-addr {host!r} cannot be resolved ({e}); pass the master node's address or host name"
        ) from None
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(target)  # UDP: picks a route and a source address, sends nothing
        except OSError as e:
            raise ValueError(
                f"no route from this node to --master-addr {host!r} ({e}); check the address, or pass --node-addr"
            ) from None
        return str(sock.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (``"lo"``, ``"eth0"``), or None."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if ipaddress.ip_address(reply[20:24]) == wanted:
                return name
    return None
