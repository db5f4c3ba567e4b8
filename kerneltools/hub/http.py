"""HTTP plumbing of the loopback Hub server: request bodies, limits, timeouts, error responses, cross-site checks.

Nothing here knows the Hub's routes (:mod:`.server` does); this module makes every request end in a bounded time
with a Hub-style answer:

- bodies are read through :class:`BodyReader` (Content-Length or chunked), never past their limit (413), with a
  per-read socket timeout (408 for a stalled body), and malformed chunked framing is a 400;
- a connection over the server's ``max_connections`` gets an immediate 503 with ``Retry-After`` instead of a thread;
- the listen backlog (``request_queue_size``) takes a burst of hundreds of new connections;
- an answer sent before the body was read ends with a bounded "lingering close", so that the client reads the
  answer instead of a connection reset;
- errors carry ``X-Error-Code`` / ``X-Error-Message`` and a JSON ``{"error": ...}`` body, as on huggingface.co.
"""

from __future__ import annotations

import errno
import json
import re
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from .errors import HubError, disk_full

MAX_JSON_BODY = 4 * 1024 * 1024
MAX_JSON_DEPTH = 64
_CHUNK_SIZE_RE = re.compile(rb"^[0-9A-Fa-f]{1,15}$")
_WRITE_CONTENT_TYPES = ("application/json", "application/x-ndjson")


class IncompleteBody(Exception):
    """The client closed its side before sending the whole request body."""


def bad_json(e: Exception, what: str = "Request body") -> HubError:
    if isinstance(e, RecursionError):
        return HubError(400, f"{what} is not valid JSON: nested too deeply.")
    return HubError(400, f"{what} is not valid JSON: {e}.")


def loads_json(data: bytes | str, what: str = "Request body"):
    """json.loads with a nesting limit (a 100k-deep document is a 400, never a RecursionError)."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_json(e, what) from None
    if depth_over(obj, MAX_JSON_DEPTH):
        raise HubError(400, f"{what} is nested more than {MAX_JSON_DEPTH} levels deep.")
    return obj


def depth_over(obj, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


class BodyReader:
    """A request body framed by Content-Length or chunked transfer encoding, read in bounded pieces up to
    ``limit`` bytes. Socket timeouts (the connection's) surface as TimeoutError; the dispatcher answers 408."""

    def __init__(self, rfile, headers, limit: int):
        self.rfile = rfile
        self.limit = limit
        self.total = 0
        self.done = False
        te = (headers.get("Transfer-Encoding") or "").strip().lower()
        cl = headers.get("Content-Length")
        self.chunked = bool(te)
        self.chunk_left = 0
        if te:
            if te != "chunked":
                raise HubError(400, f"Unsupported Transfer-Encoding {te!r}: send 'chunked' or a Content-Length.")
            if cl is not None:
                raise HubError(400, "A request may not have both Content-Length and Transfer-Encoding.")
            self.remaining = None
            return
        if cl is None or not cl.strip().isdigit():
            if cl is not None:
                raise HubError(400, f"Invalid Content-Length header {cl!r}.")
            cl = "0"
        self.remaining = int(cl)
        if self.remaining > limit:
            raise HubError(413, f"Request body of {self.remaining} bytes is over this server's limit of {limit} "
                                "bytes. Split the upload into several commits, or ask the server's owner to raise "
                                "--max-commit-bytes.")
        self.done = self.remaining == 0

    @property
    def small_rest(self) -> bool:
        """Whether what is left can be drained cheaply (to keep the connection)."""
        return self.done or (self.remaining is not None and self.remaining <= 1 << 20)

    def read(self, n: int) -> bytes:
        """Up to n bytes (at least one), or b'' at the end of the body."""
        if self.done:
            return b""
        if not self.chunked:
            data = self.rfile.read1(min(n, self.remaining))
            if not data:
                raise IncompleteBody(f"after {self.total} of {self.total + self.remaining} bytes")
            self.remaining -= len(data)
            self.total += len(data)
            self.done = self.remaining == 0
            return data
        if self.chunk_left == 0:
            self._next_chunk()
            if self.done:
                return b""
        data = self.rfile.read1(min(n, self.chunk_left))
        if not data:
            raise IncompleteBody(f"in a chunk, after {self.total} bytes")
        self.chunk_left -= len(data)
        self.total += len(data)
        if self.total > self.limit:
            raise HubError(413, f"Request body is over this server's limit of {self.limit} bytes.")
        if self.chunk_left == 0 and self.rfile.read(2) not in (b"\r\n",):
            raise HubError(400, "Malformed chunked request body: chunk data is not followed by CRLF.")
        return data

    def _next_chunk(self) -> None:
        line = self.rfile.readline(1026)
        if not line:
            raise IncompleteBody(f"before a chunk header, after {self.total} bytes")
        if not line.endswith(b"\r\n"):
            raise HubError(400, "Malformed chunked request body: a chunk-size line is not terminated by CRLF "
                                "within 1024 bytes.")
        size = line[:-2].split(b";", 1)[0].strip()
        if not _CHUNK_SIZE_RE.match(size):
            raise HubError(400, f"Malformed chunked request body: bad chunk size {size[:40]!r}.")
        self.chunk_left = int(size, 16)
        if self.chunk_left == 0:
            for _ in range(64):  # trailer fields, then the empty line
                t = self.rfile.readline(8194)
                if t == b"\r\n":
                    self.done = True
                    return
                if not t.endswith(b"\r\n"):
                    raise HubError(400, "Malformed chunked request body: bad trailer.")
            raise HubError(400, "Malformed chunked request body: too many trailer fields.")
        if self.total + self.chunk_left > self.limit:
            raise HubError(413, f"Request body is over this server's limit of {self.limit} bytes.")

    def read_all(self) -> bytes:
        parts = []
        while chunk := self.read(1 << 16):
            parts.append(chunk)
        return b"".join(parts)

    def drain(self) -> bool:
        """Discard the rest of the body; False if that is not possible (the connection must then close)."""
        try:
            while self.read(1 << 16):
                pass
            return True
        except (IncompleteBody, HubError, OSError):
            return False


def parse_target(raw: str) -> tuple[list[str], dict[str, str]]:
    """Split the request target into percent-decoded path segments (split first, then decode: revisions arrive
    as 'refs%2Fheads%2Fv1') and the query (last value of each key)."""
    url = urlsplit(raw)
    if not url.path.startswith("/"):
        raise HubError(400, "Bad request path.")
    try:
        segs = [unquote(s, errors="strict") for s in url.path.split("/")[1:]]
    except UnicodeDecodeError:
        raise HubError(400, "Request path is not valid UTF-8 after percent-decoding.") from None
    if len(segs) > 1 and segs[-1] == "":
        segs = segs[:-1]
    query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
    return segs, query


class LimitedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; one more gets a 503 + Retry-After at once."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # the listen backlog (the kernel caps it at net.core.somaxconn)

    def __init__(self, addr, handler, *, max_connections: int = 256, timeout: float = 30.0):
        self.max_connections = max_connections
        self.conn_timeout = timeout
        self.active_connections = 0
        self.peak_connections = 0
        self.refused_connections = 0
        self._count_lock = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request, client_address):
        with self._count_lock:
            full = self.active_connections >= self.max_connections
            if not full:
                self.active_connections += 1
                self.peak_connections = max(self.peak_connections, self.active_connections)
            else:
                self.refused_connections += 1
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._count_lock:
            self.active_connections -= 1

    def _refuse(self, request) -> None:
        msg = f"The Hub server is at its limit of {self.max_connections} open connections. Retry shortly."
        body = json.dumps({"error": msg}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Retry-After: 1\r\nX-Error-Code: ServiceUnavailable\r\nX-Error-Message: {msg}\r\n"
                "Connection: close\r\n\r\n").encode()
        try:
            request.settimeout(1.0)
            request.sendall(head + body)
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            self.shutdown_request(request)


class HubHandlerBase(BaseHTTPRequestHandler):
    """Request plumbing; subclasses implement ``route(method, segments)``."""

    protocol_version = "HTTP/1.1"
    server_version = "kerneltools-hub/2"

    def setup(self):
        self.timeout = self.server.conn_timeout  # per read and write on this connection
        super().setup()

    def log_message(self, fmt, *args):
        if not getattr(self.server, "quiet", False):
            sys.stderr.write(f"{self.address_string()} - [{self.log_date_time_string()}] {fmt % args}\n")

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PUT(self):
        self._dispatch("PUT")

    def route(self, method: str, segs: list[str]) -> None:  # pragma: no cover - overridden
        raise HubError(404, "Not found.")

    def _dispatch(self, method: str) -> None:
        self.body: BodyReader | None = None
        self.answered = False
        try:
            segs, self.query = parse_target(self.path)
            self.route(method, segs)
        except HubError as e:
            self.send_error_json(e)
        except IncompleteBody as e:  # the client stopped sending: nothing was stored
            self.close_connection = True
            self.send_error_json(HubError(400, f"The request body ended early ({e}); nothing was stored."))
        except TimeoutError:
            self.close_connection = True
            self.send_error_json(HubError(408, f"No data from the client for {self.server.conn_timeout:g} s in the "
                                               "middle of the request; nothing was stored.", "RequestTimeout"))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.send_error_json(disk_full("The Hub server's disk is full; nothing was stored. Free space on the "
                                           "server and retry."))
        except Exception as e:  # a bug: 500, never a half write (commits publish with one update-ref)
            self.log_error("internal error: %r", e)
            traceback.print_exc()
            self.send_error_json(HubError(500, f"Internal server error: {type(e).__name__}: {e}"))

    # ---------------------------------------------------------------- bodies

    def body_reader(self, limit: int = MAX_JSON_BODY) -> BodyReader:
        if self.body is None:
            self.body = BodyReader(self.rfile, self.headers, limit)
        return self.body

    def json_body(self, required: bool = False) -> dict:
        data = self.body_reader().read_all()
        if not data.strip():
            if required:
                raise HubError(400, "Expected a JSON object in the request body.")
            return {}
        obj = loads_json(data)
        if not isinstance(obj, dict):
            raise HubError(400, "Expected a JSON object in the request body.")
        return obj

    def _finish_body(self) -> None:
        """Before answering: consume a small unread body (keep-alive), else close after answering."""
        if self.close_connection:
            return
        if self.body is None:
            if self.command in ("GET", "HEAD") and not self.headers.get("Content-Length") \
                    and not self.headers.get("Transfer-Encoding"):
                return
            try:
                self.body = BodyReader(self.rfile, self.headers, 1 << 62)
            except HubError:
                self.close_connection = True
                return
        if not self.body.done and (not self.body.small_rest or not self.body.drain()):
            self.close_connection = True

    # ---------------------------------------------------------------- answers

    def send_body(self, status: int, body: bytes, headers: dict | None = None,
                  content_type: str = "application/json") -> None:
        if self.answered:
            return
        self._finish_body()
        self.answered = True
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def send_json(self, obj, status: int = 200, headers: dict | None = None) -> None:
        self.send_body(status, json.dumps(obj).encode(), headers)

    def send_error_json(self, e: HubError, headers: dict | None = None, body: dict | None = None) -> None:
        h = dict(headers or {})
        h["X-Error-Message"] = e.message.encode("ascii", "backslashreplace").decode().replace("\n", " ")[:2000]
        if e.code:
            h["X-Error-Code"] = e.code
        h.update(e.headers)
        try:
            self.send_json(body if body is not None else {"error": e.message}, e.status, h)
        except OSError:
            self.close_connection = True

    def finish(self):
        """Lingering close: when we answered without reading the whole body, stop writing and discard what the
        client still sends (a bounded amount and time), so that it reads our answer instead of a reset."""
        try:
            super().finish()
        finally:
            body = getattr(self, "body", None)
            if self.close_connection and body is not None and not body.done:
                _linger(self.connection)


def _linger(sock, max_bytes: int = 64 << 20, max_seconds: float = 2.0) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + max_seconds
        got = 0
        while got < max_bytes and time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = sock.recv(1 << 16)
            if not data:
                break
            got += len(data)
    except OSError:
        pass


def write_request_problem(headers, server_origins: set[str], server_hosts: set[str], has_body: bool,
                          content_types=_WRITE_CONTENT_TYPES):
    """Why a write request is refused as possibly cross-site, or None.

    Writes already need ``Authorization: Bearer`` (which a browser never adds to a cross-site request without a
    CORS preflight, and this server answers none). On top of that: a foreign ``Origin`` or ``Host`` is refused, and
    a body must be JSON or ndjson (the content types an HTML form or a "simple" cross-site request cannot send)."""
    origin = headers.get("Origin")
    if origin is not None and origin.rstrip("/").lower() not in server_origins:
        return f"Cross-site write refused: Origin {origin!r} is not this server."
    host = (headers.get("Host") or "").strip().lower()
    if host and host not in server_hosts:
        return f"Write refused: Host {host!r} is not this server's address (a DNS-rebinding or proxy mix-up?)."
    if has_body:
        ctype = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype not in content_types:
            return (f"Write refused: Content-Type {ctype or 'none'!r}; send {' or '.join(content_types)} (what "
                    "huggingface_hub sends).")
    return None
