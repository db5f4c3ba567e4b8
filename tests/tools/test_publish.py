"""kerneltools.publish against the loopback server, checked with the real kernels loader (in subprocesses)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, HfApi

from toolhelpers import (
    REPO_ROOT,
    TRUSTED_ORG,
    git,
    kernels_env,
    make_project,
    make_variant,
    repo_dir,
    run_cli,
    run_kernels,
)
from kerneltools.publish import PublishError, publish

REPO = f"{TRUSTED_ORG}/tiny"
K = dict(repo_type="kernel")


def _heads(api, repo=REPO):
    return {b.name: b.target_commit for b in api.list_repo_refs(repo, **K).branches}


def _files(api, rev, repo=REPO):
    return {e.path: e.blob_id for e in api.list_repo_tree(repo, revision=rev, recursive=True, **K)
            if hasattr(e, "blob_id")}


def _project(tmp_path, version=1, sha="abc1234", marker="", variants=("torch-cpu",), name="p", **kw):
    build = make_project(tmp_path / f"{name}{version}{sha}", version=version, **kw)
    for v in variants:
        make_variant(build, v, version=version, sha=sha, marker=marker,
                     backend=v.split("-", 1)[1] if v.startswith("torch-") else "cpu")
    return build


LOAD = """
    from kernels import get_kernel
    import torch

    def describe(k):
        return [k.VERSION, k.MARKER, k.tiny_add(2, 3), k.layers.TinyDouble()(torch.ones(2)).tolist(), k.__name__]
"""


def test_publish_two_versions_and_load_each(api, hub, tmp_path):
    r1 = publish(_project(tmp_path, 1, "abc1234", "one"), endpoint=hub.url, progress=False)
    assert (r1.repo_id, r1.version, r1.branch, r1.variants) == (REPO, 1, "v1", ["torch-cpu"])
    v1_head = _heads(api)["v1"]
    assert r1.commit == v1_head
    r2 = publish(_project(tmp_path, 2, "def5678", "two"), endpoint=hub.url, progress=False)
    heads = _heads(api)
    assert heads["v1"] == v1_head and heads["v2"] == r2.commit
    assert not [b for b in heads if b.startswith("tmp-publish")]  # temporary branches cleaned up

    out = run_kernels(hub.url, tmp_path, LOAD + """
    out["v1"] = describe(get_kernel("geglu-kernels/tiny", version=1))
    out["v2"] = describe(get_kernel("geglu-kernels/tiny", version=2))
    try:
        get_kernel("geglu-kernels/tiny", version=3)
    except ValueError as e:
        out["v3"] = str(e)
    """)
    assert out["v1"] == [1, "one", 5, [2.0, 2.0], "_tiny_cpu_abc1234"]
    assert out["v2"] == [2, "two", 5, [2.0, 2.0], "_tiny_cpu_def5678"]
    assert out["v3"] == "Version 3 not found, available versions: 1, 2"
    assert "You are using version 1 of 'geglu-kernels/tiny', but version 2 is available." in out["_stderr"]

    env = kernels_env(hub.url, tmp_path)
    kernels_cli = shutil.which("kernels", path=str(Path(sys.executable).parent)) or "kernels"
    r = run_cli([kernels_cli, "versions", REPO], env)
    assert r.returncode == 0, r.stderr
    assert "Version 1:" in r.stdout and "Version 2:" in r.stdout and "torch-cpu" in r.stdout
    r = run_cli([kernels_cli, "info", REPO, "--version", "1", "--json"], env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["repo_id"], info["revision"], info["name"], info["version"], info["backends"]) == \
        (REPO, "v1", "tiny", 1, ["cpu"])


def test_card_on_main(api, hub, tmp_path):
    publish(_project(tmp_path, 1, "abc1234", variants=("torch-cpu", "torch-cuda")), endpoint=hub.url,
            progress=False)
    readme = git(repo_dir(hub, REPO), "show", "main:README.md")
    assert readme.startswith("---\nlicense: apache-2.0\n")
    assert 'get_kernel("geglu-kernels/tiny", version=1)' in readme
    assert "| `torch-cpu` | cpu | any |" in readme and "| `torch-cuda` | cuda | any |" in readme
    assert "CUDA capabilities: 8.0, 9.0" in readme and "| 1 | `v1` | `torch-cpu`, `torch-cuda` |" in readme
    assert "README.md" not in _files(api, "v1")  # the card lives on main only
    publish(_project(tmp_path, 2, "def5678"), endpoint=hub.url, progress=False)
    readme = git(repo_dir(hub, REPO), "show", "main:README.md")
    assert 'version=2)' in readme and "| 1 | `v1` |" in readme and "| 2 | `v2` | `torch-cpu` |" in readme
    n = len(api.list_repo_commits(REPO, **K))
    publish(_project(tmp_path, 2, "def5678", name="again"), endpoint=hub.url, progress=False)
    assert len(api.list_repo_commits(REPO, **K)) == n  # same card: no new commit on main


def test_new_branch_starts_without_stale_build_files(api, hub, tmp_path):
    api.create_repo(REPO, **K)
    api.create_commit(REPO, operations=[CommitOperationAdd("build/torch-old/junk.py", b"stale"),
                                        CommitOperationAdd("build/torch-cpu/stale.py", b"stale"),
                                        CommitOperationAdd("NOTES.md", b"kept")],
                      commit_message="junk on main", **K)
    publish(_project(tmp_path), endpoint=hub.url, progress=False)
    files = _files(api, "v1")
    assert sorted(p for p in files if p.startswith("build/")) == [
        "build/torch-cpu/__init__.py", "build/torch-cpu/_ops.py", "build/torch-cpu/layers.py",
        "build/torch-cpu/metadata.json"]
    assert "NOTES.md" in files and ".gitattributes" in files  # branch made from main
    assert "build/torch-old/junk.py" in _files(api, "main")  # main itself is not touched (only its README)


def test_existing_branch_replaces_only_uploaded_variants(api, hub, tmp_path):
    b = make_project(tmp_path / "a")
    make_variant(b, "torch-cpu", marker="old", extra_files={"old_helper.py": "x = 1\n", "sub/data.txt": "d"})
    make_variant(b, "torch-cuda", backend="cuda")
    publish(b, endpoint=hub.url, progress=False)
    before = _files(api, "v1")
    b2 = make_project(tmp_path / "b")
    make_variant(b2, "torch-cpu", marker="new")
    r = publish(b2, endpoint=hub.url, progress=False)
    after = _files(api, "v1")
    assert r.variants == ["torch-cpu"]
    assert "build/torch-cpu/old_helper.py" not in after and "build/torch-cpu/sub/data.txt" not in after
    assert {p: o for p, o in after.items() if p.startswith("build/torch-cuda/")} == \
        {p: o for p, o in before.items() if p.startswith("build/torch-cuda/")}
    assert after["build/torch-cpu/__init__.py"] != before["build/torch-cpu/__init__.py"]
    assert [c.title for c in api.list_repo_commits(REPO, revision="v1", **K)][:2] == [
        "Upload torch-cpu (version 1)", "Upload torch-cpu, torch-cuda (version 1)"]


def test_dirty_build_refused_unless_forced(api, hub, tmp_path):
    b = make_project(tmp_path / "d")
    make_variant(b, dirty=True)
    with pytest.raises(PublishError, match="dirty build.*--force-dirty"):
        publish(b, endpoint=hub.url, progress=False)
    assert not (hub.root / "kernels").exists()  # refused before talking to the server
    # dirty only by provenance flag (id without suffix) is caught too
    b2 = make_project(tmp_path / "d2")
    make_variant(b2)
    meta = json.loads((b2 / "torch-cpu" / "metadata.json").read_text())
    meta["provenance"]["kernel"]["dirty"] = True
    (b2 / "torch-cpu" / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(PublishError, match="dirty"):
        publish(b2, endpoint=hub.url, progress=False)
    r = publish(b, endpoint=hub.url, progress=False, force_dirty=True)
    assert "build/torch-cpu/__init__.py" in _files(api, r.commit)


@pytest.mark.parametrize("breakage, message", [
    ("no-build", "does not exist"),
    ("empty-build", "No build variants"),
    ("no-metadata", "has no metadata.json"),
    ("bad-json", "is not valid JSON"),
    ("missing-field", "lacks required field(s) license"),
    ("str-version", "integer major version"),
    ("unparseable", "would not load"),
    ("version-mismatch", "build.toml says version 2 but the build is version 1"),
    ("mixed-versions", "disagree on the version"),
    ("dup-id", "share the id"),
    ("no-repo-id", "No repo id"),
    ("bad-repo-id", "Invalid repo id"),
])
def test_build_problems_are_explained(hub, tmp_path, breakage, message):
    b = _project(tmp_path, variants=("torch-cpu", "torch-cuda"))
    meta_path = b / "torch-cpu" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    repo_id = None
    if breakage == "no-build":
        shutil.rmtree(b)
    elif breakage == "empty-build":
        shutil.rmtree(b)
        b.mkdir()
    elif breakage == "no-metadata":
        meta_path.unlink()
    elif breakage == "bad-json":
        meta_path.write_text("{")
    elif breakage == "missing-field":
        del meta["license"]
    elif breakage == "str-version":
        meta["version"] = "1.0.0"
    elif breakage == "unparseable":
        meta["provenance"]["kernel"]["commit"] = "abc1234"  # kernels needs a full object id here
    elif breakage == "version-mismatch":
        toml = b.parent / "build.toml"
        toml.write_text(toml.read_text().replace("version = 1", "version = 2"))
        meta = json.loads((b / "torch-cuda" / "metadata.json").read_text())
        meta["version"] = 1
    elif breakage == "mixed-versions":
        meta["version"] = 2
    elif breakage == "dup-id":
        meta["id"] = json.loads((b / "torch-cuda" / "metadata.json").read_text())["id"]
    elif breakage == "no-repo-id":
        toml = b.parent / "build.toml"
        toml.write_text(toml.read_text().replace('repo-id = "geglu-kernels/tiny"', ""))
    elif breakage == "bad-repo-id":
        repo_id = "not a repo"
    if meta_path.exists() and breakage not in ("bad-json", "version-mismatch"):
        meta_path.write_text(json.dumps(meta))
    with pytest.raises(PublishError, match=message.replace("(", r"\(").replace(")", r"\)")):
        publish(b, repo_id=repo_id, endpoint=hub.url, progress=False)
    assert not (hub.root / "kernels").exists()  # nothing reached the server


def test_server_down_is_explained(tmp_path):
    import socket

    s = socket.socket()  # bound but never listening, and held (closed with the test's frame): connections are refused
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    with pytest.raises(PublishError, match=r"(?s)Lost the connection to the Hub at http://127.0.0.1:\d+.*nothing was "
                                           r"published.*kerneltools serve"):
        publish(_project(tmp_path), endpoint=f"http://127.0.0.1:{port}", progress=False)


def test_cli_publish(hub, tmp_path):
    b = _project(tmp_path)
    env = kernels_env(hub.url, tmp_path)
    r = subprocess.run([sys.executable, "-m", "kerneltools", "publish", "--build-dir", str(b), "--no-progress"],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT)  # endpoint from HF_ENDPOINT
    assert r.returncode == 0, r.stderr
    assert f"Published {REPO} version 1 to {hub.url}" in r.stdout and 'get_kernel("geglu-kernels/tiny", version=1)' \
        in r.stdout
    make_variant(b, "torch-cpu", dirty=True)
    shutil.rmtree(b / "torch-cpu")
    make_variant(b, "torch-cpu", dirty=True)
    r = subprocess.run([sys.executable, "-m", "kerneltools", "publish", "--build-dir", str(b), "--endpoint", hub.url],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert r.returncode == 1 and r.stderr.startswith("error: Refusing to publish a dirty build") and \
        "Traceback" not in r.stderr


def test_untrusted_org_needs_allowlist(hub, tmp_path):
    publish(_project(tmp_path, repo_id="someone-else/tiny"), endpoint=hub.url, progress=False)
    out = run_kernels(hub.url, tmp_path, LOAD + """
    try:
        get_kernel("someone-else/tiny", version=1)
    except ValueError as e:
        out["refused"] = str(e)
    out["allowlisted"] = describe(get_kernel("someone-else/tiny", version=1, trust_remote_code=["someone-else/tiny"]))
    try:
        get_kernel("someone-else/tiny", version=1, trust_remote_code=["someone-else/other"])
    except ValueError as e:
        out["other_allowlisted"] = str(e)
    """)
    assert out["refused"].startswith("Kernel repository 'someone-else/tiny' is not from a trusted publisher.")
    assert out["other_allowlisted"] == out["refused"]
    assert out["allowlisted"][:2] == [1, ""]


def test_interrupted_uploads_leave_previous_version(hub, tmp_path):
    api = HfApi(endpoint=hub.url, token=False)
    publish(_project(tmp_path, 1, "abc1234", "good"), endpoint=hub.url, progress=False)
    heads = _heads(api)
    commits_v1 = [c.commit_id for c in api.list_repo_commits(REPO, revision="v1", **K)]

    # 1) updating v1: the server dies after storing the objects, before moving the branch
    hub.restart(env={"KERNELTOOLS_HUB_CRASH_AT": "before-update-ref"})
    with pytest.raises(PublishError, match="Lost the connection"):
        publish(_project(tmp_path, 1, "bad0001", "broken"), endpoint=hub.url, progress=False)
    # 2) a new v2: the server dies in the middle of receiving the commit
    hub.start(env={"KERNELTOOLS_HUB_CRASH_AT": "after-commit-header"})
    with pytest.raises(PublishError, match="Lost the connection") as e:
        publish(_project(tmp_path, 2, "bad0002", "broken"), endpoint=hub.url, progress=False)
    assert "nothing was published" in str(e.value)
    assert "could not delete the temporary branch tmp-publish-v2-" in str(e.value)  # and says how to
    hub.start(env={})

    after = _heads(api)
    assert {k: v for k, v in after.items() if not k.startswith("tmp-publish-")} == heads  # no v2, v1/main unchanged
    for tmp_branch in set(after) - set(heads):  # a leftover temporary branch holds no build and is no version
        assert not any(p.startswith("build/") for p in _files(api, tmp_branch))
    assert [c.commit_id for c in api.list_repo_commits(REPO, revision="v1", **K)] == commits_v1
    git(repo_dir(hub, REPO), "fsck", "--no-dangling")
    out = run_kernels(hub.url, tmp_path, LOAD + """
    out["v1"] = describe(get_kernel("geglu-kernels/tiny", version=1))
    try:
        get_kernel("geglu-kernels/tiny", version=2)
    except ValueError as e:
        out["v2"] = str(e)
    """)
    assert out["v1"][:2] == [1, "good"] and out["v2"] == "Version 2 not found, available versions: 1"


@pytest.mark.parametrize("scenario", ["new-branch-different-variants", "existing-branch-same-variant"])
def test_concurrent_publishes_both_land(hub, tmp_path, monkeypatch, capsys, scenario):
    """Two publishes computed against the same head and committed at the same moment: neither is lost."""
    api = HfApi(endpoint=hub.url, token=False)
    if scenario == "existing-branch-same-variant":
        publish(_project(tmp_path, marker="base"), endpoint=hub.url, progress=False)
        builds = [_project(tmp_path, marker=f"m{i}", name=f"t{i}") for i in range(2)]
    else:
        builds = [_project(tmp_path, variants=(v,), name=v) for v in ("torch-cpu", "torch-cuda")]

    # hold both publishers right before their first build commit, then release them together
    barrier = threading.Barrier(2, timeout=30)
    real = HfApi.create_commit
    waited = set()

    def create_commit(self, *a, **kw):
        me = threading.get_ident()
        if me not in waited and kw.get("commit_message", "").startswith("Upload"):
            waited.add(me)
            barrier.wait()
        return real(self, *a, **kw)

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    results, errors = [None, None], [None, None]

    def run(i):
        try:
            results[i] = publish(builds[i], endpoint=hub.url, progress=False)
        except Exception as e:  # noqa: BLE001
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [None, None]
    # the conflict really happened and was handled (not serialized by luck)
    conflict = "created by someone else meanwhile" if scenario.startswith("new") else "moved while uploading"
    assert conflict in capsys.readouterr().err
    history = [c.commit_id for c in api.list_repo_commits(REPO, revision="v1", **K)]
    assert results[0].commit in history and results[1].commit in history and results[0].commit != results[1].commit
    files = _files(api, "v1")
    if scenario == "new-branch-different-variants":
        assert "build/torch-cpu/__init__.py" in files and "build/torch-cuda/__init__.py" in files
    else:
        # both commits are in history, the later one is the head and wins the content
        head = _heads(api)["v1"]
        last = 0 if results[0].commit == head else 1
        init = git(repo_dir(hub, REPO), "show", f"{head}:build/torch-cpu/__init__.py")
        assert f"MARKER = 'm{last}'" in init
    assert not [b for b in _heads(api) if b.startswith("tmp-publish")]


def test_benchmark_scripts_go_to_the_version_branch(api, hub, tmp_path):
    b = _project(tmp_path, variants=("torch-cpu", "torch-cuda"))
    bench = b.parent / "benchmarks"
    bench.mkdir()
    (bench / "benchmark.py").write_text("# main workloads\n")
    (bench / "benchmark_extra.py").write_text("# more\n")
    (bench / "probe.py").write_text("# not a benchmark script\n")
    r = publish(b, endpoint=hub.url, progress=False)
    assert r.benchmarks == ["benchmarks/benchmark.py", "benchmarks/benchmark_extra.py"]
    files = _files(api, "v1")
    assert [p for p in files if p.startswith("benchmarks/")] == r.benchmarks
    assert git(repo_dir(hub, REPO), "show", "v1:benchmarks/benchmark.py") == "# main workloads\n"
    assert not [p for p in _files(api, "main") if p.startswith("benchmarks/")]  # main holds the card only

    # a script the checkout no longer has leaves the branch; the variants stay
    (bench / "benchmark_extra.py").unlink()
    (bench / "benchmark.py").write_text("# main workloads, v2 of the script\n")
    r = publish(b, endpoint=hub.url, progress=False)
    after = _files(api, "v1")
    assert [p for p in after if p.startswith("benchmarks/")] == ["benchmarks/benchmark.py"]
    assert {p: o for p, o in after.items() if p.startswith("build/")} == \
        {p: o for p, o in files.items() if p.startswith("build/")}
    assert r.build_changed and git(repo_dir(hub, REPO), "show", "v1:benchmarks/benchmark.py").endswith("script\n")


def test_republishing_the_same_build_commits_nothing_and_says_so_once(api, hub, tmp_path):
    b = _project(tmp_path, variants=("torch-cpu", "torch-cuda"))
    publish(b, endpoint=hub.url, progress=False)
    commits = {rev: len(api.list_repo_commits(REPO, revision=rev, **K)) for rev in ("v1", "main")}
    env = kernels_env(hub.url, tmp_path)
    r = subprocess.run([sys.executable, "-m", "kerneltools", "publish", "--build-dir", str(b), "--no-progress"],
                       capture_output=True, text=True, env=env, cwd=REPO_ROOT)
    assert r.returncode == 0, r.stderr
    assert {rev: len(api.list_repo_commits(REPO, revision=rev, **K)) for rev in ("v1", "main")} == commits
    assert "No files have been modified" not in r.stdout + r.stderr
    said = [line for line in r.stdout.splitlines() if "already holds this build" in line]
    assert len(said) == 1 and said[0].endswith("nothing new was committed."), r.stdout
    assert "Published" not in r.stdout

    # one changed file: a commit with just that file (the unchanged ones are left out)
    (b / "torch-cpu" / "layers.py").write_text("# changed\n")
    res = publish(b, endpoint=hub.url, progress=False)
    assert res.build_changed and not res.card_changed
    changed = git(repo_dir(hub, REPO), "diff", "--name-only", f"{res.commit}~1", res.commit).split()
    assert changed == ["build/torch-cpu/layers.py"]
