"""Loading the real kernel when things go wrong: the Hub dies mid-download, a version that does not exist, a
publisher that is not trusted. For kernels' own loader (in a fresh process) and for kerneltools' prefetch.
Interrupted and concurrent publishes are in test_publish.py."""

from __future__ import annotations

import pytest

from toolhelpers import (
    GEGLU_PROBE,
    GEGLU_REPO,
    cache_bad_blobs,
    cache_complete,
    cache_ref,
    run_kernels,
)
from kerneltools.hub.storage import CRASH_ENV
from kerneltools.lock import PrefetchError, prefetch

# huggingface_hub retries a lost connection, sleeping up to 8 s between tries (about 25 s in all) before it gives
# up. The retries still happen here; only the waiting is skipped.
NO_BACKOFF = """
import time as _time

import huggingface_hub.file_download as _fd
import huggingface_hub.utils._http as _http


class _NoSleep:
    def __getattr__(self, name):
        return getattr(_time, name)

    @staticmethod
    def sleep(seconds):
        pass


_fd.time = _http.time = _NoSleep()
"""


@pytest.fixture
def no_backoff(monkeypatch):
    """NO_BACKOFF for huggingface_hub calls in this process."""
    import huggingface_hub.file_download as fd
    import huggingface_hub.utils._http as http

    ns = {}
    exec(NO_BACKOFF, ns)
    monkeypatch.setattr(fd, "time", ns["_NoSleep"]())
    monkeypatch.setattr(http, "time", ns["_NoSleep"]())


def _loaded(build, commit):
    return {"id": build.ids["torch-cpu"], "commit": commit, "variant": "torch-cpu", "exact": True}


def test_hub_dies_mid_download(hub, tmp_path, geglu_builds):
    v1 = geglu_builds.v1
    r1 = v1.publish(hub)
    cache = tmp_path / "kcache"  # kernels_env's KERNELS_CACHE
    # the trust check, refs, tree and metadata.json calls succeed; the server dies halfway through a variant file
    hub.restart(env={CRASH_ENV: "mid-download:build/torch-cpu/pointwise/kernels.py"})
    out = run_kernels(hub.url, tmp_path, prelude=GEGLU_PROBE + NO_BACKOFF, body=f"""
    import httpx2  # huggingface_hub 2.x's HTTP client
    from kernels import get_kernel
    try:
        get_kernel({GEGLU_REPO!r}, version=1)
    except Exception as e:
        out["error"] = f"{{type(e).__name__}}: {{e}}"
        out["transport_error"] = isinstance(e, httpx2.TransportError)
    """)
    assert hub.wait_exit(10) == 137  # it died where it was told to: halfway through sending pointwise/kernels.py
    # kernels passes the HTTP client's transport error through (ConnectError: Connection refused, ReadError:
    # Connection reset by peer, RemoteProtocolError: Server disconnected..., whichever download notices first).
    # huggingface_hub logs "Error while downloading from <url>" only for the errors it retries (not for a reset), so
    # which files the log names depends on timing; what must hold is the state of the cache, below.
    assert out.get("transport_error"), out.get("error")

    # not poisoned: every blob the cache holds as complete has the right content, the half file is not in the
    # snapshot, and the snapshot is known to be incomplete (so an offline load refuses it instead of importing it)
    snapshot = cache / f"kernels--{GEGLU_REPO.replace('/', '--')}" / "snapshots" / r1.commit
    assert cache_bad_blobs(cache, GEGLU_REPO) == []
    assert (snapshot / "build" / "torch-cpu" / "metadata.json").is_file()
    assert not (snapshot / "build" / "torch-cpu" / "pointwise/kernels.py").exists()
    assert not cache_complete(cache, GEGLU_REPO, r1.commit)

    hub.start(env={})  # back up: the same call now succeeds, on top of what the failed one left
    out = run_kernels(hub.url, tmp_path, prelude=GEGLU_PROBE, body=f"""
    from kernels import get_kernel
    out["k"] = describe(get_kernel({GEGLU_REPO!r}, version=1))
    """)
    assert out["k"] == _loaded(v1, r1.commit)
    assert cache_bad_blobs(cache, GEGLU_REPO) == []


def test_prefetch_interrupted_keeps_the_previous_snapshot(hub, tmp_path, geglu_builds, no_backoff):
    """snapshot_download(revision="v1") writes refs/v1 before downloading, so an interrupted one would leave refs/v1
    naming a partial snapshot; prefetch writes it only once the snapshot is complete."""
    cache = tmp_path / "cache"
    kw = dict(version=1, cache_dir=cache, endpoint=hub.url)
    r1 = geglu_builds.v1.publish(hub)
    prefetch(GEGLU_REPO, **kw)
    r1b = geglu_builds.v1_changed.publish(hub)  # changes build/*/__init__.py: a blob the cache lacks
    hub.restart(env={CRASH_ENV: "mid-download:build/torch-cpu/__init__.py"})
    with pytest.raises(PrefetchError, match=f"Lost the connection to the Hub at {hub.url} while prefetching "
                                            f"{GEGLU_REPO} version 1 .*Run prefetch again"):
        prefetch(GEGLU_REPO, **kw)
    assert hub.wait_exit(10) == 137
    assert cache_ref(cache, GEGLU_REPO, "v1") == r1.commit  # offline version=1 still gets the complete r1
    assert cache_complete(cache, GEGLU_REPO, r1.commit) and not cache_complete(cache, GEGLU_REPO, r1b.commit)
    assert cache_bad_blobs(cache, GEGLU_REPO) == []

    hub.start(env={})
    got = prefetch(GEGLU_REPO, **kw)
    assert [(g.commit, g.refs) for g in got] == [(r1b.commit, ["v1"])]
    assert cache_ref(cache, GEGLU_REPO, "v1") == r1b.commit and cache_complete(cache, GEGLU_REPO, r1b.commit)


def test_unknown_version(hub, tmp_path, geglu_builds):
    geglu_builds.v1.publish(hub)
    out = run_kernels(hub.url, tmp_path, prelude=GEGLU_PROBE, body=f"""
    from kernels import get_kernel
    out["error"] = error(get_kernel, {GEGLU_REPO!r}, version=2)
    """)
    assert out["error"] == "ValueError: Version 2 not found, available versions: 1"
    with pytest.raises(PrefetchError, match=f"Version 2 of {GEGLU_REPO} not found on {hub.url}, available versions: "
                                            "1."):
        prefetch(GEGLU_REPO, version=2, cache_dir=tmp_path / "kcache", endpoint=hub.url)
    # offline, with only v1 prefetched: test_lock.py


def test_untrusted_org_needs_allowlist(hub, tmp_path, geglu_builds):
    repo = "other-org/geglu"  # the same build, published where the server does not vouch for the publisher
    r = geglu_builds.v1.publish(hub, repo_id=repo)
    refusal = (f"Kernel repository '{repo}' is not from a trusted publisher. Set trust_remote_code=True or add the "
               "repository ID to the trust_remote_code allowlist to allow loading kernels from untrusted sources.")
    out = run_kernels(hub.url, tmp_path, prelude=GEGLU_PROBE, body=f"""
    from kernels import get_kernel
    out["refused"] = error(get_kernel, {repo!r}, version=1)
    out["allowlisted"] = describe(get_kernel({repo!r}, version=1, trust_remote_code=[{repo!r}]))
    """)
    assert out["refused"] == f"ValueError: {refusal}"
    assert out["allowlisted"] == _loaded(geglu_builds.v1, r.commit)

    # offline loads skip the trust check, so prefetch makes it, with the same opt-in
    kw = dict(version=1, cache_dir=tmp_path / "cache", endpoint=hub.url)
    with pytest.raises(PrefetchError, match=f"Kernel repository '{repo}' is not from a trusted publisher. Offline "
                                            f"loads skip this check, so prefetch does it: pass --trust-repo {repo}"):
        prefetch(repo, **kw)
    assert not (tmp_path / "cache").exists()  # refused before downloading anything
    assert [g.commit for g in prefetch(repo, trust_remote_code=[repo], **kw)] == [r.commit]

