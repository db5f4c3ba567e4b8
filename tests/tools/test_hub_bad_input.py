"""Bad input over raw HTTP: each request is refused with the right status/X-Error-Code, and the repo is intact."""

from __future__ import annotations

import json
import socket
from urllib.parse import quote, urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, HfApi

from toolhelpers import TRUSTED_ORG, commit_ndjson, file_item, raw_request, repo_state
from kerneltools.hub import serve_hub

REPO = "geglu-kernels/tiny"
NDJSON = {"Content-Type": "application/x-ndjson"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """One server and repo for the whole module (speed); every test checks the repo is unchanged afterwards."""
    with serve_hub(tmp_path_factory.mktemp("bad") / "hub", trusted_orgs=[TRUSTED_ORG]) as h:
        api = HfApi(endpoint=h.url, token=h.token)
        api.create_repo(REPO, repo_type="kernel")
        api.create_branch(REPO, branch="v1", repo_type="kernel")
        api.create_commit(REPO, operations=[CommitOperationAdd("build/torch-cpu/a.py", b"A = 1\n")],
                          commit_message="v1", revision="v1", repo_type="kernel")
        yield h


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=hub.token)


@pytest.fixture
def krepo(hub):
    state = repo_state(hub, REPO)
    yield REPO
    # whatever the test sent, nothing changed and the repo is consistent
    assert repo_state(hub, REPO) == state
    status, _, body = raw_request(hub.url, "GET", f"/kernels/{REPO}/resolve/v1/build/torch-cpu/a.py")
    assert (status, body) == (200, b"A = 1\n")


def _commit(hub, body: bytes, rev: str = "v1", repo: str = REPO):
    return raw_request(hub.url, "POST", f"/api/kernels/{repo}/commit/{quote(rev, safe='')}", body, NDJSON,
                       token=hub.token)


def _write(hub, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """A write request with the hub's write token."""
    return raw_request(hub.url, method, path, body, headers, token=hub.token)


def _raw_head(hub, method: str, path: str, headers: str) -> bytes:
    """A request head for raw sockets: the server's own Host, the write token, and `headers` (CRLF-terminated)."""
    host = urlsplit(hub.url).netloc
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {hub.token}\r\n{headers}"
            "\r\n").encode()


def _assert_error(resp, status: int, code: str | None = None, text: str | None = None):
    got_status, headers, body = resp
    assert got_status == status, body
    assert headers.get("X-Error-Code") == code
    assert headers.get("X-Error-Message")
    if not body:  # HEAD
        return
    err = json.loads(body)["error"]
    if text:
        assert text in err, err


HDR = {"summary": "evil"}


@pytest.mark.parametrize("path", [
    "../escape.py", "build/../../escape.py", "build/./a.py", "/etc/passwd", "build//a.py", "", "build/", ".git/config",
    "build/.git/hooks/pre-commit", "a\\b", "a\nb",
])
def test_bad_paths_in_commit_are_refused(hub, krepo, path):
    _assert_error(_commit(hub, commit_ndjson(HDR, file_item(path, b"x"))), 400, text="Invalid path")
    for key in ("deletedFile", "deletedFolder"):
        if path == "build/" and key == "deletedFolder":
            continue  # a folder path may end with '/'
        _assert_error(_commit(hub, commit_ndjson(HDR, {"key": key, "value": {"path": path}})), 400,
                      text="Invalid path")


def test_bad_paths_elsewhere(hub, krepo):
    _assert_error(raw_request(hub.url, "GET", f"/kernels/{REPO}/resolve/v1/build/%2E%2E/%2E%2E/x"), 400,
                  text="Invalid path")
    _assert_error(raw_request(hub.url, "GET", f"/api/kernels/{REPO}/tree/v1/build/..%2F.."), 400, text="Invalid path")
    body = json.dumps({"files": [{"path": "../x", "sample": "", "size": 1}]}).encode()
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/preupload/v1", body, JSON), 400, text="Invalid path")


@pytest.mark.parametrize("body, text", [
    (b"not json\n", "not valid JSON"),
    (b"", "empty"),
    (b'["a list"]\n', "must be"),
    (json.dumps({"key": "file", "value": {"path": "a", "content": ""}}).encode() + b"\n", "first line must be"),
    (commit_ndjson({"summary": ""}), "summary"),
    (commit_ndjson({"summary": "s", "parentCommit": "not-hex"}), "parentCommit"),
    (commit_ndjson(HDR, {"key": "file", "value": {"path": "a", "content": "%%%not base64", "encoding": "base64"}}),
     "not valid base64"),
    (commit_ndjson(HDR, {"key": "file", "value": {"path": "a", "content": "aGk", "encoding": "base64"}}),
     "not valid base64"),  # missing padding
    (commit_ndjson(HDR, {"key": "file", "value": {"path": "a", "content": "hi", "encoding": "utf-8"}}), "base64"),
    (commit_ndjson(HDR, {"key": "lfsFile", "value": {"path": "a", "algo": "sha256", "oid": "0" * 64, "size": 1}}),
     "LFS"),
    (commit_ndjson(HDR, {"key": "rename", "value": {"path": "a"}}), "unknown key"),
    (commit_ndjson(HDR, file_item("ok.txt", b"fine")) + b"{truncated json\n", "line 3"),
])
def test_malformed_ndjson_is_refused_whole(hub, krepo, body, text):
    """A bad line anywhere refuses the whole commit, including the good lines before it."""
    _assert_error(_commit(hub, body), 400, text=text)


def test_file_and_folder_clash_is_refused(hub, krepo):
    body = commit_ndjson(HDR, file_item("build/torch-cpu/a.py/inner", b"x"))
    _assert_error(_commit(hub, body), 400, text="both a file and a folder")


def test_delete_of_missing_entries(hub, krepo):
    _assert_error(_commit(hub, commit_ndjson(HDR, {"key": "deletedFile", "value": {"path": "nope.py"}})), 404,
                  "EntryNotFound")
    _assert_error(_commit(hub, commit_ndjson(HDR, {"key": "deletedFolder", "value": {"path": "nope/"}})), 404,
                  "EntryNotFound")


def _assert_ref_name_refused(hub, name: str) -> None:
    """Neither a branch nor a tag of that name can be created: 400, the Hub's message."""
    enc = quote(name, safe="")
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/branch/{enc}", b"{}", JSON), 400,
                  text="Invalid branch name")
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/tag/v1", json.dumps({"tag": name}).encode(), JSON), 400,
                  text="Invalid tag name")


@pytest.mark.parametrize("name", ["-v1", "--force", "a..b", "a b", "x~1", "x^", "x:y", "a.lock", "refs/heads/x",
                                  "HEAD", "@{-1}", "trailing/", "0123456789abcdef0123456789abcdef01234567"])
def test_invalid_ref_names_are_refused(hub, krepo, name):
    _assert_ref_name_refused(hub, name)


@pytest.mark.parametrize("rev", ["-v1", "--output=/tmp/x", "v1..main", "v1^{tree}", "HEAD~1", "main:a", "v9",
                                 "0" * 40, "refs/heads/-x"])
def test_bad_or_unknown_revisions(hub, krepo, rev):
    enc = quote(rev, safe="")
    for method, path in [("GET", f"/api/kernels/{REPO}/revision/{enc}"), ("GET", f"/api/kernels/{REPO}/tree/{enc}"),
                         ("GET", f"/kernels/{REPO}/resolve/{enc}/build/torch-cpu/a.py"),
                         ("GET", f"/api/kernels/{REPO}/commits/{enc}")]:
        _assert_error(raw_request(hub.url, method, path), 404, "RevisionNotFound")
    _assert_error(_commit(hub, commit_ndjson(HDR, file_item("x", b"x")), rev=rev), 404, "RevisionNotFound")
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/branch/new", json.dumps({"startingPoint": rev}).encode(),
                         JSON), 404, "RevisionNotFound")


@pytest.mark.parametrize("repo", ["geglu-kernels/nope", "geglu-kernels/..", "-x/y", "a--b/c"])
def test_unknown_repos(hub, krepo, repo):
    for method, path in [("GET", f"/api/kernels/{repo}"), ("GET", f"/api/kernels/{repo}/refs"),
                         ("GET", f"/api/kernels/{repo}/tree/main"), ("HEAD", f"/kernels/{repo}/resolve/main/a"),
                         ("POST", f"/api/kernels/{repo}/branch/x")]:
        _assert_error(_write(hub, method, path), 404, "RepoNotFound")
    _assert_error(_commit(hub, commit_ndjson(HDR, file_item("x", b"x")), repo=repo), 404, "RepoNotFound")


def test_bad_create_requests(hub, krepo):
    for body in [{"name": "../x", "organization": "geglu-kernels", "type": "kernel"},
                 {"name": "ok", "organization": "-rf", "type": "kernel"},
                 {"name": "ok", "organization": "geglu-kernels", "type": "bucket"},
                 {"name": ["x"], "organization": "geglu-kernels", "type": "kernel"}]:
        _assert_error(_write(hub, "POST", "/api/repos/create", json.dumps(body).encode(), JSON), 400)
    _assert_error(_write(hub, "POST", "/api/repos/create", b"{nope", JSON), 400, text="not valid JSON")


def test_oversized_body_is_refused_without_reading_it(hub, krepo):
    u = urlsplit(hub.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(_raw_head(hub, "POST", f"/api/kernels/{REPO}/commit/v1",
                            f"Content-Type: application/x-ndjson\r\nContent-Length: {10**12}\r\n"))
        reply = s.recv(65536).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413") and "limit" in reply


def test_client_disconnect_mid_body_commits_nothing(hub, krepo):
    body = commit_ndjson(HDR, file_item("build/torch-cpu/a.py", b"A = 666\n"), file_item("more", b"x" * 1000))
    u = urlsplit(hub.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(_raw_head(hub, "POST", f"/api/kernels/{REPO}/commit/v1",
                            f"Content-Type: application/x-ndjson\r\nContent-Length: {len(body)}\r\n")
                  + body[: len(body) // 2])
        s.shutdown(socket.SHUT_WR)  # the client is done sending: half a body
        reply = _read_to_eof(s)  # EOF: the server has finished with this request (the teardown check comes after)
    assert reply.startswith(b"HTTP/1.1 400") and b"ended early" in reply, reply
    assert raw_request(hub.url, "GET", f"/api/kernels/{REPO}/refs")[0] == 200


def _read_to_eof(s: socket.socket) -> bytes:
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    return reply


def test_chunked_commit_body_is_accepted(hub, api, krepo):
    """Not an error case: a chunked body works like a Content-Length one (then undo it so the fixture can check)."""
    body = commit_ndjson(HDR, file_item("c.txt", b"chunked"))
    u = urlsplit(hub.url)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(_raw_head(hub, "POST", f"/api/kernels/{REPO}/commit/main", "Connection: close\r\n"
                            "Content-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n")
                  + chunks + b"0\r\n\r\n")
        reply = _read_to_eof(s)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    assert api.list_repo_files(REPO, repo_type="kernel") == [".gitattributes", "c.txt"]
    # restore main for the intact-repo check (main is allowed to move back only via a new commit: reset the ref)
    from toolhelpers import git, repo_dir

    d = repo_dir(hub, REPO)
    git(d, "update-ref", "refs/heads/main", "refs/heads/main~1")


def test_wrong_methods_and_unknown_endpoints(hub, krepo):
    _assert_error(raw_request(hub.url, "POST", f"/kernels/{REPO}/resolve/v1/build/torch-cpu/a.py", b""), 405)
    _assert_error(raw_request(hub.url, "GET", f"/api/kernels/{REPO}/nope"), 404)
    _assert_error(raw_request(hub.url, "GET", "/api/kernels/%ff%fe/x"), 400, text="UTF-8")
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/commit/v1?create_pr=1",
                         commit_ndjson(HDR, file_item("x", b"x")), NDJSON), 400, text="Pull requests")


# --- requests that once got a 500, or names accepted that then broke the clients ------------------------------------

NESTED = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("where", ["create", "preupload", "tag", "paths-info", "commit line", "long commit line"])
def test_deeply_nested_json_is_a_400(hub, krepo, where):
    path, ctype, body = {
        "create": ("/api/repos/create", JSON, NESTED),
        "preupload": (f"/api/kernels/{REPO}/preupload/v1", JSON, b'{"files": ' + NESTED + b"}"),
        "tag": (f"/api/kernels/{REPO}/tag/v1", JSON, b'{"tag": ' + NESTED + b"}"),
        "paths-info": (f"/api/kernels/{REPO}/paths-info/v1", JSON, b'{"paths": ' + NESTED + b"}"),
        "commit line": (f"/api/kernels/{REPO}/commit/v1", NDJSON, commit_ndjson(HDR) + NESTED + b"\n"),
        "long commit line": (f"/api/kernels/{REPO}/commit/v1", NDJSON,
                             commit_ndjson(HDR) + b"[" * 2_000_000 + b"]" * 2_000_000 + b"\n"),
    }[where]
    resp = _write(hub, "POST", path, body, ctype)
    _assert_error(resp, 400)  # refused for its depth, or (JSON bodies) for its count of arrays before parsing
    err = json.loads(resp[2])["error"]
    assert "nested" in err or "objects and arrays" in err, err


@pytest.mark.parametrize("rev", ["\x00", "v1\x00", "\x7f", "\n"])
def test_revisions_with_control_characters(hub, krepo, rev):
    enc = quote(rev, safe="")
    for path in (f"/api/kernels/{REPO}/revision/{enc}", f"/api/kernels/{REPO}/tree/{enc}",
                 f"/kernels/{REPO}/resolve/{enc}/build/torch-cpu/a.py", f"/api/kernels/{REPO}/commits/{enc}"):
        _assert_error(raw_request(hub.url, "GET", path), 404, "RevisionNotFound")
    _assert_error(_commit(hub, commit_ndjson(HDR, file_item("x", b"x")), rev=rev), 404, "RevisionNotFound")
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/branch/{enc}", b"{}", JSON), 400, text="Invalid branch")
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/branch/new", json.dumps({"startingPoint": rev}).encode(),
                         JSON), 404, "RevisionNotFound")


@pytest.mark.parametrize("path, text", [
    ("build/" + "a" * 300 + ".py", "longer than 255 bytes"),  # the client's cache cannot hold the file (ENAMETOOLONG)
    ("build/" + "\u00e9" * 128, "longer than 255 bytes"),  # 256 bytes in UTF-8
    ("a/" * 2000 + "x", "longer than 1024 bytes"),  # deep paths made huggingface_hub recurse out of stack
    ("a/" * 64 + "x", "more than 64 components"),
    (" ", "white space"), ("build/ /x", "white space"), ("build/x ", "white space"), (" build/x", "white space"),
    (".git ", ".git"), ("build/.git./hooks/x", ".git"), ("build/.GIT/x", ".git"),
    ("...", "all-dots"), ("build/.../x", "all-dots"),
])
def test_paths_the_clients_cannot_use_are_refused(hub, krepo, path, text):
    _assert_error(_commit(hub, commit_ndjson(HDR, file_item(path, b"x"))), 400, text=text)
    body = json.dumps({"files": [{"path": path, "sample": "", "size": 1}]}).encode()
    _assert_error(_write(hub, "POST", f"/api/kernels/{REPO}/preupload/v1", body, JSON), 400, text="Invalid path")


@pytest.mark.parametrize("name", ["@", "v1/@", "x" * 201, "a/" + "b" * 201, "é" * 101])
def test_ref_names_the_clients_cannot_use_are_refused(hub, krepo, name):
    _assert_ref_name_refused(hub, name)


@pytest.mark.parametrize("org", ["api", "API", "kernels", "datasets", "spaces", "models", "organizations"])
@pytest.mark.parametrize("repo_type", ["model", "kernel"])
def test_namespaces_the_urls_use_are_reserved(hub, krepo, org, repo_type):
    """A model repo api/x would have file URLs /api/x/resolve/..., which are API routes: it could be created but
    not downloaded. The Hub reserves these names for every repo type; so does this server."""
    body = json.dumps({"name": "x", "organization": org, "type": repo_type}).encode()
    _assert_error(_write(hub, "POST", "/api/repos/create", body, JSON), 400, text="it is reserved")
    assert not (hub.root / f"{repo_type}s" / org).exists()


def test_two_servers_creating_the_same_repos(hub, krepo):
    """Two server processes on one root get the same create requests at the same moment: each repo is created
    once (200) and refused once (409), never a 500 (it was ENOTEMPTY), and no staging directory stays behind."""
    import threading

    from kerneltools.hub import HubProcess

    other = HubProcess(hub.root, token=hub.token).start()
    try:
        names = [f"race{i}" for i in range(12)]
        statuses = {n: [] for n in names}
        barrier = threading.Barrier(2)

        def creator(url):
            for n in names:
                body = json.dumps({"name": n, "organization": TRUSTED_ORG, "type": "kernel"}).encode()
                barrier.wait()
                statuses[n].append(raw_request(url, "POST", "/api/repos/create", body, JSON, token=hub.token)[0])

        threads = [threading.Thread(target=creator, args=(u,)) for u in (hub.url, other.url)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        other.stop()
    assert all(sorted(v) == [200, 409] for v in statuses.values()), statuses
    assert [p.name for p in (hub.root / ".tmp").rglob("create-*")] == []
    for n in names:
        repo_state(hub, f"{TRUSTED_ORG}/{n}")  # complete and fsck-clean
