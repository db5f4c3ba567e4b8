"""Load and faults on the loopback Hub, bounded in time and on loopback only (docs/hub-server.md, "Load and
faults"): concurrent publishers with downloads and attackers, a connection burst, a large upload's memory, kill -9
mid-upload and mid-hash-object then restart, and a full disk (a small tmpfs, where root may mount one).

Each test asserts zero lost commits and a clean `git fsck`, and records its figures; they are printed at the end
of the module (`pytest -s tests/tools/test_hub_load.py`) and copied into docs/hub-server.md."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import random
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError

from toolhelpers import TRUSTED_ORG, bearer, commit_ndjson, file_item, git, raw_request, repo_dir, repo_state
from kerneltools.hub import serve_hub

REPO = f"{TRUSTED_ORG}/load"
K = dict(repo_type="kernel")
PUBLISHERS, COMMITS = 32, 5
BIG = 128 << 20
FIGURES: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield FIGURES
    print("\n" + "\n".join(f"hub-load {name}: {json.dumps(f)}" for name, f in FIGURES.items()))


def _setup_repo(hub, repo: str = REPO) -> HfApi:
    api = HfApi(endpoint=hub.url, token=hub.token)
    api.create_repo(repo, **K)
    api.create_branch(repo, branch="v1", **K)
    return api


def _history(hub, repo: str = REPO, rev: str = "refs/heads/v1") -> list[str]:
    return git(repo_dir(hub, repo), "rev-list", rev).split()


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else 0.0


# ------------------------------------------------------------------------------------------------ concurrency


def _publisher(hub, i: int, acked: list, latencies: list, stale: list) -> None:
    """COMMITS commits of its own files; every fourth publisher passes parentCommit (a 412 makes it re-read the head
    and retry, as kerneltools.publish does), the others let the server put their commit on the current head."""
    api = HfApi(endpoint=hub.url, token=hub.token)
    for j in range(COMMITS):
        ops = [CommitOperationAdd(f"p{i}/c{j}.txt", f"{i}-{j}".encode()),
               CommitOperationAdd("latest.txt", f"{i}-{j}".encode())]
        while True:
            parent = api.kernel_info(REPO, revision="v1").sha if i % 4 == 0 else None
            t0 = time.perf_counter()
            try:
                oid = api.create_commit(REPO, operations=ops, commit_message=f"p{i} c{j}", revision="v1",
                                        parent_commit=parent, **K).oid
            except HfHubHTTPError as e:
                if e.response.status_code != 412:
                    raise
                stale.append(1)
                continue
            latencies.append(time.perf_counter() - t0)
            acked.append(oid)
            break


def _downloader(hub, stop: threading.Event, counts: dict) -> None:
    """What a consumer sees during the commits: every snapshot is whole (latest.txt = "i-j" and p{i}/c{j}.txt
    exist at the same commit)."""
    base = f"/kernels/{REPO}/resolve"
    while not stop.wait(0.01):
        status, h, body = raw_request(hub.url, "GET", f"{base}/v1/latest.txt")
        if status == 404:
            continue
        sha, (i, j) = h["X-Repo-Commit"], body.decode().split("-")
        status2, _, body2 = raw_request(hub.url, "GET", f"{base}/{sha}/p{i}/c{j}.txt")
        counts["ok" if (status, status2, body2) == (200, 200, body) else "bad"] += 1


def _attacker(hub, stop: threading.Event, counts: dict) -> None:
    """Anonymous, bogus-token, read-only-equivalent and cross-site writes, over and over: all refused."""
    evil = commit_ndjson({"summary": "evil"}, file_item("evil.py", b"owned"))
    nd = {"Content-Type": "application/x-ndjson"}
    attempts = [(None, nd), ("hf_bogus", nd), (hub.token, {"Content-Type": "text/plain"}),
                (hub.token, {**nd, "Origin": "http://evil.example"}), (hub.token, {**nd, "Host": "evil.example"})]
    while not stop.wait(0.05):
        for token, headers in attempts:
            status = raw_request(hub.url, "POST", f"/api/kernels/{REPO}/commit/v1", evil, headers, token=token)[0]
            counts[status] = counts.get(status, 0) + 1
        status = raw_request(hub.url, "DELETE", f"/api/kernels/{REPO}/branch/v1")[0]  # anonymous
        counts[status] = counts.get(status, 0) + 1


def test_concurrent_publishers_downloads_and_attackers(tmp_path):
    with serve_hub(tmp_path / "hub") as hub:
        _setup_repo(hub)
        base = len(_history(hub))
        acked, latencies, stale, errors = [], [], [], []
        dl, attacks, stop = {"ok": 0, "bad": 0}, {401: 0, 403: 0}, threading.Event()

        def run(i):
            try:
                _publisher(hub, i, acked, latencies, stale)
            except Exception as e:  # noqa: BLE001 - collected and asserted on
                errors.append(repr(e))

        side = [threading.Thread(target=_downloader, args=(hub, stop, dl)) for _ in range(2)]
        side.append(threading.Thread(target=_attacker, args=(hub, stop, attacks)))
        pubs = [threading.Thread(target=run, args=(i,)) for i in range(PUBLISHERS)]
        t0 = time.perf_counter()
        for t in side + pubs:
            t.start()
        for t in pubs:
            t.join(300)
        wall = time.perf_counter() - t0
        stop.set()
        for t in side:
            t.join(60)
        history = _history(hub)
        files = set(HfApi(endpoint=hub.url).list_repo_files(REPO, revision="v1", **K))
        repo_state(hub, REPO)  # fsck
    assert errors == []
    assert len(acked) == PUBLISHERS * COMMITS and set(acked) <= set(history)  # zero lost
    assert len(history) == base + PUBLISHERS * COMMITS
    assert {f"p{i}/c{j}.txt" for i in range(PUBLISHERS) for j in range(COMMITS)} <= files
    assert "evil.py" not in files and dl["bad"] == 0 and dl["ok"] > 0
    assert set(attacks) == {401, 403} and attacks[401] > 0 and attacks[403] > 0
    FIGURES["publishers"] = {"publishers": PUBLISHERS, "commits_each": COMMITS, "acked": len(acked), "lost": 0,
                             "stale_parent_412": len(stale), "wall_s": round(wall, 1),
                             "commits_per_s": round(len(acked) / wall, 1), "commit_p50_s": _percentile(latencies, .5),
                             "commit_p95_s": _percentile(latencies, .95), "downloads_consistent": dl["ok"],
                             "downloads_inconsistent": dl["bad"], "attacks_refused": dict(sorted(attacks.items()))}


def test_a_burst_of_128_new_connections_is_answered(tmp_path):
    with serve_hub(tmp_path / "hub") as hub:
        _setup_repo(hub)
        n, barrier, results = 128, threading.Barrier(128), []

        def one():
            barrier.wait()
            t0 = time.perf_counter()
            results.append((raw_request(hub.url, "GET", f"/api/kernels/{REPO}/refs")[0], time.perf_counter() - t0))

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(s for s, _ in results) == [200] * n  # every one answered (raw_request times out after 30 s)
    FIGURES["burst"] = {"connections": n, "answered_200": len(results),
                        "latency_p50_s": _percentile([t for _, t in results], .5),
                        "latency_max_s": _percentile([t for _, t in results], 1.0)}


# ------------------------------------------------------------------------------------------------ large uploads


def _big_upload(hub, path: str, size: int, seed: int, rev: str = "v1", repo: str = REPO, timeout: float = 120):
    """POST a commit adding `path` with `size` seeded random bytes, generated and sent piece by piece (the client
    holds under a megabyte). Returns (status, reply, sha256 of the content)."""
    rng, digest, piece = random.Random(seed), hashlib.sha256(), 3 << 18
    head = (json.dumps({"key": "header", "value": {"summary": f"upload {path}"}}) + "\n").encode()
    pre, post = b'{"key": "file", "value": {"content": "', f'", "path": "{path}", "encoding": "base64"}}}}\n'.encode()

    def body():
        yield head + pre
        left = size
        while left:
            data = rng.randbytes(min(piece, left))
            digest.update(data)
            left -= len(data)
            yield base64.b64encode(data)
        yield post

    u = urlsplit(hub.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        total = len(head) + len(pre) + 4 * ((size + 2) // 3) + len(post)
        conn.request("POST", f"/api/kernels/{repo}/commit/{rev}", body=body(),
                     headers={"Content-Type": "application/x-ndjson", "Content-Length": str(total), **bearer(hub.token)})
        r = conn.getresponse()
        return r.status, r.read(), digest.hexdigest()
    finally:
        conn.close()


def _proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _usage(hub) -> dict:
    line = [x for x in hub.log_path.read_text().splitlines() if x.startswith("hub-usage:")][-1]
    return {k: int(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def test_a_large_upload_streams_to_disk(tmp_path):
    """128 MiB in one commit: the server's peak memory grows by a few MiB (it was 5.2x the file), git's too."""
    with serve_hub(tmp_path / "hub") as hub:
        _setup_repo(hub)
        rss_before = _proc_status(hub.pid, "VmRSS")
        t0 = time.perf_counter()
        status, reply, sha256 = _big_upload(hub, "build/big.so", BIG, seed=1)
        upload_s = time.perf_counter() - t0
        assert status == 200, reply
        peak = _proc_status(hub.pid, "VmHWM")
        u = urlsplit(hub.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        conn.request("GET", f"/kernels/{REPO}/resolve/v1/build/big.so")
        r, got = conn.getresponse(), hashlib.sha256()
        while data := r.read(1 << 20):
            got.update(data)
        conn.close()
        history = _history(hub)
    usage = _usage(hub)
    assert got.hexdigest() == sha256 and json.loads(reply)["commitOid"] == history[0]
    assert peak - rss_before < 16 << 20, (peak, rss_before)
    assert usage["peak_child_rss_kib"] * 1024 < 64 << 20, usage
    FIGURES["large_upload"] = {"file_mib": BIG >> 20, "upload_s": round(upload_s, 1),
                               "server_rss_before_mib": round(rss_before / 2**20, 1),
                               "server_peak_growth_mib": round((peak - rss_before) / 2**20, 1),
                               "git_child_peak_rss_mib": round(usage["peak_child_rss_kib"] / 1024, 1)}


# ------------------------------------------------------------------------------------------------ kill -9


def _git_processes(root: Path) -> list[tuple[int, str]]:
    """Processes whose command line names the store (git children of a server on it)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(root) in cmd and cmd.startswith("git "):
                out.append((int(p.name), cmd))
    return out


def _wait_for(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("when", ["mid-body", "mid-hash-object"])
def test_kill_9_mid_upload_then_restart(tmp_path, when):
    if when == "mid-hash-object" and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing: git children cannot be tied to the server's life")
    with serve_hub(tmp_path / "hub") as hub:
        api = _setup_repo(hub)
        acked = [api.create_commit(REPO, operations=[CommitOperationAdd("a.txt", b"a")], commit_message="a",
                                   revision="v1", **K).oid]
        before, pid = repo_state(hub, REPO), hub.pid
        scratch = hub.root / ".tmp" / f"pid-{pid}"
        objects_before = sum(f.stat().st_size for f in (repo_dir(hub, REPO) / "objects").rglob("*") if f.is_file())
        client = threading.Thread(target=lambda: _swallow(_big_upload, hub, "build/big.so", BIG // 2, 2))
        client.start()
        if when == "mid-body":
            _wait_for(lambda: any(f.stat().st_size > 8 << 20 for f in scratch.rglob("upload-*/*")), what="the upload")
            victims = []
        else:
            victims = _wait_for(lambda: [p for p in _git_processes(hub.root) if "hash-object" in p[1]],
                                what="git hash-object")
        hub.kill()  # SIGKILL to the server process alone, like the OOM killer
        client.join(60)
        # its git children die with it (setpriv --pdeathsig), nothing is left running on the store
        _wait_for(lambda: not _git_processes(hub.root), timeout=10, what="the git children to end")
        hub.start()
        assert repo_state(hub, REPO) == before  # head intact, fsck clean
        assert not scratch.exists()  # the dead server's scratch (decoded upload, quarantined objects) is gone
        objects_after = sum(f.stat().st_size for f in (repo_dir(hub, REPO) / "objects").rglob("*") if f.is_file())
        assert objects_after - objects_before < 1 << 20  # nothing of the killed upload reached the repository
        acked.append(api.create_commit(REPO, operations=[CommitOperationAdd("b.txt", b"b")], commit_message="b",
                                       revision="v1", **K).oid)
        assert set(acked) <= set(_history(hub)) and repo_state(hub, REPO)
    FIGURES[f"kill9_{when}"] = {"killed_git_children": len(victims), "orphans_left": 0, "head_intact": True,
                                "fsck": "clean", "repo_growth_bytes": objects_after - objects_before}


def _swallow(fn, *args):
    try:
        fn(*args)
    except (OSError, http.client.HTTPException):
        pass  # the server was killed under it


# ------------------------------------------------------------------------------------------------ full disk


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 40 MiB tmpfs, where this user may mount one (root, outside a locked-down container); else skip."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_disk(small_tmpfs):
    root = small_tmpfs / "hub"
    with serve_hub(root, server_args=["--quiet"]) as hub:
        api = _setup_repo(hub)
        base = len(_history(hub))
        acked = [api.create_commit(REPO, operations=[CommitOperationAdd("a.txt", b"a")], commit_message="a",
                                   revision="v1", **K).oid]
        free0 = shutil.disk_usage(small_tmpfs).free
        statuses = []
        for i, size in enumerate([64 << 20, 24 << 20, 12 << 20, 4 << 20]):  # bigger than the disk, down to fitting
            status, reply, _ = _big_upload(hub, f"build/f{i}.bin", size, seed=10 + i)
            statuses.append(status)
            assert status in (200, 507), reply
            if status == 507:
                assert b"disk is full" in reply and repo_state(hub, REPO)
            else:
                acked.append(json.loads(reply)["commitOid"])
            assert not list((root / ".tmp").rglob("upload-*")) and not list((root / ".tmp").rglob("objects-*"))
        acked.append(api.create_commit(REPO, operations=[CommitOperationAdd("z.txt", b"z")], commit_message="z",
                                       revision="v1", **K).oid)
        history = _history(hub)
        repo_state(hub, REPO)  # fsck clean
        free1 = shutil.disk_usage(small_tmpfs).free
    assert 507 in statuses and set(acked) <= set(history) and len(history) == base + len(acked)
    FIGURES["full_disk"] = {"tmpfs_mib": 40, "upload_mib": [64, 24, 12, 4], "status": statuses,
                            "acked": len(acked), "lost": 0, "free_before_mib": round(free0 / 2**20, 1),
                            "free_after_mib": round(free1 / 2**20, 1)}


# ------------------------------------------------------------------------------------------------ abuse


SLOW_CLIENTS = 256


def _fast_import(d: Path, branch: str, messages, base: str = "refs/heads/main") -> None:
    """Commits made by hand on the bare repo, one per message (fed to git as they are generated)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    p = subprocess.Popen(["git", f"--git-dir={d}", "fast-import", "--quiet"], stdin=subprocess.PIPE, env=env)
    for i, msg in enumerate(messages):
        p.stdin.write(b"commit refs/heads/%s\ncommitter outside <outside@localhost> %d +0000\ndata %d\n%s\n"
                      % (branch.encode(), 1_700_000_000 + i, len(msg), msg))
        if i == 0:
            p.stdin.write(b"from %s\n" % base.encode())
    p.stdin.close()
    assert p.wait(120) == 0


def _timed_request(hub, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    t0 = time.perf_counter()
    status, h, data = raw_request(hub.url, method, path, body, headers)
    return status, time.perf_counter() - t0, len(data)


def _raw_timed(hub, data: bytes) -> tuple[int, float]:
    """One request sent as raw bytes (malformed headers); the status and the time to the answer."""
    u = urlsplit(hub.url)
    import socket

    t0 = time.perf_counter()
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(data)
        reply = b""
        while b"\r\n" not in reply and (chunk := s.recv(4096)):
            reply += chunk
    return int(reply.split(b" ", 2)[1]), time.perf_counter() - t0


def test_attacks_are_answered_at_once_in_bounded_memory(tmp_path):
    """The requests of the abuse probe (issue 51), concurrently, against a server with its default limits: every
    one answered within a second with a 4xx (or served), server memory under 200 MB throughout, ordinary clients
    answered within a second while 256 clients trickle request heads, and a stop within 5 s of SIGTERM."""
    import socket

    with serve_hub(tmp_path / "hub") as hub:
        _setup_repo(hub)
        _fast_import(repo_dir(hub, REPO), "huge", (b"commit %d\n\n" % i + b"m" * (1000 << 10) for i in range(40)))
        rss, stop = [], threading.Event()

        def sample():
            while not stop.wait(0.02):
                try:
                    rss.append(_proc_status(hub.pid, "VmRSS"))
                except (OSError, KeyError):  # the process is exiting
                    return

        sampler = threading.Thread(target=sample)
        sampler.start()
        js, form = {"Content-Type": "application/json"}, {"Content-Type": "application/x-www-form-urlencoded"}
        yaml_4mb = json.dumps({"content": "---\na: [" + "1," * (2 << 20) + "1]\n---\n"}).encode()
        yaml_max = json.dumps({"content": "---\na: [" + "1," * 9_990 + "1]\n---\n"}).encode()  # the most work accepted
        paths_4mb = "&".join(f"paths=p{i}" for i in range(838_856)).encode()
        paths_1000 = json.dumps({"paths": [f"build/p{i}.py" for i in range(1000)]}).encode()
        attacks = {
            "validate_yaml_4mb": (4, lambda: _timed_request(hub, "POST", "/api/validate-yaml", yaml_4mb, js)),
            "validate_yaml_at_limits": (4, lambda: _timed_request(hub, "POST", "/api/validate-yaml", yaml_max, js)),
            "paths_info_4mb": (8, lambda: _timed_request(hub, "POST", f"/api/kernels/{REPO}/paths-info/v1",
                                                         paths_4mb, form)),
            "paths_info_1000": (8, lambda: _timed_request(hub, "POST", f"/api/kernels/{REPO}/paths-info/v1",
                                                          paths_1000, js)),
            "commits_of_1000_kib_messages": (4, lambda: _timed_request(hub, "GET",
                                                                       f"/api/kernels/{REPO}/commits/huge?limit=1000")),
            "content_length_xb2": (4, lambda: _raw_timed(hub, b"GET / HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n")),
            "content_length_5000_digits": (4, lambda: _raw_timed(
                hub, b"GET / HTTP/1.1\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n")),
        }
        results: dict[str, list] = {name: [] for name in attacks}
        for name, (count, fn) in attacks.items():  # each kind `count` at once, as the probe sent them
            threads = [threading.Thread(target=lambda n=name, f=fn: results[n].append(f())) for _ in range(count)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)

        # keep-alive against new connections
        u = urlsplit(hub.url)
        reused, fresh = [], []
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        for _ in range(50):
            t0 = time.perf_counter()
            conn.request("GET", f"/api/organizations/{TRUSTED_ORG}/overview")
            conn.getresponse().read()
            reused.append(time.perf_counter() - t0)
        conn.close()
        for _ in range(50):
            fresh.append(_timed_request(hub, "GET", f"/api/organizations/{TRUSTED_ORG}/overview")[1])

        # 256 clients trickling request heads, one byte every 2 s; ordinary clients meanwhile
        slow = [socket.create_connection((u.hostname, u.port), timeout=30) for _ in range(SLOW_CLIENTS)]
        trickle_stop = threading.Event()

        def trickle():
            i = 0
            while not trickle_stop.is_set():
                for s in slow:
                    try:
                        s.send(b"GET /api/x HTTP/1.1\r\n"[i % 20:i % 20 + 1])
                    except OSError:
                        pass
                i += 1
                trickle_stop.wait(2)

        trickler = threading.Thread(target=trickle)
        trickler.start()
        time.sleep(1.5)
        probes = []
        for _ in range(20):
            probes.append(_timed_request(hub, "GET", f"/api/kernels/{REPO}/refs"))
            time.sleep(0.2)
        # SIGTERM while slow clients are connected and an upload is in progress
        busy = socket.create_connection((u.hostname, u.port), timeout=30)
        busy.sendall(f"POST /api/kernels/{REPO}/commit/v1 HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer "
                     f"{hub.token}\r\nContent-Type: application/x-ndjson\r\nContent-Length: 100000\r\n\r\n".encode()
                     + b'{"key": "header", "value": {"summary": "cut"}}\n')
        time.sleep(0.3)
        before = _history(hub)
        t0 = time.perf_counter()
        os.kill(hub.pid, 15)
        hub.wait_exit(30)
        stop_s = time.perf_counter() - t0
        trickle_stop.set()
        trickler.join()
        stop.set()
        sampler.join()
        for s in slow + [busy]:
            s.close()
        usage = _usage(hub)
        hub.start()
        assert _history(hub) == before  # nothing lost, nothing half-made
    want = {"validate_yaml_4mb": {413}, "validate_yaml_at_limits": {200}, "paths_info_4mb": {413},
            "paths_info_1000": {200}, "commits_of_1000_kib_messages": {200}, "content_length_xb2": {400},
            "content_length_5000_digits": {400}}
    # refusals take milliseconds: the 1 s target is asserted as is. Requests served in full do real work (0.3 s for
    # four or eight at once on a 2-core machine; docs/hub-server.md compares the figures with the 1 s target), so the
    # suite asserts a bound that a loaded machine keeps too
    served = {"validate_yaml_at_limits", "paths_info_1000", "commits_of_1000_kib_messages"}
    for name, got in results.items():
        assert len(got) == attacks[name][0] and {r[0] for r in got} == want[name], (name, got)
        assert max(r[1] for r in got) < (3 if name in served else 1), (name, got)
    assert all(r[0] == 200 for r in probes) and max(r[1] for r in probes) < 1, probes
    peak = max(rss + [usage["peak_rss_kib"] * 1024])
    assert peak < 200 << 20, (max(rss), usage)
    assert stop_s < 5, stop_s
    FIGURES["abuse"] = {
        **{f"{n}_max_s": round(max(r[1] for r in got), 3) for n, got in results.items()},
        "commits_page_bytes_max": max(r[2] for r in results["commits_of_1000_kib_messages"]),
        "server_rss_peak_mib": round(peak / 2**20, 1),
        "keepalive_median_ms": round(statistics.median(reused) * 1000, 2),
        "new_connection_median_ms": round(statistics.median(fresh) * 1000, 2),
        "slow_clients": SLOW_CLIENTS, "ordinary_during_slow_max_s": round(max(r[1] for r in probes), 3),
        "dropped_connections": usage["dropped_connections"], "sigterm_stop_s": round(stop_s, 2)}
