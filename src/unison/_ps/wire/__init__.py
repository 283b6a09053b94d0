"""What travels between processes, imported by both sides: the typed protocol (request kinds,
one frozen header per kind, the table export codec, the version checked at the handshake),
tensor links over authenticated channels, the requester's client, and same-host shared memory."""

__all__: list[str] = []
