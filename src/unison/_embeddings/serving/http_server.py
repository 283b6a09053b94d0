"""``unison serve-embeddings``: a :class:`ServingFollower`'s tables answered over HTTP, polled in the background.

A serving process for clients in any language: one thread polls the snapshot directory
every few seconds (the follower applies each new snapshot in place, lookups going on),
and a stdlib ``ThreadingHTTPServer`` answers, with JSON in and out:

- ``GET /status``: the snapshot served (number, kind, chain, lag) and each table's rows and dim.
- ``POST /lookup`` ``{"table": NAME, "ids": [int, ...]}``: ``{"rows": [[float, ...], ...]}``,
  each id's row as stored (float32 values are exact in JSON's doubles; never pooled,
  whatever the table's ``mode``); an id without a row reads ``default`` (0.0) in every column.

Errors are ``{"error": "..."}`` with 400 (the request), 404 (the path), 413 (a body over
16 MiB), 503 (no snapshot served yet) or 500 (a bug). A poll that fails (a damaged
snapshot, a gap in a chain) changes nothing: it is logged and the last good snapshot
stays served.

Like the follower, this module imports no training code (no strategy, no parameter
server, no ``DynamicEmbedding``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, final

import torch

from unison._embeddings.serving.follower import ServingFollower, ServingSnapshot

__all__ = ["EmbeddingServer"]

MAX_BODY_BYTES = 16 * 2**20
"""The largest ``/lookup`` body read (about a million ids): a request is held in memory whole."""
_INT64 = (-(2**63), 2**63 - 1)


class _RequestError(Exception):
    """A request answered with ``status`` and ``{"error": message}``."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _print_line(line: str) -> None:
    print(line, flush=True)


@final
class EmbeddingServer:
    """Serves the newest snapshot under ``root`` over HTTP, polling for new ones every ``poll_seconds``.

    Example::

        server = EmbeddingServer("snapshots/", poll_seconds=1.0, port=8080).start()
        # POST {"table": "users", "ids": [3, 17]} to server.url + "/lookup"
        server.stop()

    Args:
        root: the directory a ``ServingExporter`` writes.
        poll_seconds: seconds between the end of one poll and the start of the next.
        host: the address to listen on (``"0.0.0.0"``: every interface).
        port: the port (0: a free one; ``address`` says which).
        log: where a line per snapshot applied and per failed poll goes (default: stdout).

    Raises:
        TypeError: ``poll_seconds`` is not a number.
        ValueError: ``poll_seconds`` is not positive and finite.
        OSError: the address cannot be bound (the port is taken, or the host is not this machine's).
    """

    def __init__(self, root: str | os.PathLike[str], poll_seconds: float = 1.0, host: str = "127.0.0.1",
                 port: int = 0, *, log: Callable[[str], None] = _print_line) -> None:
        if isinstance(poll_seconds, bool) or not isinstance(poll_seconds, (int, float)):
            raise TypeError(f"EmbeddingServer: `poll_seconds` must be a number of seconds, got {poll_seconds!r}; "
                            f"fix: e.g. poll_seconds=1.0")
        if not 0 < poll_seconds < math.inf:
            raise ValueError(f"EmbeddingServer: `poll_seconds` must be a positive, finite number of seconds, got "
                             f"{poll_seconds!r}; fix: e.g. poll_seconds=1.0")
        self.follower = ServingFollower(root)
        self.poll_seconds = float(poll_seconds)
        self._log = log
        self._poll_lock = threading.Lock()
        self._last_error: str | None = None
        self._stopping = threading.Event()
        self._httpd = ThreadingHTTPServer((host, port), functools.partial(_Handler, app=self))
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the server listens on."""
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        """``http://host:port`` of the server."""
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> EmbeddingServer:
        """Starts answering requests and polling (the first poll at once); returns self.

        Raises:
            RuntimeError: started before, or stopped.
        """
        if self._threads or self._stopping.is_set():
            raise RuntimeError("EmbeddingServer.start: this server was started before; fix: make a new one")
        self._threads = [threading.Thread(target=self._httpd.serve_forever, name="unison-serve-embeddings-http",
                                          daemon=True),
                         threading.Thread(target=self._poll_loop, name="unison-serve-embeddings-poll", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stops polling and answering, closes the socket and joins every thread (requests in flight finish)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self._threads:
            self._httpd.shutdown()  # returns once serve_forever has ended
        self._httpd.server_close()  # joins the threads of requests in flight
        for thread in self._threads:
            thread.join()

    def poll(self) -> list[ServingSnapshot]:
        """Polls now, logging each snapshot applied or the error; returns what was applied (empty on an error).

        The background thread calls this every ``poll_seconds``; a test or a caller that
        knows a snapshot was just written may call it too (polls never overlap).
        """
        with self._poll_lock:
            try:
                records = self.follower.poll()
            except Exception as error:  # any failure leaves the follower as it was: keep serving
                self._log_error(error)
                return []
            self._last_error = None
            for record in records:
                self._log(f"EmbeddingServer: applied snapshot {record.number} ({record.kind} of chain "
                          f"{record.chain}), lag {record.lag:.3f} s")
            return records

    def _log_error(self, error: Exception) -> None:
        """Logs a failed poll once until it changes or a poll succeeds (a broken directory fails every poll)."""
        message = f"{type(error).__name__}: {error}"
        if message != self._last_error:
            held = self.follower.number
            still = "no snapshot served yet" if held is None else f"still serving snapshot {held}"
            self._log(f"EmbeddingServer: poll of {str(self.follower.root)!r} failed ({still}): {message}")
        self._last_error = message

    def _poll_loop(self) -> None:
        while not self._stopping.is_set():
            self.poll()
            self._stopping.wait(self.poll_seconds)

    # ---- what the request handler calls -------------------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        """``GET /status``'s answer.

        Raises:
            _RequestError: 503, no snapshot served yet.
        """
        last = self._served()
        tables = self.follower.embeddings
        return {"root": str(self.follower.root),
                "snapshot": {"number": last.number, "kind": last.kind, "chain": last.chain, "began": last.began,
                             "applied": last.applied, "lag": last.lag, "worst_lag": last.worst_lag,
                             "info": last.info},
                "tables": {name: {"rows": table.num_rows, "dim": table.embedding_dim, "mode": table.mode}
                           for name, table in tables.items()},
                "poll_error": self._last_error}

    def _lookup(self, request: object) -> dict[str, Any]:
        """``POST /lookup``'s answer to the decoded body ``request``.

        Raises:
            _RequestError: 400, a request that does not fit; 503, no snapshot served yet.
        """
        if not isinstance(request, dict):
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"/lookup: the body must be a JSON object "
                                f"{{\"table\": NAME, \"ids\": [int, ...]}}, got {request!r:.80}")
        name, ids = request.get("table"), request.get("ids")
        self._served()
        tables = self.follower.embeddings
        if name is None:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"/lookup: field 'table' is missing; fix: name one of "
                                f"{sorted(tables)}")
        if not isinstance(name, str) or name not in tables:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"/lookup: field 'table' is {name!r}, not a table served; "
                                f"fix: name one of {sorted(tables)}")
        if ids is None:
            raise _RequestError(HTTPStatus.BAD_REQUEST, "/lookup: field 'ids' is missing; fix: pass a list of "
                                "int64 ids, e.g. \"ids\": [3, 17]")
        if not isinstance(ids, list):
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"/lookup: field 'ids' must be a list of int64 ids, got "
                                f"{ids!r:.80}; fix: e.g. \"ids\": [3, 17]")
        for i, value in enumerate(ids):
            if type(value) is not int or not _INT64[0] <= value <= _INT64[1]:
                raise _RequestError(HTTPStatus.BAD_REQUEST, f"/lookup: ids[{i}] is {value!r:.40}, not an int64 "
                                    f"id; fix: pass integers in [-2**63, 2**63)")
        rows = tables[name].lookup(torch.tensor(ids, dtype=torch.int64).reshape(-1))
        return {"rows": rows.tolist()}

    def _served(self) -> ServingSnapshot:
        last = self.follower.last
        if last is None:
            problem = f"; the last poll failed: {self._last_error}" if self._last_error else ""
            raise _RequestError(HTTPStatus.SERVICE_UNAVAILABLE, f"no snapshot is served yet: none found under "
                                f"{str(self.follower.root)!r}{problem}; fix: wait for the trainer's "
                                f"ServingExporter to write one (polled every {self.poll_seconds:g} s)")
        return last

    def __repr__(self) -> str:
        return f"EmbeddingServer({str(self.follower.root)!r}, url={self.url!r}, snapshot={self.follower.number})"


@final
class _Handler(BaseHTTPRequestHandler):
    """One request: routes it to the :class:`EmbeddingServer` and writes its JSON answer."""

    timeout = 10.0  # seconds a connection may stay silent: stop() joins request threads, so none may wait forever

    def __init__(self, *args: Any, app: EmbeddingServer, **kwargs: Any) -> None:
        self.app = app  # set first: the base class answers the request inside __init__
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:
        self._answer(lambda: self.app._status() if self.path == "/status" else self._not_found("GET"))

    def do_POST(self) -> None:
        self._answer(lambda: self.app._lookup(self._body()) if self.path == "/lookup" else self._not_found("POST"))

    def _not_found(self, method: str) -> dict[str, Any]:
        raise _RequestError(HTTPStatus.NOT_FOUND, f"no {method} {self.path!r} here; fix: GET /status or "
                            f"POST /lookup")

    def _body(self) -> object:
        length = self.headers.get("Content-Length")
        try:
            size = int(length) if length is not None else -1
        except ValueError:
            size = -1
        if size < 0:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"/lookup: header Content-Length is {length!r}; fix: send "
                                f"the JSON body with its length")
        if size > MAX_BODY_BYTES:
            raise _RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"/lookup: a body of {size} bytes is over "
                                f"{MAX_BODY_BYTES}; fix: split the ids into several requests")
        data = self.rfile.read(size)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise _RequestError(HTTPStatus.BAD_REQUEST, f"/lookup: the body is not JSON ({error}): {data!r:.80}; "
                                f"fix: send {{\"table\": NAME, \"ids\": [int, ...]}}") from None

    def _answer(self, answer: Callable[[], dict[str, Any]]) -> None:
        try:
            status, body = HTTPStatus.OK, answer()
        except _RequestError as error:
            status, body = error.status, {"error": str(error)}
        except Exception as error:  # a bug, not the request: answer it rather than drop the connection
            status, body = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per request would bury the snapshot lines (errors are in the answers)."""
