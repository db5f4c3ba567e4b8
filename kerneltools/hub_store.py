"""Git-backed storage for the loopback Hub server.

One bare git repository per Hub repository, at ``<root>/<type>s/<namespace>/<name>.git``. Everything the server
knows lives in those repositories (commits, branches, tags), so a restart loses nothing.

Commits are built off to the side (a temporary ``GIT_INDEX_FILE``: read-tree, hash-object -w, update-index,
write-tree, commit-tree) and published with ``git update-ref <ref> <new> <old>``, an atomic compare-and-swap: a
commit is either entirely visible or not at all, and two commits racing on one branch never lose one.

Every git call goes through :meth:`Repo.git` with an argument list (never a shell); user-supplied names reach git
only after validation, behind fixed prefixes (``refs/heads/``) or as stdin data.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO_TYPES = ("model", "dataset", "space", "kernel")
DEFAULT_BRANCH = "main"
ZERO_OID = "0" * 40
LOCAL_USER = "local-user"
LOCAL_EMAIL = "local-user@localhost"

_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_HEX40_RE = re.compile(r"^[0-9a-f]{40}$")
_PARENT_RE = re.compile(r"^[0-9a-fA-F]{5,40}$")
# test-only fault injection (see docs/hub-server.md): crash the server process at a named point of a commit
CRASH_ENV = "KERNELTOOLS_HUB_CRASH_AT"


class HubError(Exception):
    """An error the HTTP layer turns into a status code, ``X-Error-Code`` and a JSON ``{"error": ...}`` body."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def repo_not_found(repo_type: str, repo_id: str) -> HubError:
    return HubError(404, f"Repository not found: {repo_type} '{repo_id}' does not exist on this server.", "RepoNotFound")


def revision_not_found(repo_id: str, rev: str) -> HubError:
    return HubError(404, f"Invalid rev id: '{rev}' is not a branch, tag or commit of '{repo_id}'.", "RevisionNotFound")


def entry_not_found(repo_id: str, rev: str, path: str) -> HubError:
    return HubError(404, f"Entry not found: '{path}' does not exist in '{repo_id}' at revision '{rev}'.", "EntryNotFound")


def _maybe_crash(point: str) -> None:
    if os.environ.get(CRASH_ENV) == point:
        os._exit(137)


# --------------------------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------------------------


def validate_repo_type(repo_type: str) -> str:
    if repo_type not in REPO_TYPES:
        raise HubError(400, f"Unknown repo type '{repo_type}': expected one of {', '.join(REPO_TYPES)}.")
    return repo_type


def validate_name_part(part: str, what: str) -> str:
    if (
        not isinstance(part, str)
        or not _NAME_RE.match(part)
        or ".." in part
        or "--" in part
        or part.endswith(".git")
    ):
        raise HubError(
            400,
            f"Invalid {what} {part!r}: use 1-96 letters, digits, '-', '_' or '.', starting and ending with a letter "
            "or digit, without '--' or '..' and not ending in '.git'.",
        )
    return part


def validate_repo_id(repo_id: str) -> str:
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise HubError(400, f"Invalid repo id {repo_id!r}: expected '<namespace>/<name>'.")
    ns, name = repo_id.split("/")
    validate_name_part(ns, "namespace")
    validate_name_part(name, "repo name")
    return repo_id


def validate_path(path: object, *, folder: bool = False) -> str:
    """A file (or folder) path inside a repo: relative, '/'-separated, no empty, '.', '..' or '.git' components."""
    if not isinstance(path, str):
        raise HubError(400, f"Invalid path {path!r}: expected a string.")
    p = path[:-1] if folder and path.endswith("/") else path
    problem = None
    if not p:
        problem = "it is empty"
    elif len(p) > 4096:
        problem = "it is longer than 4096 characters"
    elif p.startswith("/"):
        problem = "it is absolute (starts with '/')"
    elif "\\" in p:
        problem = "it contains a backslash"
    elif any(ord(c) < 32 or ord(c) == 127 for c in p):
        problem = "it contains a control character"
    else:
        for comp in p.split("/"):
            if comp in ("", ".", ".."):
                problem = f"it has an empty, '.' or '..' component ({comp!r})"
                break
            if comp.lower() == ".git":
                problem = "it has a '.git' component"
                break
    if problem:
        raise HubError(400, f"Invalid path {path!r}: {problem}. Paths are relative, '/'-separated, like 'build/x/a.py'.")
    return p


def _check_ref_format(full_ref: str) -> bool:
    r = subprocess.run(["git", "check-ref-format", full_ref], capture_output=True)
    return r.returncode == 0


def validate_ref_name(name: object, kind: str = "branch") -> str:
    """A branch or tag short name, as the Hub accepts it (``v1``, ``release/2``)."""
    if not isinstance(name, str) or not name:
        raise HubError(400, f"Invalid {kind} name {name!r}: expected a non-empty string.")
    bad = None
    if name.startswith("-"):
        bad = "it starts with '-'"
    elif name.startswith("refs/") or name == "HEAD":
        bad = "'refs/...' and 'HEAD' are reserved"
    elif _HEX40_RE.match(name):
        bad = "it looks like a commit id"
    elif len(name) > 255 or any(ord(c) < 33 or ord(c) == 127 for c in name):
        bad = "it is too long or contains spaces/control characters"
    elif not _check_ref_format(f"refs/heads/{name}"):
        bad = "git check-ref-format rejects it (no '..', '~', '^', ':', '?', '*', '[', '\\\\', '@{', trailing '.lock' or '/')"
    if bad:
        raise HubError(400, f"Invalid {kind} name {name!r}: {bad}.")
    return name


def format_date(ts: int) -> str:
    """Hub date format ('%Y-%m-%dT%H:%M:%S.%fZ' with milliseconds); huggingface_hub rejects '+00:00'."""
    d = _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


# --------------------------------------------------------------------------------------------------------------------
# storage
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


class GitStore:
    """The storage root: creates and opens repositories."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        scratch = self.root / ".tmp"
        scratch.mkdir(exist_ok=True)
        for d in scratch.iterdir():  # leftovers of crashed servers (temp indexes, decoded uploads): never data
            pid = d.name.partition("-")[2]
            if d.name.startswith("pid-") and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(d, ignore_errors=True)
        self.tmp = scratch / f"pid-{os.getpid()}"  # per process: a second server on this root keeps its own
        self.tmp.mkdir(exist_ok=True)
        self._create_lock = threading.Lock()
        if shutil.which("git") is None:
            raise RuntimeError("git was not found on PATH; the Hub server stores repositories with the git CLI. "
                               "Install git (Debian: apt-get install git).")

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

    def create(self, repo_type: str, repo_id: str) -> bool:
        """Create the repo with an initial commit on main; False if it already exists."""
        path = self.repo_path(repo_type, repo_id)
        with self._create_lock:
            if path.exists():
                return False
            staging = self.tmp / f"create-{uuid.uuid4().hex}.git"
            _git(None, "init", "--quiet", "--bare", "--initial-branch", DEFAULT_BRANCH, str(staging))
            repo = Repo(self, staging, repo_type, repo_id)
            blob = repo.git("hash-object", "-w", "--stdin", input=_GITATTRIBUTES).decode().strip()
            tree = repo.git("mktree", input=f"100644 blob {blob}\t.gitattributes\n".encode()).decode().strip()
            commit = repo.git("commit-tree", "-m", "initial commit", tree).decode().strip()
            repo.git("update-ref", f"refs/heads/{DEFAULT_BRANCH}", commit, "")
            path.parent.mkdir(parents=True, exist_ok=True)
            os.rename(staging, path)  # the repo appears complete or not at all
            return True


_GITATTRIBUTES = b"""\
# Created by the kerneltools loopback Hub server (files are stored as plain git blobs, never LFS/Xet).
*.bin filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _git_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in list(env):  # a caller's GIT_DIR/GIT_INDEX_FILE/GIT_WORK_TREE must never leak in
        if k.startswith("GIT_"):
            del env[k]
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_LITERAL_PATHSPECS="1",
        GIT_TERMINAL_PROMPT="0",
        GIT_AUTHOR_NAME=LOCAL_USER,
        GIT_AUTHOR_EMAIL=LOCAL_EMAIL,
        GIT_COMMITTER_NAME=LOCAL_USER,
        GIT_COMMITTER_EMAIL=LOCAL_EMAIL,
        LC_ALL="C",
    )
    if extra:
        env.update(extra)
    return env


class GitFailed(Exception):
    def __init__(self, args, returncode, stderr):
        super().__init__(f"git {' '.join(args)} failed ({returncode}): {stderr.decode(errors='replace').strip()}")
        self.returncode = returncode
        self.stderr = stderr


def _git(git_dir: Path | None, *args: str, input: bytes | None = None, env: dict | None = None,
         check: bool = True) -> bytes:
    cmd = ["git"] + ([f"--git-dir={git_dir}"] if git_dir is not None else []) + list(args)
    r = subprocess.run(cmd, input=input, capture_output=True, env=_git_env(env),
                       cwd=str(git_dir) if git_dir is not None else None)
    if check and r.returncode != 0:
        raise GitFailed(args, r.returncode, r.stderr)
    return r.stdout if check else r


class Repo:
    def __init__(self, store: GitStore, path: Path, repo_type: str, repo_id: str):
        self.store, self.path, self.repo_type, self.repo_id = store, path, repo_type, repo_id

    def git(self, *args: str, input: bytes | None = None, env: dict | None = None, check: bool = True):
        return _git(self.path, *args, input=input, env=env, check=check)

    # ---------------------------------------------------------------- refs and revisions

    def ref_sha(self, full_ref: str) -> str | None:
        """The commit a full ref name points to (tags peeled), or None."""
        r = self.git("rev-parse", "--verify", "--quiet", f"{full_ref}^{{commit}}", check=False)
        return r.stdout.decode().strip() if r.returncode == 0 else None

    def resolve(self, rev: str) -> str:
        """Branch, tag, 'refs/heads/x', 'refs/tags/x' or a full commit sha -> commit sha (RevisionNotFound)."""
        if not isinstance(rev, str) or not rev:
            raise revision_not_found(self.repo_id, str(rev))
        if _HEX40_RE.match(rev.lower()):
            sha = self.ref_sha(rev.lower())
            if sha:
                return sha
            raise revision_not_found(self.repo_id, rev)
        candidates = []
        if rev.startswith(("refs/heads/", "refs/tags/")):
            if _check_ref_format(rev) and not rev.split("/", 2)[2].startswith("-"):
                candidates = [rev]
        elif not rev.startswith("-") and _check_ref_format(f"refs/heads/{rev}"):
            candidates = [f"refs/heads/{rev}", f"refs/tags/{rev}"]
        for ref in candidates:
            sha = self.ref_sha(ref)
            if sha:
                return sha
        raise revision_not_found(self.repo_id, rev)

    def branch_ref(self, rev: str) -> str:
        """The full ref of a *branch* named by rev (commits may only go to branches)."""
        name = rev[len("refs/heads/"):] if rev.startswith("refs/heads/") else rev
        if name.startswith("-") or not _check_ref_format(f"refs/heads/{name}") or self.ref_sha(f"refs/heads/{name}") is None:
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

    def log(self, sha: str, limit: int = 1000) -> list[dict]:
        out = self.git("log", f"--max-count={limit}", "--format=%H%x1f%an%x1f%ct%x1f%s%x1f%B%x1e", sha).decode()
        commits = []
        for rec in out.split("\x1e"):
            rec = rec.strip("\n")
            if not rec:
                continue
            h, author, ct, subject, body = rec.split("\x1f")
            commits.append({"id": h, "title": subject, "message": body.strip(), "date": format_date(int(ct)),
                            "authors": [{"user": author}]})
        return commits

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

    def list_tree(self, sha: str, path: str = "", recursive: bool = False) -> list[Entry]:
        if path:
            entry = self.lookup(sha, [path])[0]
            if entry is None or entry.type != "directory":
                raise entry_not_found(self.repo_id, sha, path)
            tree, prefix = entry.oid, path + "/"
        else:
            tree, prefix = f"{sha}^{{tree}}", ""
        args = ["ls-tree", "-l", "-z"] + (["-r", "-t"] if recursive else []) + [tree]
        entries = []
        for rec in self.git(*args).decode().split("\0"):
            if not rec:
                continue
            meta, name = rec.split("\t", 1)
            mode, typ, oid, size = meta.split()
            if typ == "tree":
                entries.append(Entry("directory", prefix + name, oid, 0))
            elif typ == "blob":
                entries.append(Entry("file", prefix + name, oid, int(size)))
        return entries

    def all_files(self, sha: str) -> list[str]:
        out = self.git("ls-tree", "-r", "-z", "--name-only", sha).decode()
        return [p for p in out.split("\0") if p]

    def open_blob(self, oid: str) -> subprocess.Popen:
        return subprocess.Popen(["git", f"--git-dir={self.path}", "cat-file", "blob", oid], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=_git_env(), cwd=str(self.path))

    # ---------------------------------------------------------------- writing

    def write_blobs(self, files: list[Path]) -> list[str]:
        """Store files as blobs (one git call); returns their object ids."""
        if not files:
            return []
        out = self.git("hash-object", "-w", "--no-filters", "--stdin-paths",
                       input="".join(f"{f}\n" for f in files).encode())
        oids = out.decode().split()
        assert len(oids) == len(files)
        return oids

    def _build_tree(self, head: str, ops: list[CommitOp]) -> str:
        index = self.store.tmp / f"index-{uuid.uuid4().hex}"
        env = {"GIT_INDEX_FILE": str(index)}
        try:
            self.git("read-tree", head, env=env)
            before = {}
            for rec in self.git("ls-files", "-z", "--stage", env=env).decode().split("\0"):
                if rec:
                    meta, p = rec.split("\t", 1)
                    before[p] = meta.split()[1]
            after = dict(before)
            for op in ops:
                if op.kind == "add":
                    after[op.path] = op.blob
                elif op.kind == "delete_file":
                    if op.path not in after:
                        raise HubError(404, f"Cannot delete '{op.path}': a file with this name doesn't exist in "
                                            f"'{self.repo_id}'.", "EntryNotFound")
                    del after[op.path]
                else:  # delete_folder
                    prefix = op.path + "/"
                    doomed = [p for p in after if p.startswith(prefix)]
                    if not doomed:
                        raise HubError(404, f"Cannot delete folder '{op.path}': a folder with this name doesn't exist "
                                            f"in '{self.repo_id}'.", "EntryNotFound")
                    for p in doomed:
                        del after[p]
            dirs = {p.rsplit("/", i)[0] for p in after for i in range(1, p.count("/") + 1)}
            clash = sorted(dirs & after.keys())
            if clash:
                raise HubError(400, f"Path conflict in '{self.repo_id}': '{clash[0]}' would be both a file and a "
                                    "folder. Delete one of them in the same commit.")
            recs = [f"0 {ZERO_OID}\t{p}\0" for p in before if p not in after]
            recs += [f"100644 {oid}\t{p}\0" for p, oid in after.items() if before.get(p) != oid]
            if recs:
                self.git("update-index", "-z", "--index-info", input="".join(recs).encode(), env=env)
            return self.git("write-tree", env=env).decode().strip()
        finally:
            index.unlink(missing_ok=True)

    def commit(self, rev: str, ops: list[CommitOp], summary: str, description: str = "",
               parent_commit: str | None = None, max_attempts: int = 100) -> str:
        """Commit ops on top of branch rev; atomic. With parent_commit, 412 unless the branch head is it;
        without, a concurrent commit makes this one retry on the new head (nothing is ever lost)."""
        if parent_commit is not None and not (isinstance(parent_commit, str) and _PARENT_RE.match(parent_commit)):
            raise HubError(400, f"Invalid parentCommit {parent_commit!r}: expected a commit id (5-40 hex digits).")
        ref = self.branch_ref(rev)
        message = summary.strip() + ("\n\n" + description.strip() if description and description.strip() else "")
        message += "\n"
        delay = 0.005
        for _ in range(max_attempts):
            head = self.ref_sha(ref)
            if head is None:
                raise revision_not_found(self.repo_id, rev)
            if parent_commit is not None and not head.startswith(parent_commit.lower()):
                raise _stale_parent(self.repo_id, rev, parent_commit, head)
            tree = self._build_tree(head, ops)
            new = self.git("commit-tree", "-p", head, "-F", "-", tree, input=message.encode()).decode().strip()
            _maybe_crash("before-update-ref")
            r = self.git("update-ref", "-m", f"commit: {summary[:80]}", ref, new, head, check=False)
            if r.returncode == 0:
                return new
            now = self.ref_sha(ref)
            if now != head and parent_commit is not None:
                raise _stale_parent(self.repo_id, rev, parent_commit, now)
            # lock contention (ref unchanged) or a concurrent commit moved the branch: build again on the new head
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        raise HubError(503, f"Branch '{rev}' of '{self.repo_id}' is too busy (too many concurrent commits); "
                            "nothing was committed. Retry.")

    def create_branch(self, name: str, start: str) -> str:
        validate_ref_name(name, "branch")
        sha = self.resolve(start)
        r = self.git("update-ref", f"refs/heads/{name}", sha, "", check=False)
        if r.returncode != 0:
            if self.ref_sha(f"refs/heads/{name}") is not None:
                raise HubError(409, f"Branch '{name}' already exists in '{self.repo_id}'.")
            raise HubError(409, f"Cannot create branch '{name}' in '{self.repo_id}': "
                                f"{r.stderr.decode(errors='replace').strip()}")
        return sha

    def delete_branch(self, name: str) -> None:
        if name == DEFAULT_BRANCH:
            raise HubError(403, f"Cannot delete the default branch '{DEFAULT_BRANCH}' of '{self.repo_id}'.")
        validate_ref_name(name, "branch")
        self._delete_ref(f"refs/heads/{name}", name, "Branch")

    def _delete_ref(self, ref: str, name: str, kind: str) -> None:
        """Delete ``ref`` only if it still points where it did when read (compare-and-swap)."""
        obj = self.git("rev-parse", "--verify", "--quiet", ref, check=False)
        if obj.returncode != 0:
            raise revision_not_found(self.repo_id, name)
        r = self.git("update-ref", "-d", ref, obj.stdout.decode().strip(), check=False)
        if r.returncode != 0:
            raise HubError(409, f"{kind} '{name}' of '{self.repo_id}' changed while deleting it; retry.")

    def create_tag(self, tag: str, rev: str, message: str | None = None) -> str:
        validate_ref_name(tag, "tag")
        sha = self.resolve(rev)
        target = sha
        if message:
            body = (f"object {sha}\ntype commit\ntag {tag}\ntagger {LOCAL_USER} <{LOCAL_EMAIL}> {int(time.time())} "
                    f"+0000\n\n{message.rstrip()}\n")
            target = self.git("mktag", input=body.encode()).decode().strip()
        r = self.git("update-ref", f"refs/tags/{tag}", target, "", check=False)
        if r.returncode != 0:
            if self.git("rev-parse", "--verify", "--quiet", f"refs/tags/{tag}", check=False).returncode == 0:
                raise HubError(409, f"Tag '{tag}' already exists in '{self.repo_id}'.")
            raise HubError(409, f"Cannot create tag '{tag}': {r.stderr.decode(errors='replace').strip()}")
        return sha

    def delete_tag(self, tag: str) -> None:
        validate_ref_name(tag, "tag")
        self._delete_ref(f"refs/tags/{tag}", tag, "Tag")


def _stale_parent(repo_id: str, rev: str, parent: str, head: str | None) -> HubError:
    return HubError(412, f"A commit has happened since. Please refresh and try again. (branch '{rev}' of '{repo_id}' "
                         f"is at {head}, not at the parentCommit {parent})")


def new_tmpdir(store: GitStore) -> Path:
    return Path(tempfile.mkdtemp(prefix="upload-", dir=store.tmp))
