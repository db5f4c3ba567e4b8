"""Bounded resources of the loopback Hub (kerneltools/hub/http.py, storage.py): malformed and stalled bodies,
idle connections, the connection cap, stale git ref locks, durable refs and the reflog.

The module's server runs with small limits (`--timeout 1 --max-connections 8 --stale-lock-seconds 0.5`) so that
every limit is reached in about a second. Load, kill -9 and full-disk faults: test_hub_load.py."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError

from toolhelpers import (TRUSTED_ORG, commit_ndjson, connect, file_item, git, raw_request, repo_dir, repo_state,
                         serve_hub_with_v1)

REPO = f"{TRUSTED_ORG}/tiny"
K = dict(repo_type="kernel")
TIMEOUT = 1.0
MAX_CONNECTIONS = 8


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    args = ["--timeout", TIMEOUT, "--max-connections", MAX_CONNECTIONS, "--stale-lock-seconds", 0.5]
    with serve_hub_with_v1(tmp_path_factory.mktemp("limits") / "hub", REPO, args) as h:
        yield h


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=hub.token)


@pytest.fixture
def unchanged(hub):
    before = repo_state(hub, REPO)
    yield
    assert repo_state(hub, REPO) == before


_connect = connect


def _head(hub, extra: str, path: str = f"/api/kernels/{REPO}/commit/v1") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {urlsplit(hub.url).netloc}\r\nAuthorization: Bearer {hub.token}\r\n"
            f"Content-Type: application/x-ndjson\r\n{extra}\r\n").encode()


def _reply(s: socket.socket) -> bytes:
    """Everything until the server closes the connection (it must, within the socket timeout of 10 s)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


BODY = commit_ndjson({"summary": "chunked"}, file_item("c.txt", b"chunked"))


@pytest.mark.parametrize("chunks, text", [
    (b"zz\r\n" + BODY + b"\r\n0\r\n\r\n", b"bad chunk size"),
    (b"-5\r\n" + BODY + b"\r\n0\r\n\r\n", b"bad chunk size"),
    (b"%x;" % len(BODY) + b"x" * 2000 + b"\r\n", b"not terminated by CRLF"),
    (b"%x\r\n" % len(BODY) + BODY + b"XX0\r\n\r\n", b"not followed by CRLF"),
    (b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nbad-trailer", b"bad trailer"),
    (b"%x\r\n" % (1 << 40) + BODY, b"over this server's limit"),
    (b"1" * 16 + b"\r\n" + BODY, b"bad chunk size"),
])
def test_malformed_chunked_bodies_get_400_not_a_hang(hub, unchanged, chunks, text):
    with _connect(hub) as s:
        s.sendall(_head(hub, "Transfer-Encoding: chunked\r\n") + chunks)
        s.shutdown(socket.SHUT_WR)
        reply = _reply(s)
    assert _status(reply) in (400, 413) and text in reply, reply


@pytest.mark.parametrize("headers", ["Transfer-Encoding: gzip\r\n",
                                     "Transfer-Encoding: chunked\r\nContent-Length: 10\r\n",
                                     "Content-Length: -1\r\n", "Content-Length: 1e3\r\n"])
def test_bad_framing_headers(hub, unchanged, headers):
    with _connect(hub) as s:
        s.sendall(_head(hub, headers) + BODY)
        reply = _reply(s)
    assert _status(reply) == 400, reply


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_stalled_body_gets_408(hub, unchanged, framing):
    with _connect(hub) as s:
        if framing == "length":
            s.sendall(_head(hub, f"Content-Length: {len(BODY)}\r\n") + BODY[:10])
        else:
            s.sendall(_head(hub, "Transfer-Encoding: chunked\r\n") + b"%x\r\n" % len(BODY) + BODY[:10])
        t0 = time.monotonic()
        reply = _reply(s)  # no more data: the server answers once its per-connection timeout passes
        waited = time.monotonic() - t0
    assert _status(reply) == 408 and b"nothing was stored" in reply, reply
    assert waited < 10  # bounded by the socket timeout above; the server's own is 1 s


def test_idle_connections_are_closed(hub):
    with _connect(hub) as s:
        assert _reply(s) == b""  # the server hangs up after --timeout of silence


def test_connection_cap_answers_503_with_retry_after(hub):
    held = [_connect(hub) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in held:  # each is being served: a commit whose body is still coming (an unfinished request head
            # would not do: its slot goes to a newer connection, test_hub_abuse.py)
            s.sendall(_head(hub, f"Content-Length: {len(BODY)}\r\n") + BODY[:10])
        time.sleep(0.2)
        with _connect(hub) as extra:
            extra.sendall(f"GET /api/kernels/{REPO}/refs HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            reply = _reply(extra)
        assert _status(reply) == 503 and b"Retry-After: 1\r\n" in reply and b"X-Error-Code: ServiceUnavailable" in reply
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while raw_request(hub.url, "GET", f"/api/kernels/{REPO}/refs")[0] != 200:  # the held threads end
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_stale_ref_lock_of_a_dead_writer_is_recovered(hub, api):
    """A crashed writer left refs/heads/v1.lock: it is removed once it is older than --stale-lock-seconds (no live
    server process holds the repo's writer lock, so no server wrote it), and the commit lands."""
    lock = repo_dir(hub, REPO) / "refs" / "heads" / "v1.lock"
    lock.write_text("0" * 40 + "\n")
    os.utime(lock, (time.time() - 60, time.time() - 60))
    head = api.create_commit(REPO, operations=[CommitOperationAdd("s.txt", b"stale")], commit_message="after crash",
                             revision="v1", **K).oid
    assert not lock.exists() and api.kernel_info(REPO, revision="v1").sha == head
    assert "removed a stale git lock" in hub.log_path.read_text()


def test_a_live_ref_lock_is_never_robbed(hub, api, unchanged):
    """A lock someone keeps fresh (a git process working on the repo by hand) is waited for, then 503 +
    Retry-After; the lock file is left alone."""
    lock = repo_dir(hub, REPO) / "refs" / "heads" / "v1.lock"
    lock.write_text("0" * 40 + "\n")
    stop = threading.Event()

    def keep_fresh():
        while not stop.wait(0.1):
            os.utime(lock)

    t = threading.Thread(target=keep_fresh)
    t.start()
    try:
        with pytest.raises(HfHubHTTPError, match="is locked by another git process") as e:
            api.create_commit(REPO, operations=[CommitOperationAdd("x", b"x")], commit_message="x", revision="v1",
                              **K)
        assert e.value.response.status_code == 503 and e.value.response.headers["Retry-After"] == "5"
        assert lock.exists()
    finally:
        stop.set()
        t.join()
        lock.unlink()


def test_reflog_audit_log_and_durability_settings(hub, api):
    d = repo_dir(hub, REPO)
    api.create_branch(REPO, branch="tmp", revision="v1", **K)
    api.delete_branch(REPO, branch="tmp", **K)
    reflog = git(d, "reflog", "show", "--format=%gn %gs", "refs/heads/v1").splitlines()
    assert reflog[-2:] == ["publisher commit: v1", "publisher branch: from main"]
    audit = [json.loads(line) for line in (d / "hub-audit.log").read_text().splitlines()]
    assert [(a["user"], a["op"], a["ref"]) for a in audit[-2:]] == [("publisher", "branch", "refs/heads/tmp"),
                                                                   ("publisher", "delete", "refs/heads/tmp")]
    assert audit[-1]["new"] == "0" * 40 and audit[-1]["old"] == api.kernel_info(REPO, revision="v1").sha
    config = {k: git(d, "config", k).strip() for k in ("core.fsync", "core.logAllRefUpdates")}
    assert config == {"core.fsync": "committed", "core.logAllRefUpdates": "always"}
