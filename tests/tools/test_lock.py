"""Locking and offline use of the real kernel with the installed kernels (CI: 0.19.1 and 0.17.2), and kerneltools'
prefetch (kerneltools/lock.py).

The sample consumer project (data/consumer: pyproject.toml with [tool.kernels.dependencies], and a package using
get_locked_kernel / LockedLayerRepository) is locked with kernels' own `kernels lock` CLI against the loopback Hub.
Offline loads run with the server stopped, so nothing can silently go online.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toolhelpers import (
    GEGLU_PROBE,
    GEGLU_REPO,
    KERNELS_CLI,
    TRUSTED_ORG,
    cache_complete,
    cache_ref,
    kernels_env,
    make_project,
    make_variant,
    run_cli,
    run_kernels,
)
from kerneltools.lock import PrefetchError, prefetch

pytestmark = pytest.mark.ecosystem
from kerneltools.publish import publish

CONSUMER = Path(__file__).resolve().parent / "data" / "consumer"
OFFLINE = {"HF_HUB_OFFLINE": "1"}


def consumer_project(tmp_path: Path) -> Path:
    project = tmp_path / "consumer"
    shutil.copytree(CONSUMER, project, ignore=shutil.ignore_patterns("__pycache__", "kernels.lock"))
    return project


def kernels_lock(hub, tmp_path: Path, project: Path) -> list:
    r = run_cli([KERNELS_CLI, "lock", str(project)], kernels_env(hub.url, tmp_path))
    assert r.returncode == 0, r.stderr
    return json.loads((project / "kernels.lock").read_text())


def consumer_prelude(project: Path) -> str:
    """After GEGLU_PROBE: the consumer package, and a check of its kernelized MLP against its own forward."""
    return f"""
sys.path.insert(0, {str(project)!r})
import geglu_consumer as app


def mlp_check():
    torch.manual_seed(0)
    model = app.GatedMLP(16, 40)
    x = torch.randn(3, 16)
    ref = model(x)
    app.kernelized(model)
    # the forward now comes from <metadata id>.layers of the loaded kernel
    return {{"layer": model.forward.__func__.__module__.split(".")[0], "exact": torch.equal(model(x), ref)}}
"""


# get_kernel(version=1), and the three locked loads of the consumer project; each result or error
LOADS = """
from kernels import get_kernel, load_kernel

for name, fn in [("get_kernel", lambda: describe(get_kernel(app.REPO_ID, version=1))),
                 ("get_locked_kernel", lambda: describe(app.geglu_kernel())),
                 ("load_kernel", lambda: describe(load_kernel(app.REPO_ID, lockfile=app.LOCKFILE))),
                 ("LockedLayerRepository", mlp_check)]:
    try:
        out[name] = fn()
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
"""


# kernels 0.17 cannot load offline from the cache that online loads leave (docs/locking.md); kernels 0.19 can
NEEDS_PREFETCH = __import__("kernels").__version__.startswith("0.17.")


def _loaded(build, commit):
    return {"id": build.ids["torch-cpu"], "commit": commit, "variant": "torch-cpu", "exact": True}


def test_lock_pins_the_commit_and_prefetch_makes_it_load_offline(hub, tmp_path, geglu_builds):
    v1, v1_changed = geglu_builds.v1, geglu_builds.v1_changed
    r1 = v1.publish(hub)
    project = consumer_project(tmp_path)
    assert kernels_lock(hub, tmp_path, project) == [
        {"dependency": {"repo-id": GEGLU_REPO, "version": 1}, "lock": {"commit": r1.commit}}]
    r1b = v1_changed.publish(hub)  # v1 moves on: a rebuild from a changed tree
    assert r1b.branch == "v1" and r1b.commit != r1.commit
    prelude = GEGLU_PROBE + consumer_prelude(project)
    no_snapshot = (f"FileNotFoundError: Cannot find a local snapshot for {GEGLU_REPO} (revision: {r1.commit}). When "
                   "Hugging Face Hub is in offline mode the kernel must already be present in the local cache.")

    # Online, as users load: version=1 follows the branch, the locked loads keep the locked commit. The cache gets
    # one variant per commit and no refs/v1: kernels 0.17's load_kernel (cache only) fails even online, as
    # huggingface_hub rejects the one-variant snapshot as incomplete; kernels 0.19 loads it.
    online = run_kernels(hub.url, tmp_path, prelude=prelude, body=LOADS + """
out["locked_file"] = Path(app.geglu_kernel().__file__).read_text()
""")
    assert online["get_kernel"] == _loaded(v1_changed, r1b.commit)
    assert online["get_locked_kernel"] == _loaded(v1, r1.commit)
    assert "rebuilt: v1 moved on" not in online["locked_file"]  # the old commit's files
    assert online["LockedLayerRepository"] == {"layer": v1.ids["torch-cpu"], "exact": True}
    assert online["load_kernel"] == (no_snapshot if NEEDS_PREFETCH else _loaded(v1, r1.commit))

    # Offline (server stopped, so nothing can go online) on that cache: with kernels 0.17 all four fail, with its
    # messages; kernels 0.19 loads every one
    hub.stop()
    before = run_kernels(hub.url, tmp_path, prelude=prelude, body=LOADS, extra_env=OFFLINE)
    if NEEDS_PREFETCH:
        assert before["get_kernel"] == (
            f"ValueError: Version 1 of '{GEGLU_REPO}' is not available in the local cache and Hugging Face Hub is in "
            "offline mode. Download the kernel while online first, or pass an explicit `revision=<commit>`.")
        assert before["get_locked_kernel"] == before["load_kernel"] == before["LockedLayerRepository"] == no_snapshot
    else:  # kernels 0.19 loads what the online loads cached
        assert before["get_kernel"] == _loaded(v1_changed, r1b.commit)
        assert before["get_locked_kernel"] == before["load_kernel"] == _loaded(v1, r1.commit)
        assert before["LockedLayerRepository"] == {"layer": v1.ids["torch-cpu"], "exact": True}

    hub.start()
    env = kernels_env(hub.url, tmp_path)  # KERNELS_CACHE as the loads above, HF_ENDPOINT
    for args, line in [([GEGLU_REPO, "--version", "1"], f"{GEGLU_REPO} @ {r1b.commit} (refs: v1): "),
                       (["--lockfile", str(project / "kernels.lock")], f"{GEGLU_REPO} @ {r1.commit}: ")]:
        r = subprocess.run([sys.executable, "-m", "kerneltools", "prefetch", *args], capture_output=True, text=True,
                           env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == line + "torch-cpu, torch-cuda"
    hub.stop()

    after = run_kernels(hub.url, tmp_path, prelude=prelude, extra_env=OFFLINE, body=LOADS + """
out["v2"] = error(get_kernel, app.REPO_ID, version=2)
""")
    assert after["get_kernel"] == _loaded(v1_changed, r1b.commit)  # v1 as it was when prefetched
    assert after["get_locked_kernel"] == after["load_kernel"] == _loaded(v1, r1.commit)
    assert after["LockedLayerRepository"] == {"layer": v1.ids["torch-cpu"], "exact": True}
    assert after["v2"] == "ValueError: Version 2 not found, available versions: 1"  # "available": prefetched
    assert f"Skipping publisher trust check for '{GEGLU_REPO}' because Hugging Face Hub is in offline mode" in \
        after["_stderr"]  # kernels trusts the cache offline; prefetch did the check (test_load_faults.py)


def _tiny(tmp_path: Path, name: str, sha: str, depends: list | None = None) -> Path:
    build = make_project(tmp_path / f"{name}-{sha}", name=name, repo_id=f"{TRUSTED_ORG}/{name}")
    make_variant(build, "torch-cpu", name=name, sha=sha)
    if depends is not None:
        meta_path = build / "torch-cpu" / "metadata.json"
        meta = json.loads(meta_path.read_text())
        meta["kernel-depends"] = depends
        meta_path.write_text(json.dumps(meta))
    return build


def test_prefetch_follows_kernel_depends(hub, tmp_path):
    top, dep = f"{TRUSTED_ORG}/top", f"{TRUSTED_ORG}/dep"
    d1 = publish(_tiny(tmp_path, "dep", "aaa1111"), endpoint=hub.url, progress=False)
    t1 = publish(_tiny(tmp_path, "top", "bbb2222", [{"repo-id": dep, "version": 1}]), endpoint=hub.url,
                 progress=False)
    cache = tmp_path / "cache"
    got = prefetch(top, version=1, cache_dir=cache, endpoint=hub.url)
    assert [(g.repo_id, g.commit, g.refs) for g in got] == [(top, t1.commit, ["v1"]), (dep, d1.commit, ["v1"])]
    assert cache_ref(cache, top, "v1") == t1.commit and cache_ref(cache, dep, "v1") == d1.commit
    assert cache_complete(cache, top, t1.commit) and cache_complete(cache, dep, d1.commit)

    # with a lock file, the dependency is fetched at its locked commit even after its branch moved, and no ref
    # is written (refs/vN must name the branch head, which is not what the lock pins)
    from kerneltools.kernels_api import write_locks

    def lock_of(*entries):
        return write_locks([(r, 1, c) for r, c in entries])

    lockfile = tmp_path / "kernels.lock"
    lockfile.write_text(lock_of((top, t1.commit), (dep, d1.commit)))
    d2 = publish(_tiny(tmp_path, "dep", "ccc3333"), endpoint=hub.url, progress=False)
    cache2 = tmp_path / "cache2"
    got = prefetch(top, lockfile=lockfile, cache_dir=cache2, endpoint=hub.url)
    assert [(g.repo_id, g.commit, g.refs) for g in got] == [(top, t1.commit, []), (dep, d1.commit, [])]
    assert not cache_complete(cache2, dep, d2.commit) and cache_ref(cache2, dep, "v1") is None

    lockfile.write_text(lock_of((top, t1.commit)))
    with pytest.raises(PrefetchError, match=f"{top} \\(torch-cpu\\) depends on {dep}, which the lock file does not "
                                            "pin. Re-run `kernels lock <project dir>`."):
        prefetch(top, lockfile=lockfile, cache_dir=tmp_path / "cache3", endpoint=hub.url)


def test_prefetch_explains_what_is_wrong(hub, tmp_path, monkeypatch):
    publish(_tiny(tmp_path, "tiny", "abc1234"), endpoint=hub.url, progress=False)
    repo = f"{TRUSTED_ORG}/tiny"
    kw = dict(cache_dir=tmp_path / "cache", endpoint=hub.url)

    def refused(match, *args, **kwargs):
        with pytest.raises(PrefetchError, match=match):
            prefetch(*args, **{**kw, **kwargs})

    refused(f"Version 3 of {repo} not found on {hub.url}, available versions: 1.", repo, version=3)
    refused(f"The Hub at {hub.url} has no kernel repo {TRUSTED_ORG}/nope", f"{TRUSTED_ORG}/nope", version=1)
    refused("Pass exactly one of --version N and --lockfile PATH.", repo)
    refused("--version needs the repo id", None, version=1)
    refused("kernels.lock does not exist. Create it with `kernels lock <project dir>`", lockfile=tmp_path)
    old = tmp_path / "old" / "kernels.lock"  # kernels <= 0.16 format
    old.parent.mkdir()
    old.write_text(json.dumps([{"repo_id": repo, "sha": "0" * 40, "variants": {}}]))
    refused("is not a lock file this kernels reads .*unknown field `repo_id`.*Regenerate it", lockfile=old)
    good = tmp_path / "kernels.lock"
    good.write_text(json.dumps([{"dependency": {"repo-id": repo, "version": 1}, "lock": {"commit": "1" * 40}}]))
    refused(f"{TRUSTED_ORG}/other is not in .*kernels.lock \\(it pins {repo}\\)", f"{TRUSTED_ORG}/other",
            lockfile=good)
    refused("lacks a revision needed for the kernels locked in .*history was rewritten: re-run `kernels lock",
            lockfile=good)
    with monkeypatch.context() as m:
        from huggingface_hub import constants

        m.setattr(constants, "HF_HUB_OFFLINE", True)
        refused("HF_HUB_OFFLINE is set, but prefetch has to download", repo, version=1)
    hub.stop()
    refused(f"Lost the connection to the Hub at {hub.url} while prefetching {repo} version 1 .*Run prefetch again",
            repo, version=1)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("refs/*"))


def test_prefetch_refuses_a_variant_that_does_not_match_its_digest(hub, tmp_path, geglu_builds):
    """The digest in metadata.json (kernels_data.Digest) catches files changed without it: in the cache, or on the
    Hub by a commit that replaces a file of v1 (a write by another local user). A lock pinned to the good commit still
    prefetches."""
    from huggingface_hub import HfApi

    from toolhelpers import cache_repo

    r1 = geglu_builds.v1.publish(hub)
    cache = tmp_path / "cache"
    kw = dict(cache_dir=cache, endpoint=hub.url)
    prefetch(GEGLU_REPO, version=1, **kw)
    blob = (cache_repo(cache, GEGLU_REPO) / "snapshots" / r1.commit / "build" / "torch-cpu" / "layers.py").resolve()
    blob.write_text(blob.read_text() + "\nimport os  # changed in the cache\n")
    refusal = f"{GEGLU_REPO} at {{}}: variant torch-cpu does not match the digest in its metadata.json: .*layers.py"
    with pytest.raises(PrefetchError, match=refusal.format(r1.commit) + r".*The snapshot was removed from the cache"):
        prefetch(GEGLU_REPO, version=1, **kw)
    assert not cache_complete(cache, GEGLU_REPO, r1.commit) and not blob.exists()  # nothing loads it offline
    assert [g.commit for g in prefetch(GEGLU_REPO, version=1, **kw)] == [r1.commit]  # downloaded afresh
    assert cache_complete(cache, GEGLU_REPO, r1.commit)

    evil = HfApi(endpoint=hub.url, token=hub.token).upload_file(
        path_or_fileobj=b"import os\n", path_in_repo="build/torch-cpu/layers.py", repo_id=GEGLU_REPO, revision="v1",
        repo_type="kernel").oid
    with pytest.raises(PrefetchError, match=refusal.format(evil)):
        prefetch(GEGLU_REPO, version=1, **kw)
    assert cache_ref(cache, GEGLU_REPO, "v1") == r1.commit  # offline version=1 still names the good commit
    lockfile = tmp_path / "kernels.lock"
    lockfile.write_text(json.dumps([{"dependency": {"repo-id": GEGLU_REPO, "version": 1},
                                     "lock": {"commit": r1.commit}}]))
    assert [g.commit for g in prefetch(GEGLU_REPO, lockfile=lockfile, **kw)] == [r1.commit]
