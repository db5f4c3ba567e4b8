"""The loopback Hub server through the real huggingface_hub client (and raw HTTP where the client hides details)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from toolhelpers import REPO_ROOT, WRITE_ORGS, git, raw_request, repo_state

REPO = "geglu-kernels/tiny"
K = dict(repo_type="kernel")


def _add(path: str, data: bytes) -> CommitOperationAdd:
    return CommitOperationAdd(path_in_repo=path, path_or_fileobj=data)


@pytest.fixture
def krepo(api):
    """A kernel repo with branch v1 holding build/torch-cpu/{a.py,sub/b.txt}."""
    api.create_repo(REPO, **K)
    api.create_branch(REPO, branch="v1", **K)
    api.create_commit(REPO, operations=[_add("build/torch-cpu/a.py", b"A = 1\n"),
                                        _add("build/torch-cpu/sub/b.txt", b"0123456789" * 10)],
                      commit_message="v1 build", revision="v1", **K)
    return REPO


def _blob_sha1(data: bytes) -> str:
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ---------------------------------------------------------------------------------------------------------- repos


def test_create_repo_conflict_and_exist_ok(api, hub):
    url = api.create_repo(REPO, **K)
    assert url == f"{hub.url}/kernels/{REPO}" and url.repo_type == "kernel" and url.repo_id == REPO
    assert api.create_repo(REPO, exist_ok=True, **K) == url
    with pytest.raises(HfHubHTTPError) as e:
        api.create_repo(REPO, **K)
    assert e.value.response.status_code == 409
    status, _, body = raw_request(hub.url, "POST", "/api/repos/create",
                                  json.dumps({"name": "tiny", "organization": "geglu-kernels", "type": "kernel"}).encode(),
                                  {"Content-Type": "application/json"}, token=hub.token)
    assert status == 409 and json.loads(body)["url"] == url
    # models and kernels are separate namespaces
    assert api.create_repo(REPO) == f"{hub.url}/{REPO}"


def test_repo_info_kernel_has_no_siblings_model_has(api, hub, krepo):
    info = api.kernel_info(REPO)
    main = api.list_repo_refs(REPO, **K).branches
    assert info.id == REPO and info.sha == {b.name: b.target_commit for b in main}["main"]
    assert not hasattr(info, "siblings")
    status, _, body = raw_request(hub.url, "GET", f"/api/kernels/{REPO}/revision/v1")
    data = json.loads(body)
    assert status == 200 and "siblings" not in data
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", data["lastModified"])
    assert api.repo_info(REPO, revision="v1", **K).sha == data["sha"]
    # encoded full ref name
    status, _, body = raw_request(hub.url, "GET", f"/api/kernels/{REPO}/revision/refs%2Fheads%2Fv1")
    assert json.loads(body)["sha"] == data["sha"]

    api.create_repo("geglu-kernels/m")
    api.upload_file(path_or_fileobj=b"x", path_in_repo="w.bin", repo_id="geglu-kernels/m")
    minfo = api.model_info("geglu-kernels/m")
    assert sorted(s.rfilename for s in minfo.siblings) == [".gitattributes", "w.bin"]


def test_unknown_repo_and_revision(api, krepo):
    with pytest.raises(RepositoryNotFoundError):
        api.kernel_info("geglu-kernels/nope")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info(REPO)  # exists as a kernel, not as a model
    with pytest.raises(RevisionNotFoundError):
        api.kernel_info(REPO, revision="v9")
    with pytest.raises(RevisionNotFoundError):
        api.kernel_info(REPO, revision="0" * 40)
    with pytest.raises(RevisionNotFoundError):
        list(api.list_repo_tree(REPO, revision="v9", **K))


# ---------------------------------------------------------------------------------------------------------- refs, tree


def test_refs_branches_and_tags(api, hub, krepo):
    refs = api.list_repo_refs(REPO, **K)
    assert {b.name for b in refs.branches} == {"main", "v1"} and refs.tags == [] and refs.converts == []
    v1 = {b.name: b for b in refs.branches}["v1"]
    assert v1.ref == "refs/heads/v1" and re.fullmatch(r"[0-9a-f]{40}", v1.target_commit)
    assert api.list_repo_refs(REPO, include_pull_requests=True, **K).pull_requests == []

    api.create_tag(REPO, tag="v1.0.0", revision="v1", **K)
    api.create_tag(REPO, tag="annotated", revision="v1", tag_message="release notes", **K)
    tags = {t.name: t.target_commit for t in api.list_repo_refs(REPO, **K).tags}
    assert tags == {"v1.0.0": v1.target_commit, "annotated": v1.target_commit}  # annotated tags are peeled
    with pytest.raises(HfHubHTTPError) as e:
        api.create_tag(REPO, tag="v1.0.0", revision="main", **K)
    assert e.value.response.status_code == 409
    api.create_tag(REPO, tag="v1.0.0", revision="main", exist_ok=True, **K)
    assert api.kernel_info(REPO, revision="v1.0.0").sha == v1.target_commit  # tag unchanged by exist_ok
    with pytest.raises(RevisionNotFoundError):
        api.create_tag(REPO, tag="t2", revision="nope", **K)
    api.delete_tag(REPO, tag="v1.0.0", **K)
    assert {t.name for t in api.list_repo_refs(REPO, **K).tags} == {"annotated"}
    with pytest.raises(RevisionNotFoundError):
        api.delete_tag(REPO, tag="v1.0.0", **K)


def test_branches_create_delete_starting_point(api, krepo):
    heads = {b.name: b.target_commit for b in api.list_repo_refs(REPO, **K).branches}
    api.create_branch(REPO, branch="from-v1", revision="v1", **K)
    api.create_branch(REPO, branch="from-sha", revision=heads["v1"], **K)
    api.create_branch(REPO, branch="nested/name", **K)  # default start: main
    heads2 = {b.name: b.target_commit for b in api.list_repo_refs(REPO, **K).branches}
    assert heads2["from-v1"] == heads2["from-sha"] == heads["v1"] and heads2["nested/name"] == heads["main"]
    with pytest.raises(HfHubHTTPError) as e:
        api.create_branch(REPO, branch="v1", **K)
    assert e.value.response.status_code == 409
    api.create_branch(REPO, branch="v1", exist_ok=True, **K)
    assert {b.name: b.target_commit for b in api.list_repo_refs(REPO, **K).branches}["v1"] == heads["v1"]
    with pytest.raises(RevisionNotFoundError):
        api.create_branch(REPO, branch="x", revision="no-such-rev", **K)
    api.delete_branch(REPO, branch="nested/name", **K)
    api.delete_branch(REPO, branch="from-sha", **K)
    assert {b.name for b in api.list_repo_refs(REPO, **K).branches} == {"main", "v1", "from-v1"}
    with pytest.raises(RevisionNotFoundError):
        api.delete_branch(REPO, branch="from-sha", **K)
    with pytest.raises(HfHubHTTPError) as e:
        api.delete_branch(REPO, branch="main", **K)
    assert e.value.response.status_code == 403


def test_tree_listing(api, hub, krepo):
    sha = api.kernel_info(REPO, revision="v1").sha
    top = list(api.list_repo_tree(REPO, revision="v1", **K))
    assert {(type(e).__name__, e.path) for e in top} == {("RepoFile", ".gitattributes"), ("RepoFolder", "build")}
    everything = {e.path: e for e in api.list_repo_tree(REPO, revision="v1", recursive=True, **K)}
    assert set(everything) == {".gitattributes", "build", "build/torch-cpu", "build/torch-cpu/a.py",
                               "build/torch-cpu/sub", "build/torch-cpu/sub/b.txt"}
    a = everything["build/torch-cpu/a.py"]
    assert isinstance(a, RepoFile) and a.size == 6 and a.blob_id == _blob_sha1(b"A = 1\n")
    assert isinstance(everything["build/torch-cpu/sub"], RepoFolder) and everything["build/torch-cpu/sub"].tree_id
    # what kernels does: non-recursive listing of build at a sha, and with an encoded ref name
    variants = list(api.list_repo_tree(REPO, path_in_repo="build", revision=sha, **K))
    assert [(type(v).__name__, v.path) for v in variants] == [("RepoFolder", "build/torch-cpu")]
    status, _, body = raw_request(hub.url, "GET", f"/api/kernels/{REPO}/tree/refs%2Fheads%2Fv1/build?recursive=false")
    assert status == 200 and [e["path"] for e in json.loads(body)] == ["build/torch-cpu"]
    assert [e.path for e in api.list_repo_tree(REPO, path_in_repo="build/torch-cpu/sub", revision="v1", **K)] == \
        ["build/torch-cpu/sub/b.txt"]
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, path_in_repo="build/nope", revision="v1", **K))
    assert api.list_repo_files(REPO, revision="v1", **K) == [".gitattributes", "build/torch-cpu/a.py",
                                                              "build/torch-cpu/sub/b.txt"]
    infos = api.get_paths_info(REPO, ["build", "build/torch-cpu/a.py", "missing"], revision="v1", **K)
    assert [(type(i).__name__, i.path) for i in infos] == [("RepoFolder", "build"), ("RepoFile", "build/torch-cpu/a.py")]


# ---------------------------------------------------------------------------------------------------------- commits


def test_commit_adds_updates_deletes(api, krepo):
    before = api.kernel_info(REPO, revision="v1").sha
    info = api.create_commit(REPO, operations=[
        _add("build/torch-cpu/a.py", b"A = 2\n"),
        _add("build/torch-cuda/c.py", b"C\n"),
        CommitOperationDelete("build/torch-cpu/sub/"),  # a folder
    ], commit_message="second", commit_description="more words", revision="v1", **K)
    assert info.oid != before and info.commit_url.endswith(f"/kernels/{REPO}/commit/{info.oid}")
    assert api.list_repo_files(REPO, revision="v1", **K) == [".gitattributes", "build/torch-cpu/a.py",
                                                              "build/torch-cuda/c.py"]
    commits = api.list_repo_commits(REPO, revision="v1", **K)
    assert [c.title for c in commits] == ["second", "v1 build", "initial commit"]
    assert commits[0].commit_id == info.oid and "more words" in commits[0].message
    api.create_commit(REPO, operations=[CommitOperationDelete("build/torch-cuda/c.py")], commit_message="rm",
                      revision="v1", **K)
    assert "build/torch-cuda/c.py" not in api.list_repo_files(REPO, revision="v1", **K)
    with pytest.raises(EntryNotFoundError):  # nothing to delete: refused, nothing committed
        api.create_commit(REPO, operations=[CommitOperationDelete("build/torch-cuda/c.py")], commit_message="rm",
                          revision="v1", **K)
    assert len(api.list_repo_commits(REPO, revision="v1", **K)) == 4
    # main never moved
    assert api.list_repo_files(REPO, **K) == [".gitattributes"]


def test_commit_to_missing_branch_or_tag_is_refused(api, krepo):
    with pytest.raises(RevisionNotFoundError):
        api.create_commit(REPO, operations=[_add("x", b"x")], commit_message="x", revision="v7", **K)
    api.create_tag(REPO, tag="t", revision="v1", **K)
    with pytest.raises(HfHubHTTPError) as e:
        api.create_commit(REPO, operations=[_add("x", b"x")], commit_message="x", revision="t", **K)
    assert e.value.response.status_code == 400 and "branch" in str(e.value)


def test_parent_commit(api, krepo):
    head = api.kernel_info(REPO, revision="v1").sha
    new = api.create_commit(REPO, operations=[_add("n1", b"1")], commit_message="n1", revision="v1",
                            parent_commit=head, **K).oid
    with pytest.raises(HfHubHTTPError) as e:  # stale parent: refused, not merged
        api.create_commit(REPO, operations=[_add("n2", b"2")], commit_message="n2", revision="v1",
                          parent_commit=head, **K)
    assert e.value.response.status_code == 412
    assert api.kernel_info(REPO, revision="v1").sha == new
    assert "n2" not in api.list_repo_files(REPO, revision="v1", **K)
    api.create_commit(REPO, operations=[_add("n2", b"2")], commit_message="n2", revision="v1",
                      parent_commit=new[:7], **K)  # short shas are accepted
    assert "n2" in api.list_repo_files(REPO, revision="v1", **K)


def test_preupload_regular_with_current_oid(hub, krepo):
    body = {"files": [{"path": "build/torch-cpu/a.py", "sample": "", "size": 6},
                      {"path": "new.bin", "sample": "", "size": 50_000_000}]}
    status, _, raw = raw_request(hub.url, "POST", f"/api/kernels/{REPO}/preupload/v1", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, token=hub.token)
    files = {f["path"]: f for f in json.loads(raw)["files"]}
    assert status == 200
    assert files["build/torch-cpu/a.py"] == {"path": "build/torch-cpu/a.py", "uploadMode": "regular",
                                             "shouldIgnore": False, "oid": _blob_sha1(b"A = 1\n")}
    assert files["new.bin"]["uploadMode"] == "regular" and files["new.bin"]["oid"] is None


def test_unchanged_file_is_skipped_by_client(api, krepo):
    head = api.kernel_info(REPO, revision="v1").sha
    info = api.create_commit(REPO, operations=[_add("build/torch-cpu/a.py", b"A = 1\n")], commit_message="same",
                             revision="v1", **K)
    assert info.oid == head  # the client saw the oid from preupload and made no empty commit


def test_upload_folder_and_file(api, tmp_path, krepo):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "x.py").write_text("x")
    (src / "big.so").write_bytes(bytes(range(256)) * 40_000)  # 10 MB: still a plain blob, no LFS/Xet
    api.upload_folder(repo_id=REPO, folder_path=src, path_in_repo="build/torch-universal", revision="v1",
                      commit_message="folder", **K)
    api.upload_file(path_or_fileobj=b"hello", path_in_repo="README.md", repo_id=REPO, **K)
    files = {e.path: e for e in api.list_repo_tree(REPO, revision="v1", recursive=True, **K)}
    assert files["build/torch-universal/big.so"].size == 10_240_000 and files["build/torch-universal/big.so"].lfs is None
    assert "build/torch-universal/d/x.py" in files
    assert api.list_repo_files(REPO, **K) == [".gitattributes", "README.md"]


# ---------------------------------------------------------------------------------------------------------- downloads


def test_resolve_head_get_and_errors(hub, krepo):
    sha = HfApi(endpoint=hub.url, token=False).kernel_info(REPO, revision="v1").sha
    data = b"0123456789" * 10
    for method in ("HEAD", "GET"):
        status, h, body = raw_request(hub.url, method, f"/kernels/{REPO}/resolve/v1/build/torch-cpu/sub/b.txt")
        assert status == 200 and h["ETag"] == f'"{_blob_sha1(data)}"' and h["X-Repo-Commit"] == sha
        assert h["Content-Length"] == "100" and body == (data if method == "GET" else b"")
    status, h, _ = raw_request(hub.url, "HEAD", f"/kernels/{REPO}/resolve/refs%2Fheads%2Fv1/build/torch-cpu/a.py")
    assert status == 200 and h["X-Repo-Commit"] == sha
    status, h, _ = raw_request(hub.url, "HEAD", f"/kernels/{REPO}/resolve/v1/missing.py")
    assert status == 404 and h["X-Error-Code"] == "EntryNotFound" and h["X-Repo-Commit"] == sha
    status, h, _ = raw_request(hub.url, "GET", f"/kernels/{REPO}/resolve/v1/build")  # a folder is no file
    assert status == 404 and h["X-Error-Code"] == "EntryNotFound"
    status, h, _ = raw_request(hub.url, "GET", f"/kernels/{REPO}/resolve/v9/build/torch-cpu/a.py")
    assert status == 404 and h["X-Error-Code"] == "RevisionNotFound"
    status, h, _ = raw_request(hub.url, "GET", "/kernels/geglu-kernels/nope/resolve/main/a")
    assert status == 404 and h["X-Error-Code"] == "RepoNotFound"


def test_range_requests(hub, krepo, tmp_path):
    data = b"0123456789" * 10
    url_path = f"/kernels/{REPO}/resolve/v1/build/torch-cpu/sub/b.txt"
    status, h, body = raw_request(hub.url, "GET", url_path, headers={"Range": "bytes=95-"})
    assert status == 206 and body == data[95:] and h["Content-Range"] == "bytes 95-99/100"
    assert h["Content-Length"] == "5"
    status, h, body = raw_request(hub.url, "GET", url_path, headers={"Range": "bytes=10-19"})
    assert status == 206 and body == data[10:20]
    status, h, body = raw_request(hub.url, "GET", url_path, headers={"Range": "bytes=-3"})
    assert status == 206 and body == data[-3:]
    status, h, _ = raw_request(hub.url, "GET", url_path, headers={"Range": "bytes=100-"})
    assert status == 416 and h["Content-Range"] == "bytes */100"
    # the client's own resume path (http_get with resume_size sends Range: bytes=N-)
    from huggingface_hub.file_download import http_get

    with open(tmp_path / "part", "wb") as f:
        f.write(data[:40])
        http_get(f"{hub.url}{url_path}", f, resume_size=40, expected_size=100)
    assert (tmp_path / "part").read_bytes() == data


def test_hf_hub_download_and_snapshot(hub, krepo, tmp_path):
    api = HfApi(endpoint=hub.url, token=False)
    sha = api.kernel_info(REPO, revision="v1").sha
    p = hf_hub_download(REPO, "build/torch-cpu/a.py", revision="v1", cache_dir=tmp_path / "c", endpoint=hub.url, **K)
    assert Path(p).read_bytes() == b"A = 1\n" and f"/snapshots/{sha}/" in p
    blob = Path(p).resolve()
    assert blob.name == _blob_sha1(b"A = 1\n")  # the ETag names the cache blob
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "nope.py", revision="v1", cache_dir=tmp_path / "c", endpoint=hub.url, **K)
    snap = Path(snapshot_download(REPO, revision="v1", cache_dir=tmp_path / "c", endpoint=hub.url, **K))
    assert snap.name == sha
    assert sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()) == [
        ".gitattributes", "build/torch-cpu/a.py", "build/torch-cpu/sub/b.txt"]
    assert (tmp_path / "c" / "kernels--geglu-kernels--tiny" / "refs" / "v1").read_text() == sha


# ---------------------------------------------------------------------------------------------------------- misc API


def test_org_overview_trust(api, hub, krepo):
    assert api.get_organization_overview("geglu-kernels").trustedKernelPublisher is True
    api.create_repo("other-org/x", **K)
    assert api.get_organization_overview("other-org").trustedKernelPublisher is False
    with pytest.raises(HfHubHTTPError) as e:
        api.get_organization_overview("no-such-org")
    assert e.value.response.status_code == 404


def test_validate_yaml_whoami_agent_harnesses(hub):
    api = HfApi(endpoint=hub.url, token=hub.token)
    api._validate_yaml("---\nlicense: apache-2.0\n---\n# card\n", repo_type="kernel")
    with pytest.raises(ValueError, match="Invalid metadata"):
        api._validate_yaml("---\nlicense: [unclosed\n---\n", repo_type="kernel")
    me = api.whoami()  # the truth: who the token belongs to, its orgs with their roles, the token's role
    assert (me["name"], me["type"]) == ("publisher", "user")
    assert [(o["name"], o["roleInOrg"]) for o in me["orgs"]] == sorted((o, "write") for o in WRITE_ORGS)
    assert me["auth"]["accessToken"] == {"displayName": "serve_hub", "role": "write"}
    status, h, body = raw_request(hub.url, "GET", "/api/agent-harnesses")
    assert status == 404 and "error" in json.loads(body)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kerneltools", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=60)


def test_serve_cli_with_owner_set_tokens_roles_and_trust(tmp_path):
    """The owner's CLI path: hub-auth sets trust, membership and a token; serve prints its URL; changes made with
    hub-auth while it runs apply at once; nothing is trusted or writable by default."""
    root = str(tmp_path / "r")
    assert _cli("hub-auth", "--root", root, "member", "geglu-kernels", "alice", "--role", "write").returncode == 0
    token = _cli("hub-auth", "--root", root, "token", "alice", "--name", "ci").stdout.strip()
    assert re.fullmatch(r"hf_[A-Za-z0-9]{34}", token)
    assert token not in (tmp_path / "r" / "hub-auth.json").read_text()  # stored hashed only
    proc = subprocess.Popen([sys.executable, "-m", "kerneltools", "serve", "--root", root, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        url = proc.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        api = HfApi(endpoint=url, token=token)
        assert api.get_organization_overview("geglu-kernels").trustedKernelPublisher is False
        api.create_repo(REPO, **K)
        assert _cli("hub-auth", "--root", root, "trust", "geglu-kernels").returncode == 0
        assert api.get_organization_overview("geglu-kernels").trustedKernelPublisher is True
        assert _cli("hub-auth", "--root", root, "revoke", "ci").returncode == 0
        with pytest.raises(HfHubHTTPError, match="Invalid credentials in Authorization header") as e:
            api.create_branch(REPO, branch="v1", **K)
        assert e.value.response.status_code == 401
        shown = json.loads(_cli("hub-auth", "--root", root, "show").stdout)
        assert shown["users"] == {"alice": {"orgs": {"geglu-kernels": "write"}}} and shown["tokens"] == []
    finally:
        proc.terminate()
        assert proc.wait(10) == 0  # SIGTERM is a clean shutdown


# ---------------------------------------------------------------------------------------------------------- durability


def test_restart_keeps_everything(api, hub, krepo, tmp_path):
    api.create_tag(REPO, tag="keep", revision="v1", **K)
    before = api.list_repo_refs(REPO, **K)
    files = api.list_repo_files(REPO, revision="v1", **K)
    old_url = hub.url
    hub.restart()
    assert hub.url == old_url
    assert api.list_repo_refs(REPO, **K) == before
    assert api.list_repo_files(REPO, revision="v1", **K) == files
    hub.kill()  # a crash, not a clean stop
    hub.start()
    p = hf_hub_download(REPO, "build/torch-cpu/a.py", revision="keep", cache_dir=tmp_path / "c2", endpoint=hub.url,
                        **K)
    assert Path(p).read_bytes() == b"A = 1\n"
    assert api.list_repo_refs(REPO, **K) == before


def test_crash_before_publishing_a_commit_leaves_nothing_visible(api, hub, krepo):
    """The server dies after writing the commit's objects but before moving the branch: nothing is visible."""
    import httpx2  # huggingface_hub 2.x's HTTP client

    before = repo_state(hub, REPO)
    hub.restart(env={"KERNELTOOLS_HUB_CRASH_AT": "before-update-ref"})
    with pytest.raises(httpx2.RemoteProtocolError, match="Server disconnected without sending a response"):
        api.create_commit(REPO, operations=[_add("build/torch-cpu/a.py", b"A = 3\n")], commit_message="doomed",
                          revision="v1", **K)
    assert hub.wait_exit() == 137
    hub.start(env={})
    assert repo_state(hub, REPO) == before
    assert [c.title for c in api.list_repo_commits(REPO, revision="v1", **K)] == ["v1 build", "initial commit"]


# ---------------------------------------------------------------------------------------------------------- races


def _run_threads(n, fn):
    barrier = threading.Barrier(n)
    results, errors = [None] * n, [None] * n

    def run(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - collected and asserted on
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_race_without_parent_commit_keeps_every_commit(hub, krepo):
    n, per = 2, 6

    def worker(i):
        api = HfApi(endpoint=hub.url, token=hub.token)
        return [api.create_commit(REPO, operations=[_add(f"t{i}/f{j}", f"{i}-{j}".encode())],
                                  commit_message=f"t{i} c{j}", revision="v1", **K).oid for j in range(per)]

    results, errors = _run_threads(n, worker)
    assert errors == [None] * n
    api = HfApi(endpoint=hub.url, token=False)
    files = set(api.list_repo_files(REPO, revision="v1", **K))
    assert {f"t{i}/f{j}" for i in range(n) for j in range(per)} <= files
    history = [c.commit_id for c in api.list_repo_commits(REPO, revision="v1", **K)]
    assert len(history) == 2 + n * per and set(sum(results, [])) <= set(history)


def test_race_with_same_parent_commit_one_wins_one_412(hub, krepo):
    api0 = HfApi(endpoint=hub.url, token=hub.token)
    for round_ in range(3):
        head = api0.kernel_info(REPO, revision="v1").sha

        def worker(i):
            api = HfApi(endpoint=hub.url, token=hub.token)
            return api.create_commit(REPO, operations=[_add(f"r{round_}/w{i}", b"x")], commit_message=f"w{i}",
                                     revision="v1", parent_commit=head, **K).oid

        results, errors = _run_threads(2, worker)
        ok = [i for i in range(2) if errors[i] is None]
        failed = [i for i in range(2) if errors[i] is not None]
        assert len(ok) == 1 and len(failed) == 1, errors
        assert errors[failed[0]].response.status_code == 412
        files = set(api0.list_repo_files(REPO, revision="v1", **K))
        assert f"r{round_}/w{ok[0]}" in files and f"r{round_}/w{failed[0]}" not in files
        assert api0.kernel_info(REPO, revision="v1").sha == results[ok[0]]


def test_compare_and_swap_when_branch_moves_mid_commit(tmp_path, monkeypatch):
    """Deterministic: a writer outside the server (plain git, no writer lock) moves the branch between our building
    the commit and publishing it."""
    from kerneltools.hub import storage
    from kerneltools.hub.errors import HubError
    from kerneltools.hub.storage import CommitOp, GitStore

    store = GitStore(tmp_path / "s")
    store.create("kernel", REPO, "test")
    repo = store.open("kernel", REPO)
    blob_a, blob_b = repo.write_blobs([_write(tmp_path / "a", b"a"), _write(tmp_path / "b", b"b")])
    interloper = []

    def outside_commit():
        head = git(repo.path, "rev-parse", "refs/heads/main").strip()
        tree = git(repo.path, "mktree", input=git(repo.path, "ls-tree", head) + f"100644 blob {blob_b}\tb\n").strip()
        new = git(repo.path, "commit-tree", "-p", head, "-m", "interloper", tree).strip()
        git(repo.path, "update-ref", "refs/heads/main", new, head)
        return new

    def sneak_in(point):
        if point == "before-update-ref" and not interloper:
            interloper.append(outside_commit())

    monkeypatch.setattr(storage, "maybe_crash", sneak_in)
    head0 = repo.resolve("main")
    with pytest.raises(HubError) as e:
        repo.commit("main", [CommitOp("add", "a", blob_a)], "ours", parent_commit=head0)
    assert e.value.status == 412 and repo.resolve("main") == interloper[0]

    interloper.clear()
    ours = repo.commit("main", [CommitOp("add", "a", blob_a)], "ours again")
    assert git(repo.path, "rev-parse", f"{ours}^").strip() == interloper[0]  # rebuilt on the new head
    assert set(repo.all_files(ours)) == {".gitattributes", "a", "b"}


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_second_server_on_same_root_keeps_first_servers_scratch(tmp_path):
    import os

    from kerneltools.hub.storage import GitStore

    live = tmp_path / "s" / ".tmp" / f"pid-{os.getppid()}"  # a running process
    dead = tmp_path / "s" / ".tmp" / "pid-999999999"  # no such process: a crashed server's leftovers
    for d in (live, dead):
        d.mkdir(parents=True)
        (d / "index-x").write_text("x")
    GitStore(tmp_path / "s")
    assert (live / "index-x").exists() and not dead.exists()
