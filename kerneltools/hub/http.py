"""HTTP plumbing of the loopback Hub server: request bodies, limits, timeouts, error responses, cross-site checks.

Nothing here knows the Hub's routes (:mod:`.server` does); this module makes every request end in a bounded time
with a Hub-style answer:

- bodies are read through :class:`BodyReader` (Content-Length or chunked), never past their limit (413), with a
  per-read socket timeout (408 for a stalled body), and malformed framing (a Content-Length that is not ASCII
  digits, bad chunks) is a 400; JSON bodies are bounded in size, shape, depth and must be valid Unicode
  (:func:`loads_json`), and large ones draw on a server-wide budget;
- a request head must arrive within ``header_timeout``; at ``max_connections`` a new connection takes the slot of
  the one idle or sending its head the longest, and gets an immediate 503 with ``Retry-After`` only when every
  connection is handling a request;
- answers go out with TCP_NODELAY, head and body in one write (no Nagle / delayed-ACK wait on keep-alive);
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

from .errors import HubError, busy, disk_full
from .names import utf8_ok

MAX_JSON_BODY = 1 << 20  # default of --max-json-bytes: every JSON body (create, preupload, paths-info, ...)
MAX_JSON_DEPTH = 64
# the shape of a JSON body, counted on its bytes before parsing: what it may cost in memory once parsed (a 1 MiB
# body of '[{},{},...]' would otherwise become ~20 MB of Python objects)
MAX_JSON_CONTAINERS = 10_000
MAX_JSON_STRINGS = 20_000
SMALL_BODY = 64 << 10  # bodies up to this size are read without a reservation from the server's body budget
_CHUNK_SIZE_RE = re.compile(rb"[0-9A-Fa-f]{1,15}")  # fullmatch
_CONTENT_LENGTH_RE = re.compile(r"[0-9]{1,18}")  # fullmatch: ASCII digits only (str.isdigit also takes '\xb2')
_WRITE_CONTENT_TYPES = ("application/json", "application/x-ndjson")


class IncompleteBody(Exception):
    """The client closed its side before sending the whole request body."""


def bad_json(e: Exception, what: str = "Request body") -> HubError:
    if isinstance(e, RecursionError):
        return HubError(400, f"{what} is not valid JSON: nested too deeply.")
    return HubError(400, f"{what} is not valid JSON: {e}.")


def json_shape_problem(data: bytes) -> str | None:
    """Why a JSON text would cost too much to parse (too many objects, arrays or strings), or None."""
    containers = data.count(b"{") + data.count(b"[")
    if containers > MAX_JSON_CONTAINERS:
        return f"it has more than {MAX_JSON_CONTAINERS} objects and arrays"
    if data.count(b'"') > 2 * MAX_JSON_STRINGS:
        return f"it has more than {MAX_JSON_STRINGS} strings"
    return None


def loads_json(data: bytes | str, what: str = "Request body"):
    """json.loads with bounds: its shape (:func:`json_shape_problem`) is checked before parsing, and the result may
    be nested at most MAX_JSON_DEPTH deep and hold only valid Unicode (JSON can carry a lone surrogate '\\ud800',
    which nothing downstream can encode). Every problem is a 400, never a RecursionError or UnicodeEncodeError."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    problem = json_shape_problem(raw)
    if problem:
        raise HubError(400, f"{what} is refused: {problem}. Split the request into smaller ones.")
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad_json(e, what) from None
    problem = json_problem(obj, MAX_JSON_DEPTH)
    if problem:
        raise HubError(400, f"{what} is refused: {problem}.")
    return obj


def json_problem(obj, limit: int) -> str | None:
    """Why a parsed JSON value is refused (nested more than ``limit`` levels, or a string or key that is not valid
    Unicode), or None."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, str):
            if not o.isascii() and not utf8_ok(o):
                return ("it has a string that is not valid Unicode (a lone surrogate such as '\\ud800'); send "
                        "UTF-8 text")
        elif isinstance(o, (dict, list)):
            if d > limit:
                return f"it is nested more than {limit} levels deep"
            if isinstance(o, dict):
                stack.extend((k, d) for k in o)
                stack.extend((v, d + 1) for v in o.values())
            else:
                stack.extend((v, d + 1) for v in o)
    return None


class BodyReader:
    """A request body framed by Content-Length or chunked transfer encoding, read in bounded pieces up to
    ``limit`` bytes. Socket timeouts (the connection's) surface as TimeoutError; the dispatcher answers 408."""

    def __init__(self, rfile, headers, limit: int, option: str = "--max-commit-bytes"):
        self.rfile = rfile
        self.limit = limit
        self.option = option
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
        if cl is not None and not _CONTENT_LENGTH_RE.fullmatch(cl.strip()):
            shown = cl if len(cl) <= 40 else cl[:40] + "..."
            raise HubError(400, f"Invalid Content-Length header {shown!r}: expected the body's size in bytes as "
                                "ASCII digits (at most 18 of them).")
        self.remaining = int(cl or "0")
        if self.remaining > limit:
            raise HubError(413, f"Request body of {self.remaining} bytes is over this server's limit of {limit} "
                                "bytes for this request. Split it into several smaller requests (or commits), or "
                                f"ask the server's owner to raise {option}.")
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
        if not _CHUNK_SIZE_RE.fullmatch(size):
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


class _Conn:
    """What the server knows of one open connection: its socket and what it is doing.

    ``idle``: between requests, nothing of the next one received yet; ``head``: receiving a request line and
    headers; ``busy``: a request is being handled (its body read, its answer written)."""

    __slots__ = ("sock", "state", "since", "dropped")

    def __init__(self, sock):
        self.sock, self.state, self.since, self.dropped = sock, "idle", time.monotonic(), False


class LimitedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them.

    - A connection must deliver each request head (request line and headers) within ``header_timeout`` seconds of
      its first byte, however it trickles, and a JSON body within as long again (:meth:`HubHandlerBase.
      read_small_body`); an idle one is closed after ``timeout`` seconds of silence.
    - At the cap, a new connection takes the slot of the connection that has been idle or sending its head the
      longest (at least ``EVICT_AFTER`` seconds): slow or idle clients cannot starve others. Only when every slot
      is handling a request is the newcomer answered 503 + Retry-After, at once.
    - Request bodies buffered in memory (JSON) over SMALL_BODY bytes reserve their size from a server-wide budget
      of ``body_budget`` bytes; over it, 503 + Retry-After instead of more memory.
    - :meth:`drain` (at shutdown) closes idle and half-received connections and waits a bounded time for the
      requests in progress."""

    daemon_threads = True
    block_on_close = False  # shutdown must not wait for idle keep-alive connections (see drain)
    allow_reuse_address = True
    request_queue_size = 1024  # the listen backlog (the kernel caps it at net.core.somaxconn)
    EVICT_AFTER = 1.0

    def __init__(self, addr, handler, *, max_connections: int = 256, timeout: float = 30.0,
                 header_timeout: float = 10.0, max_json_bytes: int = MAX_JSON_BODY, body_budget: int = 32 << 20):
        self.max_connections = max_connections
        self.conn_timeout = timeout
        self.header_timeout = header_timeout
        self.max_json_bytes = max_json_bytes
        self.body_budget = body_budget
        self.buffered_bytes = 0
        self.active_connections = 0
        self.peak_connections = 0
        self.refused_connections = 0
        self.dropped_connections = 0
        self.conns: dict = {}
        self._count_lock = threading.Lock()
        super().__init__(addr, handler)

    def process_request(self, request, client_address):
        try:  # answers go out at once (no Nagle wait for the ACK of the previous segment)
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        victim = None
        with self._count_lock:
            full = self.active_connections >= self.max_connections
            if full:
                victim = self._victim()
                if victim is not None:
                    self._forget(victim)
                    full = False
            if not full:
                self.active_connections += 1
                self.peak_connections = max(self.peak_connections, self.active_connections)
                self.conns[request] = _Conn(request)
            else:
                self.refused_connections += 1
        if victim is not None:
            self._drop(victim, "503 Service Unavailable", "The Hub server is at its connection limit and closed "
                       "this unfinished request to serve another client. Retry.")
        if full:
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request) -> None:
        with self._count_lock:
            conn = self.conns.pop(request, None)
            if conn is not None and not conn.dropped:
                self.active_connections -= 1

    def _forget(self, conn: _Conn) -> None:
        """Under the lock: the connection no longer counts (its thread ends once _drop has shut its socket)."""
        conn.dropped = True
        self.active_connections -= 1
        self.dropped_connections += 1

    def _victim(self) -> _Conn | None:
        """Under the lock: the connection idle or sending its head for longest, if that is over EVICT_AFTER s."""
        now, best = time.monotonic(), None
        for c in self.conns.values():
            if (not c.dropped and c.state != "busy" and now - c.since >= self.EVICT_AFTER
                    and (best is None or (c.state, c.since) < (best.state, best.since))):
                best = c  # "head" < "idle": a trickling head goes before an idle keep-alive connection
        return best

    def set_state(self, sock, state: str) -> bool:
        """Record what a connection does; False if it has been dropped (its handler must stop)."""
        with self._count_lock:  # never races with the choice of a victim
            conn = self.conns.get(sock)
            if conn is None or conn.dropped:
                return False
            conn.state, conn.since = state, time.monotonic()
            return True

    def is_dropped(self, sock) -> bool:
        conn = self.conns.get(sock)
        return conn is None or conn.dropped

    def service_actions(self) -> None:
        """Every poll interval of serve_forever: drop connections whose request head is overdue."""
        now, late = time.monotonic(), []
        with self._count_lock:
            for c in self.conns.values():
                if not c.dropped and c.state == "head" and now - c.since > self.header_timeout:
                    self._forget(c)
                    late.append(c)
        for c in late:
            self._drop(c, "408 Request Timeout", f"The request head (request line and headers) did not arrive within "
                       f"{self.header_timeout:g} s; send it at once.")

    @staticmethod
    def _drop(conn: _Conn, status: str, msg: str) -> None:
        """Shut the connection: its handler thread sees the end of the stream and ends. A client that had started
        a request is told why first (if its socket takes the answer without waiting); an idle keep-alive one is
        closed silently, as HTTP allows, so that it never reads an answer to a request it has not sent."""
        if conn.state == "idle":
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        body = json.dumps({"error": msg}).encode()
        code = "RequestTimeout" if status.startswith("408") else "ServiceUnavailable"
        head = (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Retry-After: 1\r\nX-Error-Code: {code}\r\nX-Error-Message: {msg}\r\nConnection: close\r\n\r\n")
        try:
            conn.sock.send(head.encode() + body, socket.MSG_DONTWAIT)
        except OSError:
            pass
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def reserve_body(self, n: int) -> bool:
        with self._count_lock:
            if self.buffered_bytes + n > self.body_budget:
                return False
            self.buffered_bytes += n
            return True

    def release_body(self, n: int) -> None:
        with self._count_lock:
            self.buffered_bytes -= n

    def drain(self, grace: float) -> int:
        """At shutdown (after the listening socket is closed): close every connection that is not handling a
        request, then wait up to ``grace`` seconds for those that are. Returns how many were still busy."""
        deadline = time.monotonic() + grace
        while True:
            with self._count_lock:
                quiet = [c for c in self.conns.values() if not c.dropped and c.state != "busy"]
                for c in quiet:
                    self._forget(c)
                busy_left = sum(1 for c in self.conns.values() if not c.dropped)
            for c in quiet:
                self._drop(c, "503 Service Unavailable", "The Hub server is shutting down. Retry shortly.")
            if not busy_left or time.monotonic() > deadline:
                return busy_left
            time.sleep(0.05)

    def _refuse(self, request) -> None:
        msg = f"The Hub server is at its limit of {self.max_connections} open connections. Retry shortly."
        body = json.dumps({"error": msg}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                f"Retry-After: 1\r\nX-Error-Code: ServiceUnavailable\r\nX-Error-Message: {msg}\r\n"
                "Connection: close\r\n\r\n").encode()
        try:  # never blocks the accepting thread: what the socket does not take at once is not sent
            request.send(head + body, socket.MSG_DONTWAIT)
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

    def handle_one_request(self):
        """Wait for the next request (idle: closed after --timeout of silence), then read its head under the
        server's header deadline (:meth:`LimitedThreadingHTTPServer.service_actions`) and handle it."""
        if not self.server.set_state(self.connection, "idle"):
            self.close_connection = True
            return
        try:
            first = self.rfile.peek(1)
        except (TimeoutError, OSError):
            first = b""
        if not first or not self.server.set_state(self.connection, "head"):
            self.close_connection = True
            return
        try:
            super().handle_one_request()
        except OSError:  # the client went away, or the server dropped the connection
            self.close_connection = True

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line or header): not on a dropped connection."""
        if self.server.is_dropped(self.connection):
            self.close_connection = True
            return
        super().send_error(code, message, explain)

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
        self.reserved = 0
        if not self.server.set_state(self.connection, "busy"):
            self.close_connection = True
            return
        try:
            self._dispatch_guarded(method)
        finally:
            if self.reserved:
                self.server.release_body(self.reserved)
                self.reserved = 0

    def _dispatch_guarded(self, method: str) -> None:
        try:
            if self.headers.get("Content-Length") is not None or self.headers.get("Transfer-Encoding"):
                BodyReader(self.rfile, self.headers, 1 << 62)  # malformed framing: 400 whatever the route
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

    def body_reader(self, limit: int | None = None, option: str = "--max-json-bytes") -> BodyReader:
        """The request's body, refused (413) over ``limit`` bytes (default: the server's --max-json-bytes)."""
        if self.body is None:
            self.body = BodyReader(self.rfile, self.headers, limit or self.server.max_json_bytes, option)
        return self.body

    def read_small_body(self, limit: int | None = None) -> bytes:
        """The whole body, to be parsed in memory: within ``limit``, and over SMALL_BODY bytes only if the server's
        budget for buffered bodies has room for it (else 503 + Retry-After)."""
        reader = self.body_reader(limit)
        need = reader.limit if reader.remaining is None else reader.remaining
        if need > SMALL_BODY and not self.reserved:
            if not self.server.reserve_body(need):
                self.close_connection = True
                raise busy("The Hub server is busy reading other large request bodies; nothing was done. Retry "
                           "shortly.")
            self.reserved = need
        # the whole body within --header-timeout, however it trickles: such bodies are small, and a client that
        # sends one byte at a time would otherwise keep its slot busy (and out of reach of the slot takeover)
        deadline, parts = time.monotonic() + self.server.header_timeout, []
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(left)
                chunk = reader.read(1 << 16)
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
        except TimeoutError:
            self.close_connection = True
            raise HubError(408, f"The request body did not arrive within {self.server.header_timeout:g} s; send it "
                                "at once. Nothing was done.", "RequestTimeout") from None
        finally:
            self.connection.settimeout(self.server.conn_timeout)

    def json_body(self, required: bool = False, limit: int | None = None) -> dict:
        data = self.read_small_body(limit)
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
        self._headers_buffer.append(b"\r\n")
        head = b"".join(self._headers_buffer)
        self._headers_buffer = []
        if self.command == "HEAD":
            self.wfile.write(head)
        elif len(body) <= SMALL_BODY:  # one write: head and body in one segment
            self.wfile.write(head + body)
        else:
            self.wfile.write(head)
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
