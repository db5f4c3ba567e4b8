"""The loopback Hub server: its routes, the server object, running it (``serve_hub``, ``HubProcess``) and
``python -m kerneltools serve``.

Serves the subset of the Hub API that huggingface_hub>=2.4 and kernels 0.17.2 use to publish and load kernels:
create repo, repo info, refs, tree, paths-info, commits, preupload (always "regular": no LFS/Xet), ndjson commit,
branches, tags, resolve (HEAD/GET with Range), org overview (trustedKernelPublisher), validate-yaml, whoami-v2.
Who may do what: :mod:`.auth`. See docs/hub-server.md.

    python -m kerneltools serve --root DIR [--host 127.0.0.1] [--port 0]

or, from Python (tests, demo)::

    with serve_hub(tmp_path / "hub", trusted_orgs=["geglu-kernels"]) as hub:
        os.environ.update(hub.env)   # HF_ENDPOINT and HF_TOKEN (a write token for the trusted orgs)
        ...
        hub.restart()   # same root, same port
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

import kerneltools.hub.auth as auth
from .errors import HubError, entry_not_found, forbidden, unauthorized
from .http import MAX_JSON_BODY, HubHandlerBase, LimitedThreadingHTTPServer, loads_json, write_request_problem
from .names import DEFAULT_BRANCH, REPO_TYPES, validate_name_part, validate_namespace, validate_path, \
    validate_ref_name, validate_repo_id, validate_text
from .storage import CRASH_ENV, GitStore, Repo, format_date, maybe_crash
from .upload import read_commit_payload

DEFAULT_TRUSTED_ORGS = ("geglu-kernels",)
DEFAULT_MAX_COMMIT_BYTES = 2 * 1024**3
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_TIMEOUT = 30.0
DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_SHUTDOWN_GRACE = 2.0
# work per request (docs/hub-server.md, "Limits and timeouts")
MAX_PATHS_PER_CALL = 1000  # paths-info paths, preupload files
TREE_PAGE = 1000  # entries per page of a tree listing, as huggingface.co pages them (?cursor= goes on)
COMMITS_PAGE = 50  # the commit listing's default page, as on huggingface.co (?limit= up to MAX_COMMITS_PAGE)
MAX_COMMITS_PAGE = 1000
MAX_COMMITS_PAGE_BYTES = 1 << 20  # a page ends early rather than grow past this (Link: rel="next" goes on)
MAX_YAML_BYTES = 256 << 10  # README front matter checked by validate-yaml
MAX_YAML_DEPTH = 64
MAX_YAML_EVENTS = 10_000  # parser events (scalars, mapping and sequence starts and ends, aliases)
DEFAULT_STALE_LOCK_SECONDS = 5.0
_TYPE_BY_PLURAL = {f"{t}s": t for t in REPO_TYPES}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}
READ, WRITE = "read", "write"
# (operation, method) -> (handler, access, min and max number of path arguments after the operation)
_REPO_OPS = {
    (None, "GET"): ("_info", READ, 0, 0), ("revision", "GET"): ("_info", READ, 1, 1),
    ("refs", "GET"): ("_refs", READ, 0, 0), ("tree", "GET"): ("_tree", READ, 1, 10**6),
    ("paths-info", "POST"): ("_paths_info", READ, 1, 1), ("commits", "GET"): ("_commits", READ, 1, 1),
    ("preupload", "POST"): ("_preupload", WRITE, 1, 1), ("commit", "POST"): ("_commit", WRITE, 1, 1),
    ("branch", "POST"): ("_branch_create", WRITE, 1, 1), ("branch", "DELETE"): ("_branch_delete", WRITE, 1, 1),
    ("tag", "POST"): ("_tag_create", WRITE, 1, 1), ("tag", "DELETE"): ("_tag_delete", WRITE, 1, 1),
}


class HubHTTPServer(LimitedThreadingHTTPServer):
    def __init__(self, addr, store: GitStore, *, quiet: bool = False,
                 max_commit_bytes: int = DEFAULT_MAX_COMMIT_BYTES, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 timeout: float = DEFAULT_TIMEOUT, public_url: str | None = None,
                 header_timeout: float = DEFAULT_HEADER_TIMEOUT, max_json_bytes: int = MAX_JSON_BODY):
        self.store = store
        self.auth = auth.AuthFile(store.root)
        self.quiet = quiet
        self.max_commit_bytes = max_commit_bytes
        super().__init__(addr, HubRequestHandler, max_connections=max_connections, timeout=timeout,
                         header_timeout=header_timeout, max_json_bytes=max_json_bytes)
        host, port = self.server_address[:2]
        # every URL the server returns is built from this, never from the request's Host header
        self.url = (public_url or f"http://{host}:{port}").rstrip("/")
        self.hosts = {urlsplit(self.url).netloc.lower()} | {f"{h}:{port}" for h in (host, "127.0.0.1", "localhost")}
        self.origins = {self.url.lower()} | {f"http://{h}" for h in self.hosts}


class HubRequestHandler(HubHandlerBase):
    server: HubHTTPServer

    # ------------------------------------------------------------------ routing and access

    def route(self, method: str, s: list[str]) -> None:
        self.cfg = auth.config_or_503(self.server.auth)
        self.ident = auth.identify(self.cfg, self.headers.get("Authorization"))
        if s[:1] == ["api"]:
            return self._api(method, s[1:])
        # file URLs: /{prefix}{ns}/{name}/resolve/{rev}/{path...}; models have no prefix
        if len(s) >= 5 and s[0] in ("kernels", "datasets", "spaces") and s[3] == "resolve":
            return self._resolve(method, _TYPE_BY_PLURAL[s[0]], f"{s[1]}/{s[2]}", s[4], s[5:])
        if len(s) >= 4 and s[2] == "resolve":
            return self._resolve(method, "model", f"{s[0]}/{s[1]}", s[3], s[4:])
        raise HubError(404, f"Not found: {method} {self.path.split('?')[0]}")

    def _api(self, method: str, rest: list[str]) -> None:
        if rest == ["whoami-v2"] and method == "GET":
            return self._whoami()
        if rest == ["repos", "create"] and method == "POST":
            return self._create_repo()
        if rest == ["validate-yaml"] and method == "POST":
            auth.require_read(self.cfg, self.ident)
            return self._validate_yaml()
        if len(rest) == 3 and rest[0] == "organizations" and rest[2] == "overview" and method == "GET":
            auth.require_read(self.cfg, self.ident)
            return self._org_overview(rest[1])
        if len(rest) >= 3 and rest[0] in _TYPE_BY_PLURAL:
            return self._repo_api(method, _TYPE_BY_PLURAL[rest[0]], f"{rest[1]}/{rest[2]}", rest[3:])
        raise HubError(404, f"No such API endpoint on this server: {method} {self.path.split('?')[0]}")

    def _check_write(self, namespace: str, what: str, *, ndjson: bool = False) -> None:
        """A write: refused if it may come from another site (403), without a token (401), or without the role
        (403). Runs before any of the request body is read."""
        has_body = bool(self.headers.get("Transfer-Encoding")) or (self.headers.get("Content-Length") or "0") != "0"
        types = ("application/x-ndjson",) if ndjson else ("application/json",)
        problem = write_request_problem(self.headers, self.server.origins, self.server.hosts, has_body, types)
        if problem:
            raise forbidden(problem)
        auth.require_write(self.ident, namespace, what)

    def _open(self, repo_type: str, repo_id: str) -> Repo:
        _check_repo_id(repo_id)
        return self.server.store.open(repo_type, repo_id)

    def _repo_api(self, method: str, repo_type: str, repo_id: str, rest: list[str]) -> None:
        op, args = (rest[0], rest[1:]) if rest else (None, [])
        spec = _REPO_OPS.get((op, method))
        if spec is None or not spec[2] <= len(args) <= spec[3]:
            raise HubError(404, f"No such API endpoint on this server: {method} {self.path.split('?')[0]}")
        handler, access, _, _ = spec
        _check_repo_id(repo_id)  # an invalid id is a missing repo (404) before any access check
        if access == WRITE:
            self._check_write(repo_id.split("/")[0], f"write to '{repo_id}'", ndjson=op == "commit")
        else:
            auth.require_read(self.cfg, self.ident)
        getattr(self, handler)(self._open(repo_type, repo_id), args)

    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        return f"{self.server.url}/{_URL_PREFIX[repo_type]}{repo_id}"

    # ------------------------------------------------------------------ account, org, card

    def _whoami(self) -> None:
        if self.ident is None:
            raise unauthorized("Invalid username or password.")
        self.send_json(auth.whoami(self.ident))

    def _create_repo(self) -> None:
        problem = write_request_problem(self.headers, self.server.origins, self.server.hosts, True,
                                        ("application/json",))
        if problem:
            raise forbidden(problem)
        if self.ident is None:  # before reading anything of the body
            auth.require_write(None, "", "create a repository")
        body = self.json_body(required=True)
        name, org = body.get("name"), body.get("organization") or self.ident.user
        repo_type = body.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Unknown repo type {repo_type!r}: expected one of {', '.join(REPO_TYPES)}.")
        validate_namespace(org, "namespace")
        validate_name_part(name, "repo name")
        repo_id = f"{org}/{name}"
        auth.require_write(self.ident, org, f"create repositories in '{org}'")
        url = self._repo_url(repo_type, repo_id)
        if not self.server.store.create(repo_type, repo_id, self.ident.user):
            e = HubError(409, f"You already created this {repo_type} repo: '{repo_id}'.")
            return self.send_error_json(e, body={"error": e.message, "url": url})
        self.send_json({"url": url, "name": repo_id, "id": repo_id})

    def _validate_yaml(self) -> None:
        body = self.json_body(required=True)
        content = body.get("content")
        if not isinstance(content, str):
            raise HubError(400, "validate-yaml expects {'content': str, 'repoType': str}.")
        errors = []
        lines = content.splitlines()
        if lines and lines[0].strip() == "---":
            end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), None)
            if end is None:
                errors.append({"message": "YAML front matter starts with '---' but is never closed by '---'."})
            else:
                errors += _yaml_errors("\n".join(lines[1:end]))
        self.send_json({"errors": errors, "warnings": []}, 400 if errors else 200)

    def _org_overview(self, org: str) -> None:
        try:
            validate_name_part(org, "organization")
        except HubError:
            raise HubError(404, f"Organization '{org}' not found.") from None
        trusted = auth.is_trusted(self.cfg, org)
        if not (trusted or auth.known_org(self.cfg, org) or org in self.server.store.namespaces()):
            raise HubError(404, f"Organization '{org}' not found on this server.")
        self.send_json({"name": org, "fullname": org, "avatarUrl": "", "type": "org", "isVerified": trusted,
                        "trustedKernelPublisher": trusted})

    # ------------------------------------------------------------------ reading a repo

    def _info(self, repo: Repo, args: list[str]) -> None:
        sha = repo.resolve(args[0] if args else DEFAULT_BRANCH)
        info = {
            "id": repo.repo_id, "_id": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": sha,
            "lastModified": format_date(repo.commit_time(sha)), "private": False, "disabled": False,
            "gated": False, "downloads": 0, "likes": 0, "tags": [],
        }
        if repo.repo_type != "kernel":  # the Hub sends no siblings for kernels; hf_hub 1.x crashes on them
            info["siblings"] = [{"rfilename": p} for p in repo.all_files(sha)]
        self.send_json(info)

    def _refs(self, repo: Repo, args: list[str]) -> None:
        branches, tags = repo.refs()
        out = {
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in branches],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in tags],
            "converts": [],
        }
        if self.query.get("include_prs") not in (None, "", "0", "false", "False"):
            out["pullRequests"] = []
        self.send_json(out)

    def _tree(self, repo: Repo, args: list[str]) -> None:
        sha = repo.resolve(args[0])
        path = validate_path("/".join(args[1:]), folder=True) if len(args) > 1 else ""
        recursive = self.query.get("recursive", "").lower() in ("1", "true", "yes")
        skip = _query_int(self.query, "cursor", 0, 0, 10**12)
        entries, more = repo.list_tree(sha, path, recursive, skip=skip, limit=TREE_PAGE)
        headers = {}
        if more:  # as huggingface.co pages tree listings: the next page's URL in a Link header
            where = sha + (f"/{quote(path, safe='/')}" if path else "")
            api = f"{self.server.url}/api/{repo.repo_type}s/{repo.repo_id}/tree/{where}"
            headers["Link"] = (f'<{api}?recursive={str(recursive).lower()}&cursor={skip + len(entries)}>; '
                               'rel="next"')
        self.send_json([e.to_json() for e in entries], headers=headers)

    def _commits(self, repo: Repo, args: list[str]) -> None:
        """One page of the history, newest first. As on huggingface.co: ``?limit=`` (default 50, at most 1000)
        and ``?p=`` (page number, from 0); the next page, if any, is in ``Link: <...>; rel="next"``. A page also
        ends early once it holds MAX_COMMITS_PAGE_BYTES of JSON; its next link then says where to go on
        (``?skip=``, which this server also accepts). Next links name the commit listed from, so pages stay
        consistent while the branch moves."""
        sha = repo.resolve(args[0])
        limit = min(_query_int(self.query, "limit", COMMITS_PAGE, 1, 10**9), MAX_COMMITS_PAGE)
        if "skip" in self.query:
            skip = _query_int(self.query, "skip", 0, 0, 10**12)
        else:
            skip = _query_int(self.query, "p", 0, 0, 10**9) * limit
        commits, more = repo.log_page(sha, skip, limit, MAX_COMMITS_PAGE_BYTES)
        headers = {}
        if more:
            nxt = skip + len(commits)
            where = f"p={nxt // limit}" if nxt % limit == 0 else f"skip={nxt}"
            api = f"{self.server.url}/api/{repo.repo_type}s/{repo.repo_id}/commits/{sha}"
            headers["Link"] = f'<{api}?{where}&limit={limit}>; rel="next"'
        self.send_json(commits, headers=headers)

    def _paths_info(self, repo: Repo, args: list[str]) -> None:
        sha = repo.resolve(args[0])
        data = self.read_small_body()
        too_many = HubError(413, f"paths-info takes at most {MAX_PATHS_PER_CALL} paths per call; split the list "
                                 "into several calls.")
        if "json" in (self.headers.get("Content-Type") or ""):
            obj = loads_json(data)
            paths = obj.get("paths", []) if isinstance(obj, dict) else None
        else:
            try:  # stops counting past the limit (a 4 MB body of 'paths=a&...' is never split whole)
                form = parse_qs(data.decode(errors="replace"), max_num_fields=MAX_PATHS_PER_CALL + 8)
                paths = form.get("paths", [])
            except ValueError:
                raise too_many from None
        paths = [paths] if isinstance(paths, str) else paths
        if not isinstance(paths, list):
            raise HubError(400, "paths-info expects {'paths': [...]}.")
        if len(paths) > MAX_PATHS_PER_CALL:
            raise too_many
        paths = [validate_path(p, folder=True) for p in paths]
        self.send_json([e.to_json() for e in repo.lookup(sha, paths) if e is not None])

    def _resolve(self, method: str, repo_type: str, repo_id: str, rev: str, path_segs: list[str]) -> None:
        if method not in ("GET", "HEAD"):
            raise HubError(405, "Only GET and HEAD are allowed on file URLs.")
        auth.require_read(self.cfg, self.ident)
        repo = self._open(repo_type, repo_id)
        sha = repo.resolve(rev)
        path = validate_path("/".join(path_segs))
        entry = repo.lookup(sha, [path])[0]
        if entry is None or entry.type != "file":
            return self.send_error_json(entry_not_found(repo_id, rev, path), {"X-Repo-Commit": sha})
        size = entry.size
        headers = {"ETag": f'"{entry.oid}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng and method == "GET":
            parsed = _parse_range(rng, size)
            if parsed == "unsatisfiable":
                headers["Content-Range"] = f"bytes */{size}"
                e = HubError(416, f"Requested range {rng!r} is not satisfiable for a file of {size} bytes.")
                return self.send_error_json(e, headers)
            if parsed is not None:
                (start, end), status = parsed, 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(0, end - start + 1)
        self._send_file_head(status, length, headers)
        if method == "GET" and length:
            self._stream_blob(repo, entry.oid, start, length, path)

    def _send_file_head(self, status: int, length: int, headers: dict) -> None:
        self._finish_body()
        self.answered = True
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _stream_blob(self, repo: Repo, oid: str, start: int, length: int, path: str) -> None:
        proc = repo.open_blob(oid)
        # test-only (docs/hub-server.md): die after sending the first half of this file's body
        crash_after = length // 2 if os.environ.get(CRASH_ENV) == f"mid-download:{path}" else None
        try:
            skip = start
            while skip > 0 and (got := proc.stdout.read(min(skip, 1 << 20))):
                skip -= len(got)
            left = length
            while left > 0 and (chunk := proc.stdout.read(min(left, 1 << 20))):
                if crash_after is not None:
                    self.wfile.write(chunk[:crash_after])
                    self.wfile.flush()
                    os._exit(137)
                self.wfile.write(chunk)
                left -= len(chunk)
            if left:
                self.close_connection = True
        finally:
            proc.stdout.close()
            proc.kill()
            proc.wait()

    # ------------------------------------------------------------------ writing a repo

    def _preupload(self, repo: Repo, args: list[str]) -> None:
        sha = repo.resolve(args[0])
        files = self.json_body(required=True).get("files")
        if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
            raise HubError(400, "preupload expects {'files': [{'path', 'sample', 'size'}, ...]}.")
        if len(files) > MAX_PATHS_PER_CALL:
            raise HubError(413, f"preupload takes at most {MAX_PATHS_PER_CALL} files per call (huggingface_hub sends "
                                "256); split the list into several calls.")
        paths = [validate_path(f.get("path")) for f in files]
        entries = repo.lookup(sha, paths)
        self.send_json({"files": [
            {"path": p, "uploadMode": "regular", "shouldIgnore": False,
             "oid": e.oid if e is not None and e.type == "file" else None}
            for p, e in zip(paths, entries)
        ], "commitOid": sha})

    def _commit(self, repo: Repo, args: list[str]) -> None:
        rev = args[0]
        if self.query.get("create_pr") not in (None, "", "0", "false", "False"):
            raise HubError(400, "Pull requests are not supported by this server; commit to a branch instead.")
        repo.branch_ref(rev)  # fail early on unknown revision or non-branch, before reading the body
        body = self.body_reader(self.server.max_commit_bytes)
        tmp = self.server.store.new_tmpdir()
        try:
            payload = read_commit_payload(body, tmp, on_header=lambda: maybe_crash("after-commit-header"))
            h = payload.header
            sha = repo.commit(rev, payload.ops, h["summary"], h.get("description") or "",
                              parent_commit=h.get("parentCommit"), user=self.ident.user, files=payload.files)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.send_json({"success": True, "commitOid": sha, "hookOutput": "",
                        "commitUrl": f"{self._repo_url(repo.repo_type, repo.repo_id)}/commit/{sha}"})

    def _branch_create(self, repo: Repo, args: list[str]) -> None:
        start = self.json_body().get("startingPoint") or DEFAULT_BRANCH
        if not isinstance(start, str):
            raise HubError(400, "startingPoint must be a revision string.")
        validate_ref_name(args[0], "branch")
        repo.create_branch(args[0], start, user=self.ident.user)
        self.send_json({})

    def _branch_delete(self, repo: Repo, args: list[str]) -> None:
        repo.delete_branch(args[0], user=self.ident.user)
        self.send_json({})

    def _tag_create(self, repo: Repo, args: list[str]) -> None:
        body = self.json_body(required=True)
        tag, message = body.get("tag"), body.get("message")
        if message is not None:
            validate_text(message, "tag message")
        repo.create_tag(tag, args[0], message, user=self.ident.user)
        self.send_json({})

    def _tag_delete(self, repo: Repo, args: list[str]) -> None:
        repo.delete_tag(args[0], user=self.ident.user)
        self.send_json({})


def _check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HubError:
        raise HubError(404, f"Repository not found: '{repo_id}' is not a valid repo id.", "RepoNotFound") from None


def _query_int(query: dict, key: str, default: int, lo: int, hi: int) -> int:
    raw = query.get(key)
    if raw is None or raw == "":
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 13) or not lo <= int(raw) <= hi:
        raise HubError(400, f"Invalid query parameter {key}={raw[:40]!r}: expected a whole number from {lo} to {hi}.")
    return int(raw)


def _yaml_errors(front_matter: str) -> list[dict]:
    """Problems of a card's YAML front matter, checked with bounded work: at most MAX_YAML_BYTES, parsed first as
    events only (MAX_YAML_EVENTS, MAX_YAML_DEPTH levels) and only then loaded. Whatever the loader raises on a bad
    value (a date like 2020-13-45, '!!int abc', an integer of 100,000 digits) is reported, never a 500."""
    try:
        import yaml  # optional: without PyYAML the front matter is not checked
    except ImportError:
        return []
    size = len(front_matter.encode("utf-8", "surrogatepass"))
    if size > MAX_YAML_BYTES:
        raise HubError(413, f"The YAML front matter is {size} bytes, over this server's limit of {MAX_YAML_BYTES} "
                            "bytes. Keep card metadata short (long text belongs in the card's body).")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        depth = events = 0
        for ev in yaml.parse(front_matter, Loader=loader):
            events += 1
            if isinstance(ev, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    return [{"message": f"YAML front matter is nested more than {MAX_YAML_DEPTH} levels deep."}]
            elif isinstance(ev, yaml.CollectionEndEvent):
                depth -= 1
            if events > MAX_YAML_EVENTS:
                return [{"message": f"YAML front matter has more than {MAX_YAML_EVENTS} values; keep card metadata "
                                    "short."}]
        meta = yaml.load(front_matter, Loader=loader)
    except yaml.YAMLError as ex:
        return [{"message": f"Invalid YAML front matter: {ex}"}]
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError, UnicodeError) as ex:
        # the loader's constructors raise these for values that do not convert (dates, ints, tagged scalars)
        return [{"message": f"Invalid YAML front matter: a value cannot be read ({type(ex).__name__}: {ex})."}]
    return [] if meta is None or isinstance(meta, dict) else [{"message": "YAML front matter must be a mapping."}]


def _parse_range(header: str, size: int):
    """'bytes=N-', 'bytes=N-M', 'bytes=-S' -> (start, end); None to ignore (multi-range, garbage)."""
    h = header.strip()
    if not h.startswith("bytes=") or "," in h:
        return None
    first, _, last = h[len("bytes="):].strip().partition("-")
    try:
        if first == "":
            n = int(last)
            if n <= 0 or not size:
                return "unsatisfiable"
            return max(0, size - n), size - 1
        start = int(first)
        end = int(last) if last else size - 1
    except ValueError:
        return None
    if start < 0 or start >= size or end < start:
        return "unsatisfiable"
    return start, min(end, size - 1)


# ----------------------------------------------------------------------------------------------------------------------
# running it
# ----------------------------------------------------------------------------------------------------------------------


def make_server(root, host: str = "127.0.0.1", port: int = 0, *, quiet: bool = False,
                max_commit_bytes: int = DEFAULT_MAX_COMMIT_BYTES, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                timeout: float = DEFAULT_TIMEOUT, public_url: str | None = None,
                stale_lock_seconds: float = DEFAULT_STALE_LOCK_SECONDS, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
                max_json_bytes: int = MAX_JSON_BODY) -> HubHTTPServer:
    """A bound (not yet serving) server; port 0 binds a free port, ``.url`` says which."""
    return HubHTTPServer((host, port), GitStore(root, stale_lock_seconds=stale_lock_seconds), quiet=quiet,
                         max_commit_bytes=max_commit_bytes, max_connections=max_connections, timeout=timeout,
                         public_url=public_url, header_timeout=header_timeout, max_json_bytes=max_json_bytes)


def provision(root, trusted_orgs=DEFAULT_TRUSTED_ORGS, write_orgs=None, user: str = "publisher") -> str:
    """As the server's owner: mark ``trusted_orgs`` trusted, give ``user`` the write role in ``write_orgs``
    (default: the trusted orgs) and return a fresh write token for it (replacing the previous one of serve_hub)."""
    for org in trusted_orgs:
        auth.set_trusted(root, org, True)
    for org in (trusted_orgs if write_orgs is None else write_orgs):
        auth.set_member(root, org, user, "write")
    return auth.create_token(root, user, name="serve_hub", role="write", replace=True)


class HubProcess:
    """A Hub server on a fixed root, in a subprocess (mode='subprocess') or a thread (mode='thread').

    The first start binds ``port`` (0: any free one) and learns the port from the server; restarts reuse it.
    ``server_args`` are extra ``serve`` options (e.g. ``["--timeout", "2"]``)."""

    def __init__(self, root, host: str = "127.0.0.1", port: int = 0, mode: str = "subprocess",
                 env: dict | None = None, log_path=None, server_args=(), token: str | None = None):
        if mode not in ("subprocess", "thread"):
            raise ValueError("mode must be 'subprocess' or 'thread'")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.host, self.port, self.mode, self.token = host, port, mode, token
        self.env = dict(env or {})
        self.server_args = [str(a) for a in server_args]
        self.log_path = Path(log_path) if log_path else self.root.parent / f"{self.root.name}.server.log"
        self._proc: subprocess.Popen | None = None
        self._server: HubHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def client_env(self) -> dict:
        """What a client process needs: HF_ENDPOINT, and HF_TOKEN when the server made one."""
        return {"HF_ENDPOINT": self.url, **({"HF_TOKEN": self.token} if self.token else {})}

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        if self.mode == "thread":
            return self._server is not None
        return self._proc is not None and self._proc.poll() is None

    def start(self, env: dict | None = None) -> "HubProcess":
        if env is not None:
            self.env = dict(env)
        if self.mode == "thread":
            if self.env.get(CRASH_ENV):
                raise ValueError(f"{CRASH_ENV} needs mode='subprocess'")
            self._server = make_server(self.root, self.host, self.port, quiet=True, **_thread_options(self.server_args))
            self.port = self._server.server_address[1]
            threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True).start()
            return self
        return self._start_subprocess()

    def _start_subprocess(self) -> "HubProcess":
        url_file = self.root.parent / f".{self.root.name}.{os.getpid()}.{id(self)}.url"
        url_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kerneltools", "serve", "--root", str(self.root), "--host", self.host,
               "--port", str(self.port), "--url-file", str(url_file), *self.server_args]
        env = dict(os.environ)
        pkg_parent = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop(CRASH_ENV, None)
        env.update(self.env)
        with open(self.log_path, "ab") as log:  # its own process group: stop() can end whatever it left behind
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                          process_group=0)
        deadline = time.monotonic() + 30
        while not url_file.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"The Hub server did not start on {self.host}:{self.port}. Its log "
                                   f"({self.log_path}):\n{tail}")
            time.sleep(0.02)
        self.port = int(url_file.read_text().rsplit(":", 1)[1])
        url_file.unlink(missing_ok=True)
        return self

    def stop(self) -> None:
        """Stop gracefully (SIGTERM; SIGKILL after 10 s), then end anything left in its process group."""
        if self.mode == "thread":
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None
            return
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc = None

    def kill(self) -> None:
        """Kill the server process alone, abruptly (SIGKILL), like a crash or the OOM killer."""
        if self.mode == "thread":
            return self.stop()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self, env: dict | None = None) -> "HubProcess":
        self.stop()
        return self.start(env)

    def wait_exit(self, timeout: float = 30) -> int | None:
        if self._proc is None:
            return None
        return self._proc.wait(timeout)


def _thread_options(server_args: list[str]) -> dict:
    ns = _serve_options(argparse.ArgumentParser()).parse_args(server_args)
    return dict(max_commit_bytes=ns.max_commit_bytes, max_connections=ns.max_connections, timeout=ns.timeout,
                stale_lock_seconds=ns.stale_lock_seconds, header_timeout=ns.header_timeout,
                max_json_bytes=ns.max_json_bytes)


@contextlib.contextmanager
def serve_hub(root, trusted_orgs=DEFAULT_TRUSTED_ORGS, *, write_orgs=None, reads: str | None = None,
              host: str = "127.0.0.1", port: int = 0, mode: str = "subprocess", env: dict | None = None,
              server_args=()):
    """Run a Hub server on 127.0.0.1 and a free port for the duration of a with-block, set up by its owner:
    ``trusted_orgs`` trusted, a user ``publisher`` with the write role in ``write_orgs`` (default: the trusted
    orgs), and its write token as ``hub.token`` (``hub.client_env`` = HF_ENDPOINT + HF_TOKEN). ``reads="token"``
    makes reads need a token.

    Yields a :class:`HubProcess` with ``.url``, ``.token``, ``.stop()``, ``.restart()`` (same root and port) and
    ``.kill()``."""
    token = provision(root, trusted_orgs, write_orgs)
    if reads is not None:
        auth.set_reads(root, reads)
    hub = HubProcess(root, host=host, port=port, mode=mode, env=env, server_args=server_args, token=token).start()
    try:
        yield hub
    finally:
        hub.stop()


# ----------------------------------------------------------------------------------------------------------------------
# CLI: python -m kerneltools serve
# ----------------------------------------------------------------------------------------------------------------------


def _serve_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--max-commit-bytes", type=int, default=DEFAULT_MAX_COMMIT_BYTES,
                   help="largest accepted commit request body (default 2 GiB); larger ones get 413")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help=f"open connections served at once (default {DEFAULT_MAX_CONNECTIONS}); more get 503 + "
                        "Retry-After")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds a connection may stay silent, idle or mid-request (default {DEFAULT_TIMEOUT:g}); "
                        "a stalled body gets 408")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT,
                   help="seconds a client has to send a request's line and headers once it has started, and "
                        f"then a JSON body (default {DEFAULT_HEADER_TIMEOUT:g}); a slower one gets 408 and is closed")
    p.add_argument("--max-json-bytes", type=int, default=MAX_JSON_BODY,
                   help=f"largest accepted JSON request body (default {MAX_JSON_BODY >> 20} MiB: create, preupload, "
                        "paths-info, branch, tag, validate-yaml); larger ones get 413")
    p.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE,
                   help="seconds that requests in progress get to finish after SIGTERM or Ctrl-C (default "
                        f"{DEFAULT_SHUTDOWN_GRACE:g}); idle connections are closed at once")
    p.add_argument("--stale-lock-seconds", type=float, default=DEFAULT_STALE_LOCK_SECONDS,
                   help="age after which a git ref lock that no server process holds is removed (default "
                        f"{DEFAULT_STALE_LOCK_SECONDS:g}; docs/hub-server.md)")
    return p


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run a Hub-compatible server on loopback (git-backed)",
        description="Serve a Hugging Face Hub-compatible API from git repositories under --root, for publishing and "
                    "loading kernels without huggingface.co. Point clients at it with HF_ENDPOINT=<printed URL> and "
                    "HF_TOKEN=<a token from `python -m kerneltools hub-auth --root DIR token USER`>.")
    p.add_argument("--root", required=True, type=Path, help="storage directory (created if missing)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port, printed)")
    p.add_argument("--public-url", help="base of the URLs the server returns (default http://HOST:PORT)")
    _serve_options(p)
    p.add_argument("--url-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="do not log requests")
    p.set_defaults(_main=main)


def main(args) -> int:
    try:
        server = make_server(args.root, args.host, args.port, quiet=args.quiet, max_commit_bytes=args.max_commit_bytes,
                             max_connections=args.max_connections, timeout=args.timeout, public_url=args.public_url,
                             stale_lock_seconds=args.stale_lock_seconds, header_timeout=args.header_timeout,
                             max_json_bytes=args.max_json_bytes)
        cfg = server.auth.current()
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}. Pick another --port "
              "(0 picks a free one).", file=sys.stderr)
        return 1
    except (RuntimeError, auth.AuthFileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    trusted = sorted(o for o in cfg["orgs"] if auth.is_trusted(cfg, o))
    print(server.url, flush=True)
    print(f"Hub server on {server.url} (storage: {server.store.root}; {len(cfg['tokens'])} token(s), reads: "
          f"{cfg['reads']}, trusted orgs: {', '.join(trusted) or 'none'}).\nUse it with: export HF_ENDPOINT="
          f"{server.url} HF_TOKEN=<token>; tokens and roles: python -m kerneltools hub-auth --root {args.root} ...\n"
          "Stop with Ctrl-C.", file=sys.stderr, flush=True)
    if args.url_file:  # for HubProcess: the address actually bound (port 0 -> the one the kernel picked)
        tmp = args.url_file.with_name(args.url_file.name + ".tmp")
        tmp.write_text("http://%s:%d" % server.server_address[:2])
        os.replace(tmp, args.url_file)

    def _term(*_):  # serve_forever returns within one poll interval; shutdown() must run in another thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    try:
        server.serve_forever()
    finally:
        server.server_close()  # no new connections
        # idle connections close now; requests in progress get --shutdown-grace seconds. A commit cut short after
        # that was never acknowledged and stored nothing (its ref moves in one update-ref, or not at all); every
        # acknowledged one is on disk already (core.fsync).
        left = server.drain(args.shutdown_grace)
        _report_usage(server, left)
    return 0


def _peak_rss_kib(fallback: int) -> int:
    """This process's own peak RSS (VmHWM). ru_maxrss is not: Linux carries into it, at exec, the RSS of the
    process that forked this one (a test runner's hundreds of MB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return fallback


def _report_usage(server: HubHTTPServer, busy_at_exit: int = 0) -> None:
    """Peak memory and connections, on stderr at shutdown (the load tests read them from the log)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"hub-usage: peak_rss_kib={_peak_rss_kib(me.ru_maxrss)} peak_child_rss_kib={kids.ru_maxrss} "
          f"peak_connections={server.peak_connections} refused_connections={server.refused_connections} "
          f"dropped_connections={server.dropped_connections} busy_at_exit={busy_at_exit}",
          file=sys.stderr, flush=True)
