"""Who may do what on the loopback Hub (kerneltools/hub/auth.py): tokens, roles, trust, cross-site writes.

One server for the module; the owner's setup (kerneltools.hub.auth, as `python -m kerneltools hub-auth` does):
- `publisher` (serve_hub's token): write in geglu-kernels, the trusted org;
- `mallory`: a write token, but only the read role in geglu-kernels and write in her own org `mallory-org`;
- `reader`: a read-only token, admin of geglu-kernels (the token's role limits it, not the org role).
Every refused write leaves the repos unchanged (git fsck clean, same refs)."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError

from toolhelpers import TRUSTED_ORG, commit_ndjson, file_item, raw_request, repo_state
from kerneltools.hub import auth, serve_hub

REPO = f"{TRUSTED_ORG}/geglu"
K = dict(repo_type="kernel")
JSON = {"Content-Type": "application/json"}
NDJSON = {"Content-Type": "application/x-ndjson"}
EVIL_INIT = b"import os\nos.system('echo owned')\n"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth") / "hub"
    with serve_hub(root, trusted_orgs=[TRUSTED_ORG]) as h:
        auth.set_member(root, TRUSTED_ORG, "mallory", "read")
        auth.set_member(root, "mallory-org", "mallory", "write")
        h.mallory = auth.create_token(root, "mallory", name="mallory-write", role="write")
        auth.set_member(root, TRUSTED_ORG, "reader", "admin")
        h.reader = auth.create_token(root, "reader", name="reader-read", role="read")
        api = HfApi(endpoint=h.url, token=h.token)
        api.create_repo(REPO, **K)
        api.create_branch(REPO, branch="v1", **K)
        api.create_commit(REPO, operations=[CommitOperationAdd("build/torch-cpu/__init__.py", b"X = 1\n")],
                          commit_message="v1", revision="v1", **K)
        api.create_tag(REPO, tag="t1", revision="v1", **K)
        yield h


@pytest.fixture
def unchanged(hub):
    """Whatever the test sends, the repo's refs stay as they were and fsck stays clean."""
    before = repo_state(hub, REPO)
    yield
    assert repo_state(hub, REPO) == before


def _host(hub) -> str:
    return urlsplit(hub.url).netloc


WRITES = [  # (method, path, body, content type): every write route of the server
    ("POST", "/api/repos/create", json.dumps({"name": "new", "organization": TRUSTED_ORG, "type": "kernel"}), JSON),
    ("POST", f"/api/kernels/{REPO}/preupload/v1", json.dumps({"files": [{"path": "a", "sample": "", "size": 1}]}),
     JSON),
    ("POST", f"/api/kernels/{REPO}/commit/v1",
     commit_ndjson({"summary": "evil"}, file_item("build/torch-cpu/__init__.py", EVIL_INIT)).decode(), NDJSON),
    ("POST", f"/api/kernels/{REPO}/branch/evil", "{}", JSON),
    ("DELETE", f"/api/kernels/{REPO}/branch/v1", None, {}),
    ("POST", f"/api/kernels/{REPO}/tag/v1", json.dumps({"tag": "evil"}), JSON),
    ("DELETE", f"/api/kernels/{REPO}/tag/t1", None, {}),
]


def _send(hub, write, token=None, headers=None):
    method, path, body, ctype = write
    return raw_request(hub.url, method, path, body.encode() if body is not None else None, {**ctype, **(headers or {})},
                       token=token)


def _refused(resp, status: int, code: str, text: str) -> None:
    got, headers, body = resp
    assert got == status, body
    assert headers["X-Error-Code"] == code and text in headers["X-Error-Message"], dict(headers)
    assert text in json.loads(body)["error"]


@pytest.mark.parametrize("write", WRITES, ids=[f"{w[0]} {w[1].split('/')[-2]}/{w[1].split('/')[-1]}" for w in WRITES])
def test_writes_need_a_write_token_with_a_write_role(hub, unchanged, write):
    _refused(_send(hub, write), 401, "Unauthorized", "You must be authenticated")
    assert _send(hub, write)[1]["WWW-Authenticate"].startswith("Bearer")
    for bogus in ("hf_bogus", hub.token + "x", ""):
        _refused(_send(hub, write, headers={"Authorization": f"Bearer {bogus}"}), 401, "Unauthorized",
                 "Invalid credentials in Authorization header")
    _refused(_send(hub, write, headers={"Authorization": f"Basic {hub.token}"}), 401, "Unauthorized",
             "Invalid credentials in Authorization header")
    _refused(_send(hub, write, hub.reader), 403, "Forbidden", "'reader-read' of reader is read-only")
    _refused(_send(hub, write, hub.mallory), 403, "Forbidden", f"they have role 'read' in '{TRUSTED_ORG}'")


def test_the_replaced_build_attack_is_refused(hub, unchanged):
    """Another local user commits a replacement build/torch-cpu/__init__.py to the trusted org's v1."""
    api = HfApi(endpoint=hub.url, token=hub.mallory)
    with pytest.raises(HfHubHTTPError, match="may not write to 'geglu-kernels/geglu'") as e:
        api.upload_file(path_or_fileobj=EVIL_INIT, path_in_repo="build/torch-cpu/__init__.py", repo_id=REPO,
                        revision="v1", **K)
    assert e.value.response.status_code == 403
    for anonymous in (HfApi(endpoint=hub.url, token=False),):
        with pytest.raises(HfHubHTTPError) as e:
            anonymous.delete_branch(REPO, branch="v1", **K)
        assert e.value.response.status_code == 401


def test_own_namespace_and_org_roles(hub):
    """A write token writes the user's own namespace and orgs where the user has write (or admin)."""
    api = HfApi(endpoint=hub.url, token=hub.mallory)
    assert api.create_repo("mallory/k", **K).repo_id == "mallory/k"
    assert api.create_repo("mallory-org/k", **K).repo_id == "mallory-org/k"
    sha = api.create_commit("mallory-org/k", operations=[CommitOperationAdd("a", b"a")], commit_message="m",
                            **K).oid
    assert api.list_repo_commits("mallory-org/k", **K)[0].authors == ["mallory"]  # the token's user commits
    log = (hub.root / "kernels" / "mallory-org" / "k.git" / "hub-audit.log").read_text().splitlines()
    assert [json.loads(line)["user"] for line in log] == ["mallory", "mallory"] and sha in log[-1]
    created = HfApi(endpoint=hub.url, token=hub.mallory).create_repo("k2", **K)  # no namespace: the user's own
    assert created.repo_id == "mallory/k2"
    with pytest.raises(HfHubHTTPError, match="they have no role in 'other-org'") as e:
        api.create_repo("other-org/k", **K)
    assert e.value.response.status_code == 403


def test_whoami_tells_the_truth(hub):
    assert HfApi(endpoint=hub.url, token=hub.mallory).whoami() == {
        "type": "user", "id": "mallory", "name": "mallory", "fullname": "mallory", "email": None,
        "emailVerified": False, "isPro": False, "canPay": False, "avatarUrl": "",
        "orgs": [{"type": "org", "name": TRUSTED_ORG, "fullname": TRUSTED_ORG, "roleInOrg": "read", "avatarUrl": "",
                  "isEnterprise": False},
                 {"type": "org", "name": "mallory-org", "fullname": "mallory-org", "roleInOrg": "write",
                  "avatarUrl": "", "isEnterprise": False}],
        "auth": {"type": "access_token", "accessToken": {"displayName": "mallory-write", "role": "write"}}}
    me = HfApi(endpoint=hub.url, token=hub.reader).whoami()
    assert [(o["name"], o["roleInOrg"]) for o in me["orgs"]] == [(TRUSTED_ORG, "admin")]
    assert me["auth"]["accessToken"]["role"] == "read"
    with pytest.raises(HfHubHTTPError, match="Invalid user token") as e:  # huggingface_hub's wording of a 401
        HfApi(endpoint=hub.url, token="hf_bogus").whoami()
    assert e.value.response.status_code == 401
    _refused(raw_request(hub.url, "GET", "/api/whoami-v2"), 401, "Unauthorized", "Invalid username or password.")


def test_reads_are_anonymous_but_a_bad_token_is_refused(hub):
    assert raw_request(hub.url, "GET", f"/api/kernels/{REPO}/refs")[0] == 200
    assert raw_request(hub.url, "GET", f"/api/kernels/{REPO}/refs", token=hub.reader)[0] == 200
    _refused(raw_request(hub.url, "GET", f"/kernels/{REPO}/resolve/v1/build/torch-cpu/__init__.py",
                         token="hf_bogus"), 401, "Unauthorized", "Invalid credentials")


def test_trust_is_set_by_the_owner_only(hub):
    """No HTTP call grants trust or creates a token: the plausible ones are all 4xx and the file is untouched."""
    before = (hub.root / auth.AUTH_FILE).read_bytes()
    attempts = [("POST", "/api/organizations/mallory-org/overview"), ("PUT", "/api/organizations/mallory-org/overview"),
                ("POST", "/api/organizations/mallory-org/settings"), ("POST", "/api/settings/tokens"),
                ("PUT", "/api/whoami-v2"), ("POST", "/api/whoami-v2"), ("POST", "/api/organizations/mallory-org"),
                ("PUT", f"/api/kernels/{REPO}/settings"), ("POST", "/api/settings/trusted-publishers")]
    body = json.dumps({"trustedKernelPublisher": True, "role": "write", "user": "mallory"}).encode()
    for method, path in attempts:
        for token in (None, hub.mallory, hub.token):
            status = raw_request(hub.url, method, path, body, JSON, token=token)[0]
            assert 400 <= status < 500, (method, path, status)
    assert (hub.root / auth.AUTH_FILE).read_bytes() == before
    assert HfApi(endpoint=hub.url).get_organization_overview("mallory-org").trustedKernelPublisher is False
    assert HfApi(endpoint=hub.url).get_organization_overview(TRUSTED_ORG).trustedKernelPublisher is True


@pytest.mark.parametrize("headers, text", [
    ({"Content-Type": "text/plain"}, "Content-Type 'text/plain'"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, "Content-Type"),
    ({"Origin": "http://evil.example"}, "Cross-site write refused: Origin 'http://evil.example'"),
    ({"Host": "evil.example:80"}, "Host 'evil.example:80' is not this server's address"),
])
def test_cross_site_writes_are_refused_even_with_a_token(hub, unchanged, headers, text):
    """What a web page could make a browser send (with a token in hand, at worst): refused before any effect."""
    for write in WRITES:
        if write[2] is None and "Content-Type" in headers:
            continue  # no body, no content type to check
        _refused(_send(hub, write, hub.token, headers), 403, "Forbidden", text)


def test_urls_come_from_the_server_not_the_host_header(hub):
    """A client that reaches the server as localhost gets the server's own URLs back (the Host is never echoed)."""
    port = urlsplit(hub.url).port
    body = json.dumps({"name": "via-localhost", "organization": TRUSTED_ORG, "type": "kernel"}).encode()
    status, _, reply = raw_request(hub.url, "POST", "/api/repos/create", body,
                                   {**JSON, "Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"},
                                   token=hub.token)
    assert status == 200 and json.loads(reply)["url"] == f"{hub.url}/kernels/{TRUSTED_ORG}/via-localhost"


def test_token_gated_reads(tmp_path):
    with serve_hub(tmp_path / "hub", reads="token") as hub:
        HfApi(endpoint=hub.url, token=hub.token).create_repo(REPO, **K)
        for path in (f"/api/kernels/{REPO}/refs", f"/kernels/{REPO}/resolve/main/.gitattributes",
                     f"/api/organizations/{TRUSTED_ORG}/overview"):
            _refused(raw_request(hub.url, "GET", path), 401, "Unauthorized", "only serves authenticated reads")
            assert raw_request(hub.url, "GET", path, token=hub.token)[0] == 200
        assert HfApi(endpoint=hub.url, token=hub.token).list_repo_files(REPO, **K) == [".gitattributes"]


def test_a_broken_auth_file_fails_closed(tmp_path):
    with serve_hub(tmp_path / "hub") as hub:
        (hub.root / auth.AUTH_FILE).write_text("{not json")
        _refused(raw_request(hub.url, "GET", f"/api/kernels/{REPO}/refs", token=hub.token), 503, "ServiceUnavailable",
                 "access configuration is broken")
        hub.stop()
        with pytest.raises(RuntimeError, match="hub-auth.json: cannot be read as JSON"):
            hub.start()


def test_owner_cli_refuses_mixups(tmp_path):
    root = tmp_path / "r"
    auth.set_member(root, "org-a", "bob", "write")
    with pytest.raises(auth.AuthFileError, match="'org-a' is an organization here"):
        auth.create_token(root, "org-a")
    with pytest.raises(auth.AuthFileError, match="'bob' is a user here"):
        auth.set_member(root, "bob", "carol", "write")
    auth.create_token(root, "bob", name="ci")
    with pytest.raises(auth.AuthFileError, match="A token named 'ci' exists"):
        auth.create_token(root, "bob", name="ci")
    assert auth.revoke_token(root, "ci") == 1 and auth.revoke_token(root, "ci") == 0
    from kerneltools.hub.errors import HubError

    with pytest.raises(HubError, match="Invalid user name 'api': it is reserved"):
        auth.create_token(root, "api")
