"""Git-backed storage for the loopback Hub server.

One bare git repository per Hub repository, at ``<root>/<type>s/<namespace>/<name>.git``. Everything the server
knows about repositories lives in them (commits, branches, tags), so a restart loses nothing.

Writes:

- A commit is built off to the side (a temporary ``GIT_INDEX_FILE``: read-tree, update-index, write-tree,
  commit-tree) and published with ``git update-ref <ref> <new> <old>``, an atomic compare-and-swap: a commit is
  either entirely visible or not at all, and two commits racing on one branch never lose one.
- Every ref change of a repository happens under that repository's writer lock (``flock`` on
  ``hub-writer.flock`` in the bare repo; the kernel drops it when its holder dies, even by SIGKILL), so writers of
  all server processes on one root take turns instead of rebuilding their trees over and over.
- **Stale ref locks.** git's own lock files (``refs/heads/<b>.lock``, ``packed-refs.lock``) live for the
  milliseconds of one ``update-ref``, which the server runs while holding the writer lock. So a git lock file that
  exists while we hold the writer lock was left by a writer that died (a server killed mid-update) or belongs to
  someone editing the repository by hand. It is removed only if it is also older than ``stale_lock_seconds``
  (default 5 s): a hand-run git that is still working is waited for, never robbed.
- Durability: every git call runs with ``core.fsync=committed`` (objects and refs reach the disk before git
  reports success), and ``core.logAllRefUpdates=always`` keeps a reflog of every branch and tag, with the token's
  user as the committer. Because git drops the reflog of a deleted ref, the server also appends each ref change to
  ``hub-audit.log`` in the bare repo (JSON lines: time, user, operation, ref, old and new id).
- Child processes: the git processes that handle file contents of any size (``hash-object``, ``cat-file blob``) are
  started through ``setpriv --pdeathsig KILL`` where that exists, so they die with the server thread that started
  them (a killed server leaves no orphaned ``git hash-object``), and a download's ``cat-file`` is killed when its
  client goes away. New blobs are written into a quarantine under the server's scratch space first
  (:meth:`Repo.quarantine`), so whatever such a process leaves half-written never lands in a repository.

Every git call goes through :func:`run_git` with an argument list (never a shell); client-supplied names reach git
only after validation (:mod:`.names`), behind fixed prefixes (``refs/heads/``) or as stdin data.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import HubError, busy, disk_full, entry_not_found, repo_not_found, revision_not_found
from .names import (
    DEFAULT_BRANCH,
    REPO_TYPES,
    ref_name_ok,
    revision_candidates,
    validate_ref_name,
    validate_repo_id,
    validate_repo_type,
)

ZERO_OID = "0" * 40
SERVER_USER = "hub-server"  # the author of the initial commit of new repos
_PARENT_RE = re.compile(r"[0-9a-fA-F]{5,40}")  # fullmatch
_LOCK_EXISTS_RE = re.compile(r"Unable to create '([^']+\.lock)': File exists")
# test-only fault injection (see docs/hub-server.md): crash the server process at a named point of a commit
CRASH_ENV = "KERNELTOOLS_HUB_CRASH_AT"
# git settings for every call: durable objects and refs, a reflog for every ref, big blobs streamed into packs and
# read through small pack windows (hash-object and cat-file then never hold or map a whole large file)
GIT_CONFIG = {
    "core.fsync": "committed",
    "core.fsyncMethod": "batch",
    "core.logAllRefUpdates": "always",
    "core.bigFileThreshold": "16m",
    "core.packedGitWindowSize": "4m",
    "core.packedGitLimit": "16m",
}
_SETPRIV = shutil.which("setpriv")


def maybe_crash(point: str) -> None:
    if os.environ.get(CRASH_ENV) == point:
        os._exit(137)


def format_date(ts: float) -> str:
    """Hub date format ('%Y-%m-%dT%H:%M:%S.%fZ' with milliseconds); huggingface_hub rejects '+00:00'."""
    d = _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


# --------------------------------------------------------------------------------------------------------------------
# running git
# --------------------------------------------------------------------------------------------------------------------


class GitFailed(Exception):
    def __init__(self, args, returncode, stderr: bytes):
        super().__init__(f"git {' '.join(args)} failed ({returncode}): {stderr.decode(errors='replace').strip()}")
        self.returncode = returncode
        self.stderr = stderr


def git_env(user: str = SERVER_USER, extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # never a caller's GIT_DIR etc.
    email = f"{user}@localhost"
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull, GIT_LITERAL_PATHSPECS="1",
               GIT_TERMINAL_PROMPT="0", GIT_AUTHOR_NAME=user, GIT_AUTHOR_EMAIL=email, GIT_COMMITTER_NAME=user,
               GIT_COMMITTER_EMAIL=email, LC_ALL="C", GIT_CONFIG_COUNT=str(len(GIT_CONFIG)))
    for i, (k, v) in enumerate(GIT_CONFIG.items()):
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = k, v
    env.update(extra or {})
    return env


def git_command(git_dir: Path | None, *args: str, tied: bool = False) -> list[str]:
    """The argv of one git call; ``tied``: killed when the server thread that starts it dies (setpriv --pdeathsig),
    for the calls that handle file contents of any size (hash-object, cat-file blob). The others handle a few
    bytes of metadata and end within milliseconds anyway."""
    prefix = [_SETPRIV, "--pdeathsig", "KILL"] if tied and _SETPRIV else []
    return prefix + ["git"] + ([f"--git-dir={git_dir}"] if git_dir is not None else []) + list(args)


def run_git(git_dir: Path | None, *args: str, input: bytes | None = None, env: dict | None = None,
            check: bool = True, user: str = SERVER_USER, tied: bool = False):
    """stdout of a git call (check=True), or the CompletedProcess. A full disk is a 507, never a 500."""
    r = subprocess.run(git_command(git_dir, *args, tied=tied), input=input, capture_output=True,
                       env=git_env(user, env), cwd=str(git_dir) if git_dir is not None else None)
    if r.returncode != 0 and any(m in r.stderr for m in (b"No space left on device", b"Out of diskspace",
                                                          b"Disk quota exceeded")):
        raise disk_full("The Hub server's disk is full; nothing was stored. Free space on the server and retry.")
    if check and r.returncode != 0:
        raise GitFailed(args, r.returncode, r.stderr)
    return r.stdout if check else r


@contextlib.contextmanager
def file_lock(path: Path, timeout: float, what: str):
    """An exclusive flock on ``path`` (created if needed), given up when the holder exits or dies; 503 after
    ``timeout`` seconds of waiting."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline, delay = time.monotonic() + timeout, 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise busy(f"{what} is busy (another write has held it for {timeout:.0f} s); nothing was "
                               "changed. Retry.", retry_after=2) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        yield
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------------------------
# the store
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Entry:
    type: str  # "file" | "directory"
    path: str
    oid: str
    size: int

    def to_json(self) -> dict:
        return {"type": self.type, "oid": self.oid, "size": self.size, "path": self.path}


@dataclass
class CommitOp:
    kind: str  # "add" | "delete_file" | "delete_folder"
    path: str
    blob: str | None = None


_GITATTRIBUTES = b"""\
# Created by the kerneltools loopback Hub server (files are stored as plain git blobs, never LFS/Xet).
*.bin filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
"""


class GitStore:
    """The storage root: creates and opens repositories."""

    def __init__(self, root: str | os.PathLike, *, stale_lock_seconds: float = 5.0, lock_timeout: float = 30.0):
        if shutil.which("git") is None:
            raise RuntimeError("git was not found on PATH; the Hub server stores repositories with the git CLI. "
                               "Install git (Debian: apt-get install git).")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stale_lock_seconds = stale_lock_seconds
        self.lock_timeout = lock_timeout
        scratch = self.root / ".tmp"
        scratch.mkdir(exist_ok=True)
        for d in scratch.iterdir():  # leftovers of crashed servers (temp indexes, decoded uploads): never data
            pid = d.name.partition("-")[2]
            if d.name.startswith("pid-") and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
        self.tmp = scratch / f"pid-{os.getpid()}"  # per process: a second server on this root keeps its own
        self.tmp.mkdir(exist_ok=True)

    def repo_path(self, repo_type: str, repo_id: str) -> Path:
        validate_repo_type(repo_type)
        ns, name = validate_repo_id(repo_id).split("/")
        return self.root / f"{repo_type}s" / ns / f"{name}.git"

    def namespaces(self) -> set[str]:
        out = set()
        for t in REPO_TYPES:
            d = self.root / f"{t}s"
            if d.is_dir():
                out.update(p.name for p in d.iterdir() if p.is_dir() and any(p.glob("*.git")))
        return out

    def open(self, repo_type: str, repo_id: str) -> "Repo":
        path = self.repo_path(repo_type, repo_id)
        if not (path / "HEAD").is_file():
            raise repo_not_found(repo_type, repo_id)
        return Repo(self, path, repo_type, repo_id)

    def new_tmpdir(self, prefix: str = "upload-") -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.tmp))

    def create(self, repo_type: str, repo_id: str, user: str) -> bool:
        """Create the repo with an initial commit on main; False if it already exists. Serialized across all
        server processes on this root (flock), and the repo appears complete or not at all (one rename)."""
        path = self.repo_path(repo_type, repo_id)
        with file_lock(self.root / ".create.flock", self.lock_timeout, "Repository creation"):
            if path.exists():
                return False
            staging = self.tmp / f"create-{uuid.uuid4().hex}.git"
            try:
                self._init_staging(staging, repo_type, repo_id)
                path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.rename(staging, path)
                except OSError as e:
                    if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # someone outside the server made it
                        return False
                    raise
                _fsync_dir(path.parent)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        repo = Repo(self, path, repo_type, repo_id)
        repo.audit(user, "create", f"refs/heads/{DEFAULT_BRANCH}", None, repo.ref_sha(f"refs/heads/{DEFAULT_BRANCH}"))
        return True

    def _init_staging(self, staging: Path, repo_type: str, repo_id: str) -> None:
        run_git(None, "init", "--quiet", "--bare", "--initial-branch", DEFAULT_BRANCH, str(staging))
        for k, v in GIT_CONFIG.items():  # also for plain git used on the store by hand
            run_git(staging, "config", k, v)
        repo = Repo(self, staging, repo_type, repo_id)
        blob = repo.git("hash-object", "-w", "--stdin", input=_GITATTRIBUTES).decode().strip()
        tree = repo.git("mktree", input=f"100644 blob {blob}\t.gitattributes\n".encode()).decode().strip()
        commit = repo.git("commit-tree", "-m", "initial commit", tree).decode().strip()
        repo.git("update-ref", "-m", "create", f"refs/heads/{DEFAULT_BRANCH}", commit, "")


class Repo:
    def __init__(self, store: GitStore, path: Path, repo_type: str, repo_id: str):
        self.store, self.path, self.repo_type, self.repo_id = store, path, repo_type, repo_id

    def git(self, *args: str, input: bytes | None = None, env: dict | None = None, check: bool = True,
            user: str = SERVER_USER, tied: bool = False):
        return run_git(self.path, *args, input=input, env=env, check=check, user=user, tied=tied)

    def writer_lock(self):
        return file_lock(self.path / "hub-writer.flock", self.store.lock_timeout, f"Repository '{self.repo_id}'")

    def audit(self, user: str, op: str, ref: str, old: str | None, new: str | None) -> None:
        rec = {"time": format_date(time.time()), "user": user, "op": op, "ref": ref, "old": old or ZERO_OID,
               "new": new or ZERO_OID}
        fd = os.open(self.path / "hub-audit.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:  # one write per record (O_APPEND: whole lines, in the order of the writer lock)
            os.write(fd, (json.dumps(rec) + "\n").encode())
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- refs and revisions

    def ref_target(self, full_ref: str) -> str | None:
        """The object a full ref name points to (an annotated tag's own id, not peeled); None if none."""
        r = self.git("rev-parse", "--verify", "--quiet", full_ref, check=False)
        return r.stdout.decode().strip() if r.returncode == 0 else None

    def ref_sha(self, full_ref: str) -> str | None:
        """The commit a full ref name (or commit id) points to, tags peeled; None if none."""
        r = self.git("rev-parse", "--verify", "--quiet", f"{full_ref}^{{commit}}", check=False)
        return r.stdout.decode().strip() if r.returncode == 0 else None

    def resolve(self, rev: str) -> str:
        """Branch, tag, 'refs/heads/x', 'refs/tags/x' or a full commit sha -> commit sha (RevisionNotFound)."""
        for candidate in revision_candidates(self.repo_id, rev):
            sha = self.ref_sha(candidate)
            if sha:
                return sha
        raise revision_not_found(self.repo_id, rev)

    def branch_ref(self, rev: str) -> str:
        """The full ref of a *branch* named by rev (commits may only go to branches)."""
        name = rev[len("refs/heads/"):] if isinstance(rev, str) and rev.startswith("refs/heads/") else rev
        if (not isinstance(name, str) or name.startswith("-") or not ref_name_ok(name)
                or self.ref_sha(f"refs/heads/{name}") is None):
            self.resolve(rev)  # raises RevisionNotFound if it is nothing at all
            raise HubError(400, f"Cannot commit to revision '{rev}' of '{self.repo_id}': commits can only be made to a "
                                "branch, and this is a tag or a commit id. Create a branch from it first.")
        return f"refs/heads/{name}"

    def refs(self) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        out = self.git("for-each-ref", "--format=%(refname)%00%(objectname)%00%(*objectname)",
                       "refs/heads", "refs/tags").decode()
        branches, tags = [], []
        for line in out.splitlines():
            ref, obj, peeled = line.split("\0")
            if ref.startswith("refs/heads/"):
                branches.append((ref[len("refs/heads/"):], obj))
            elif ref.startswith("refs/tags/"):
                tags.append((ref[len("refs/tags/"):], peeled or obj))
        return branches, tags

    def commit_time(self, sha: str) -> int:
        return int(self.git("show", "-s", "--format=%ct", sha).decode().strip())

    def log_page(self, sha: str, skip: int, limit: int, max_bytes: int) -> tuple[list[dict], bool]:
        """One page of the history of ``sha``, newest first: at most ``limit`` commits after the first ``skip``,
        and at most about ``max_bytes`` of JSON (at least one commit; a single message longer than that is cut,
        and says so). Returns the commits and whether more follow.

        Commit objects are read raw (``rev-list`` + ``cat-file --batch``) and parsed here, so any bytes a commit
        message holds (control characters, invalid UTF-8, made by hand) are served, never a 500, and a huge
        message is never read whole into memory."""
        ids = self.git("rev-list", f"--skip={skip}", f"--max-count={limit + 1}", sha).decode().split()
        more = len(ids) > limit
        ids = ids[:limit]
        if not ids:
            return [], False
        proc = subprocess.Popen(git_command(self.path, "cat-file", "--batch"), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=git_env(), cwd=str(self.path))
        commits, used = [], 0
        try:  # at most 1000 ids of 41 bytes: they fit in the pipe whatever cat-file has not read yet
            proc.stdin.write("".join(f"{i}\n" for i in ids).encode())
            proc.stdin.close()
            for oid in ids:
                head = proc.stdout.readline().split()
                if len(head) != 3 or head[1] != b"commit":
                    raise GitFailed(("cat-file", "--batch"), 0, b"unexpected answer " + b" ".join(head)[:100])
                size = int(head[2])
                cap = max(1024, max_bytes - used)
                raw = proc.stdout.read(min(size, cap))
                left = size - len(raw)
                while left > 0 and (got := proc.stdout.read(min(left, 1 << 20))):
                    left -= len(got)
                proc.stdout.read(1)  # the newline after each object
                entry = _commit_entry(oid, raw, size - len(raw))
                n = len(json.dumps(entry))
                while n > max_bytes and len(raw) > 1024:  # a message whose JSON (escapes) outgrows a page
                    raw = raw[:int(len(raw) * max_bytes / n * 0.9)]
                    entry = _commit_entry(oid, raw, size - len(raw))
                    n = len(json.dumps(entry))
                if commits and used + n > max_bytes:
                    more = True
                    break
                commits.append(entry)
                used += n
        finally:
            proc.stdout.close()
            proc.kill()
            proc.wait()
        return commits, more

    # ---------------------------------------------------------------- reading trees and blobs

    def lookup(self, sha: str, paths: list[str]) -> list[Entry | None]:
        """Entries (file or directory) at the given paths of commit sha, None where missing; one git call."""
        if not paths:
            return []
        data = "".join(f"{sha}:{p}\n" for p in paths).encode()
        out = self.git("cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize)", input=data)
        result: list[Entry | None] = []
        for p, line in zip(paths, out.decode().splitlines()):
            parts = line.split(" ")
            if len(parts) == 3 and parts[1] in ("blob", "tree"):
                kind = "file" if parts[1] == "blob" else "directory"
                result.append(Entry(kind, p, parts[0], int(parts[2]) if kind == "file" else 0))
            else:
                result.append(None)
        return result

    def list_tree(self, sha: str, path: str = "", recursive: bool = False, skip: int = 0,
                  limit: int | None = None) -> tuple[list[Entry], bool]:
        """The entries of the folder ``path`` at ``sha`` (every entry below it with ``recursive``), in git's order:
        at most ``limit`` after the first ``skip``, and whether more follow. ``ls-tree``'s output is read as it
        streams and the call stops once the page is full, so a page costs the work of the entries up to it, never
        the whole listing of a huge tree."""
        if path:
            entry = self.lookup(sha, [path])[0]
            if entry is None or entry.type != "directory":
                raise entry_not_found(self.repo_id, sha, path)
            tree, prefix = entry.oid, path + "/"
        else:
            tree, prefix = f"{sha}^{{tree}}", ""
        args = ["ls-tree", "-l", "-z"] + (["-r", "-t"] if recursive else []) + [tree]
        proc = subprocess.Popen(git_command(self.path, *args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                env=git_env(), cwd=str(self.path))
        entries, seen, more, buf = [], 0, False, b""
        try:
            while not more:
                chunk = proc.stdout.read(1 << 16)
                if not chunk:
                    break
                *records, buf = (buf + chunk).split(b"\0")
                for rec in records:
                    if limit is not None and len(entries) >= limit:
                        more = True
                        break
                    meta, name = rec.decode("utf-8", "replace").split("\t", 1)
                    mode, typ, oid, size = meta.split()
                    if typ not in ("tree", "blob"):
                        continue  # submodules (commits) are not files of a Hub repository
                    seen += 1
                    if seen <= skip:
                        continue
                    if typ == "tree":
                        entries.append(Entry("directory", prefix + name, oid, 0))
                    else:
                        entries.append(Entry("file", prefix + name, oid, int(size)))
        finally:
            if more:
                proc.kill()
            proc.stdout.close()
            rc = proc.wait()
        if not more and rc != 0:
            raise GitFailed(tuple(args), rc, b"")
        return entries, more

    def all_files(self, sha: str) -> list[str]:
        out = self.git("ls-tree", "-r", "-z", "--name-only", sha).decode()
        return [p for p in out.split("\0") if p]

    def open_blob(self, oid: str) -> subprocess.Popen:
        """A streaming ``git cat-file blob``; the caller reads its stdout and must kill and wait for it."""
        return subprocess.Popen(git_command(self.path, "cat-file", "blob", oid, tied=True), stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=git_env(), cwd=str(self.path))

    # ---------------------------------------------------------------- writing

    def write_blobs(self, files: list[Path], env: dict | None = None) -> list[str]:
        """Store files as blobs (one git call, streaming: big files go straight into a pack); their object ids.
        ``env`` from :meth:`quarantine` writes them there instead of into the repository."""
        if not files:
            return []
        out = self.git("hash-object", "-w", "--no-filters", "--stdin-paths",
                       input="".join(f"{f}\n" for f in files).encode(), env=env, tied=True)
        oids = out.decode().split()
        if len(oids) != len(files):
            raise GitFailed(("hash-object",), 0, f"{len(oids)} object ids for {len(files)} files".encode())
        return oids

    @contextlib.contextmanager
    def quarantine(self):
        """A private object directory under the server's scratch space for the objects of one commit, as git's
        receive-pack does: git reads the repository's objects (alternates) and writes new ones here. They move
        into the repository just before the ref update (:meth:`_migrate`); a request that fails, or a server that
        dies, leaves nothing in the repository (a dead server's scratch is removed at the next start)."""
        qdir = self.store.new_tmpdir("objects-")
        (qdir / "pack").mkdir()
        try:
            yield qdir, {"GIT_OBJECT_DIRECTORY": str(qdir),
                         "GIT_ALTERNATE_OBJECT_DIRECTORIES": str(self.path / "objects")}
        finally:
            shutil.rmtree(qdir, ignore_errors=True)

    def _migrate(self, qdir: Path) -> None:
        """Move quarantined objects into the repository: loose objects, then packs (each .idx after its .pack, so
        that git never sees an index without its pack). Objects already there stay as they are. git has fsynced
        their contents (core.fsync); the renames are journaled in order before the later rename that updates the
        ref, and the pack folder (rarely touched) is fsynced as well."""
        objects = self.path / "objects"
        for sub in sorted(p for p in qdir.iterdir() if len(p.name) == 2 and p.is_dir()):
            (objects / sub.name).mkdir(exist_ok=True)
            for f in sub.iterdir():
                if not f.name.startswith("tmp_") and not (objects / sub.name / f.name).exists():
                    os.rename(f, objects / sub.name / f.name)
        packs = sorted((qdir / "pack").glob("pack-*"), key=lambda p: (p.suffix == ".idx", p.name))
        for f in packs:
            if not (objects / "pack" / f.name).exists():
                os.rename(f, objects / "pack" / f.name)
        if packs:
            _fsync_dir(objects / "pack")

    def _build_tree(self, head: str, ops: list[CommitOp]) -> str:
        """The tree of ``head`` with ops applied: its files listed (ls-tree), a fresh temporary index filled with
        the result (update-index), written (write-tree); three git calls whatever the commit."""
        before, modes = {}, {}
        for rec in self.git("ls-tree", "-r", "-z", "--full-tree", head).decode().split("\0"):
            if rec:
                meta, p = rec.split("\t", 1)
                mode, _, before[p] = meta.split()
                modes[(p, before[p])] = mode  # kept for unchanged entries (an executable added by hand stays one)
        after = _apply_ops(self.repo_id, before, ops)
        index = self.store.tmp / f"index-{uuid.uuid4().hex}"
        env = {"GIT_INDEX_FILE": str(index)}
        try:
            recs = "".join(f"{modes.get((p, oid), '100644')} {oid}\t{p}\0" for p, oid in after.items())
            if recs:
                self.git("update-index", "-z", "--index-info", input=recs.encode(), env=env)
            return self.git("write-tree", env=env).decode().strip()
        finally:
            index.unlink(missing_ok=True)

    def commit(self, rev: str, ops: list[CommitOp], summary: str, description: str = "",
               parent_commit: str | None = None, user: str = SERVER_USER, files: list[Path] | None = None) -> str:
        """Commit ops on top of branch rev, atomically, as ``user``; ``files`` are the contents of the "add" ops
        without a blob, in order. With parent_commit, 412 unless the branch head is it; without, a branch moved by
        a writer outside the server makes this one rebuild on the new head."""
        if parent_commit is not None and not (isinstance(parent_commit, str) and _PARENT_RE.fullmatch(parent_commit)):
            raise HubError(400, f"Invalid parentCommit {parent_commit!r}: expected a commit id (5-40 hex digits).")
        ref = self.branch_ref(rev)
        message = summary.strip() + ("\n\n" + description.strip() if description and description.strip() else "")
        if files:  # the slow part (big files), outside the writer lock and outside the repository
            with self.quarantine() as (qdir, qenv):
                oids = iter(self.write_blobs(files, env=qenv))
                for op in ops:
                    if op.kind == "add" and op.blob is None:
                        op.blob = next(oids)
                self._migrate(qdir)  # whole blobs only, referenced by nothing until the ref update below
        with self.writer_lock():
            for _ in range(10):
                head = self.ref_sha(ref)
                if head is None:
                    raise revision_not_found(self.repo_id, rev)
                if parent_commit is not None and not head.startswith(parent_commit.lower()):
                    raise _stale_parent(self.repo_id, rev, parent_commit, head)
                tree = self._build_tree(head, ops)
                new = self.git("commit-tree", "-p", head, "-F", "-", tree, input=(message + "\n").encode(),
                               user=user).decode().strip()
                maybe_crash("before-update-ref")
                if self.update_ref(ref, new, head, user, f"commit: {summary[:80]}"):
                    return new
                if parent_commit is not None:
                    raise _stale_parent(self.repo_id, rev, parent_commit, self.ref_sha(ref))
        raise busy(f"Branch '{rev}' of '{self.repo_id}' keeps moving under this commit (changed outside the server); "
                   "nothing was committed. Retry.")

    def update_ref(self, ref: str, new: str, old: str, user: str, reason: str, *, delete: bool = False) -> bool:
        """Compare-and-swap ``ref`` from ``old`` to ``new`` (or delete it), under the writer lock the caller holds.
        False if the ref is no longer at ``old``. Stale git lock files are cleared (see the module docstring)."""
        args = ["update-ref", "-m", reason] + (["-d", ref, old] if delete else [ref, new, old])
        deadline = time.monotonic() + self.store.stale_lock_seconds + 2
        while True:
            r = self.git(*args, check=False, user=user)
            if r.returncode == 0:
                self.audit(user, "delete" if delete else reason.split(":")[0], ref, old, None if delete else new)
                return True
            m = _LOCK_EXISTS_RE.search(r.stderr.decode(errors="replace"))
            if m is None:
                if old == "" or (self.ref_target(ref) or "") != old:  # exists (or a folder of refs), moved, gone
                    return False
                raise GitFailed(args, r.returncode, r.stderr)
            if not self._clear_stale_lock(Path(m.group(1))) and time.monotonic() > deadline:
                raise busy(f"'{ref}' of '{self.repo_id}' is locked by another git process ({m.group(1)}); nothing "
                           "was changed. Retry.", retry_after=5)
            time.sleep(0.05)

    def _clear_stale_lock(self, lock: Path) -> bool:
        try:
            lock = lock.resolve()
            lock.relative_to(self.path.resolve())
            age = time.time() - lock.stat().st_mtime
        except (OSError, ValueError):
            return False
        if age < self.store.stale_lock_seconds:
            return False
        lock.unlink(missing_ok=True)
        print(f"hub: removed a stale git lock {lock} ({age:.0f} s old; its writer is gone)", file=sys.stderr)
        return True

    def create_branch(self, name: str, start: str, user: str = SERVER_USER) -> str:
        validate_ref_name(name, "branch")
        sha = self.resolve(start)
        self._create_ref(f"refs/heads/{name}", sha, name, "Branch", user, f"branch: from {start}")
        return sha

    def delete_branch(self, name: str, user: str = SERVER_USER) -> None:
        if name == DEFAULT_BRANCH:
            raise HubError(403, f"Cannot delete the default branch '{DEFAULT_BRANCH}' of '{self.repo_id}'.")
        validate_ref_name(name, "branch")
        self._delete_ref(f"refs/heads/{name}", name, "Branch", user)

    def _create_ref(self, ref: str, target: str, name: str, kind: str, user: str, message: str) -> None:
        """Create ``ref`` at ``target`` only if it does not exist (compare-and-swap against no ref)."""
        with self.writer_lock():
            if self.ref_target(ref) is not None:
                raise HubError(409, f"{kind} '{name}' already exists in '{self.repo_id}'.")
            if not self.update_ref(ref, target, "", user, message):
                raise HubError(409, f"Cannot create {kind.lower()} '{name}' in '{self.repo_id}': a ref of that name "
                                    f"(or a folder of {'branches' if kind == 'Branch' else 'tags'} under it) exists.")

    def _delete_ref(self, ref: str, name: str, kind: str, user: str) -> None:
        """Delete ``ref`` only if it still points where it did when read (compare-and-swap)."""
        with self.writer_lock():
            obj = self.ref_target(ref)
            if obj is None:
                raise revision_not_found(self.repo_id, name)
            if not self.update_ref(ref, "", obj, user, "delete", delete=True):
                raise HubError(409, f"{kind} '{name}' of '{self.repo_id}' changed while deleting it; retry.")

    def create_tag(self, tag: str, rev: str, message: str | None = None, user: str = SERVER_USER) -> str:
        validate_ref_name(tag, "tag")
        sha = self.resolve(rev)
        target = sha
        if message:
            body = (f"object {sha}\ntype commit\ntag {tag}\ntagger {user} <{user}@localhost> {int(time.time())} "
                    f"+0000\n\n{message.rstrip()}\n")
            target = self.git("mktag", input=body.encode()).decode().strip()
        self._create_ref(f"refs/tags/{tag}", target, tag, "Tag", user, f"tag: {rev}")
        return sha

    def delete_tag(self, tag: str, user: str = SERVER_USER) -> None:
        validate_ref_name(tag, "tag")
        self._delete_ref(f"refs/tags/{tag}", tag, "Tag", user)


def _commit_entry(oid: str, raw: bytes, cut: int) -> dict:
    """The Hub's commit listing entry for a raw git commit object (``cut`` bytes of it were not read)."""
    head, _, message = raw.partition(b"\n\n")
    author, when = "", 0
    for line in head.split(b"\n"):
        if line.startswith(b"author "):
            author = line[len(b"author "):].split(b" <", 1)[0].decode("utf-8", "replace")
        elif line.startswith(b"committer "):
            parts = line.rsplit(b" ", 2)
            when = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0
    ws = " \t\r\n"  # not str.strip()/splitlines(): they also take \x1c-\x1f, which a message may hold
    text = message.decode("utf-8", "replace").strip(ws)
    if cut:
        text += f"\n\n[... {cut} more bytes of this commit message are not shown]"
    paragraph = text.split("\n\n", 1)[0] if text else ""
    title = " ".join(line.strip(ws) for line in paragraph.split("\n") if line.strip(ws))  # git's %s
    return {"id": oid, "title": title, "message": text, "date": format_date(when), "authors": [{"user": author}]}


def _apply_ops(repo_id: str, before: dict[str, str], ops: list[CommitOp]) -> dict[str, str]:
    """The file -> blob map after ops; 404 for deleting what is not there, 400 for a file/folder clash."""
    after = dict(before)
    for op in ops:
        if op.kind == "add":
            after[op.path] = op.blob
        elif op.kind == "delete_file":
            if op.path not in after:
                raise HubError(404, f"Cannot delete '{op.path}': a file with this name doesn't exist in "
                                    f"'{repo_id}'.", "EntryNotFound")
            del after[op.path]
        else:  # delete_folder
            prefix = op.path + "/"
            doomed = [p for p in after if p.startswith(prefix)]
            if not doomed:
                raise HubError(404, f"Cannot delete folder '{op.path}': a folder with this name doesn't exist "
                                    f"in '{repo_id}'.", "EntryNotFound")
            for p in doomed:
                del after[p]
    dirs = {p.rsplit("/", i)[0] for p in after for i in range(1, p.count("/") + 1)}
    clash = sorted(dirs & after.keys())
    if clash:
        raise HubError(400, f"Path conflict in '{repo_id}': '{clash[0]}' would be both a file and a folder. Delete "
                            "one of them in the same commit.")
    return after


def _stale_parent(repo_id: str, rev: str, parent: str, head: str | None) -> HubError:
    return HubError(412, f"A commit has happened since. Please refresh and try again. (branch '{rev}' of '{repo_id}' "
                         f"is at {head}, not at the parentCommit {parent})")
