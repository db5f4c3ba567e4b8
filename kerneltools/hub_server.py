"""A Hugging Face Hub-compatible HTTP server for loopback, backed by git (see docs/hub-server.md).

Serves the subset of the Hub API that huggingface_hub>=2.4 and kernels 0.17.2 use to publish and load kernels:
create repo, repo info, refs, tree, preupload (always "regular": no LFS/Xet), ndjson commit, branches, tags,
resolve (HEAD/GET with Range), org overview (trustedKernelPublisher), validate-yaml, whoami-v2.

    python -m kerneltools serve --root DIR [--host 127.0.0.1] [--port 0] [--trusted-org ORG ...]

or, from Python (tests, demo)::

    with serve_hub(tmp_path / "hub") as hub:
        os.environ["HF_ENDPOINT"] = hub.url
        ...
        hub.restart()   # same root, same port
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from .hub_store import (
    CRASH_ENV,
    DEFAULT_BRANCH,
    LOCAL_USER,
    REPO_TYPES,
    CommitOp,
    GitStore,
    HubError,
    Repo,
    entry_not_found,
    format_date,
    new_tmpdir,
    validate_name_part,
    validate_path,
    validate_ref_name,
    validate_repo_id,
    _maybe_crash,
)

DEFAULT_TRUSTED_ORGS = ("geglu-kernels",)
MAX_JSON_BODY = 16 * 1024 * 1024
DEFAULT_MAX_COMMIT_BYTES = 2 * 1024**3
_TYPE_BY_PLURAL = {f"{t}s": t for t in REPO_TYPES}
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/", "kernel": "kernels/"}


class IncompleteBody(Exception):
    """The client went away before sending the whole request body."""


class BodyReader:
    """Reads a request body framed by Content-Length or chunked transfer encoding, with a size limit."""

    def __init__(self, rfile, headers, limit: int):
        self.rfile = rfile
        self.limit = limit
        self.read_total = 0
        te = (headers.get("Transfer-Encoding") or "").lower()
        self.chunked = "chunked" in te
        self.chunk_left = 0
        self.done = False
        if self.chunked:
            self.remaining = None
        else:
            try:
                self.remaining = int(headers.get("Content-Length") or 0)
            except ValueError:
                raise HubError(400, "Invalid Content-Length header.")
            if self.remaining < 0:
                raise HubError(400, "Invalid Content-Length header.")
            if self.remaining > limit:
                raise HubError(413, f"Request body of {self.remaining} bytes is over this server's limit of {limit} "
                                    "bytes. Split the upload into several commits or raise --max-commit-bytes.")
            self.done = self.remaining == 0

    def _next_chunk(self) -> None:
        line = self.rfile.readline(1024)
        if not line.endswith(b"\n"):
            raise IncompleteBody()
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            raise HubError(400, "Malformed chunked request body.")
        if size == 0:
            while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                pass
            self.done = True
        self.chunk_left = size

    def readline(self) -> bytes:
        """One line (with its newline) or the last bytes; b'' at the end of the body."""
        if not self.chunked:
            if self.remaining <= 0:
                return b""
            line = self.rfile.readline(self.remaining)
            if not line:
                raise IncompleteBody()
            self.remaining -= len(line)
            self.read_total += len(line)
            return line
        parts = []
        while not self.done:
            if self.chunk_left == 0:
                self._next_chunk()
                if self.done:
                    break
            piece = self.rfile.readline(self.chunk_left)
            if not piece:
                raise IncompleteBody()
            self.chunk_left -= len(piece)
            self.read_total += len(piece)
            if self.read_total > self.limit:
                raise HubError(413, f"Request body is over this server's limit of {self.limit} bytes.")
            if self.chunk_left == 0:
                self.rfile.readline(4)  # CRLF after the chunk data
            parts.append(piece)
            if piece.endswith(b"\n"):
                break
        return b"".join(parts)

    def read_all(self) -> bytes:
        parts = []
        while True:
            line = self.readline()
            if not line:
                return b"".join(parts)
            parts.append(line)

    def drain(self) -> bool:
        """Discard the rest of the body so the client can read our answer; False if that is not possible."""
        try:
            while self.readline():
                pass
            return True
        except (IncompleteBody, HubError, OSError):
            return False


class HubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, store: GitStore, trusted_orgs=DEFAULT_TRUSTED_ORGS, quiet: bool = False,
                 max_commit_bytes: int = DEFAULT_MAX_COMMIT_BYTES):
        self.store = store
        self.trusted_orgs = set(trusted_orgs)
        self.quiet = quiet
        self.max_commit_bytes = max_commit_bytes
        super().__init__(addr, HubRequestHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class HubRequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kerneltools-hub/1"
    server: HubHTTPServer

    # ------------------------------------------------------------------ plumbing

    def log_message(self, fmt, *args):
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} - [{self.log_date_time_string()}] {fmt % args}\n")

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    def do_PUT(self):
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        self.body = None
        try:
            url = urlsplit(self.path)
            raw = [s for s in url.path.split("/")]
            if not raw or raw[0] != "":
                raise HubError(400, "Bad request path.")
            # split first, then decode each segment: revisions arrive as 'refs%2Fheads%2Fv1'
            try:
                segs = [unquote(s, errors="strict") for s in raw[1:]]
            except UnicodeDecodeError:
                raise HubError(400, "Request path is not valid UTF-8 after percent-decoding.")
            if segs and segs[-1] == "" and len(segs) > 1:
                segs = segs[:-1]
            self.query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            self._route(method, segs)
        except HubError as e:
            self._send_error(e)
        except IncompleteBody:
            self.close_connection = True  # the client is gone; nothing was stored
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug: answer 500 (never a half write: commits publish with one update-ref)
            self.log_error("internal error: %r", e)
            import traceback

            traceback.print_exc()
            self._send_error(HubError(500, f"Internal server error: {type(e).__name__}: {e}"))

    def _body(self, limit: int = MAX_JSON_BODY) -> BodyReader:
        if self.body is None:
            self.body = BodyReader(self.rfile, self.headers, limit)
        return self.body

    def _json_body(self, required: bool = False) -> dict:
        data = self._body().read_all()
        if not data.strip():
            if required:
                raise HubError(400, "Expected a JSON object in the request body.")
            return {}
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise HubError(400, f"Request body is not valid JSON: {e}.")
        if not isinstance(obj, dict):
            raise HubError(400, "Expected a JSON object in the request body.")
        return obj

    def _finish_body(self) -> None:
        """Before answering: consume what the client sent, or close the connection."""
        try:
            if self.body is None:
                if self.command in ("GET", "HEAD") and not self.headers.get("Content-Length") \
                        and not self.headers.get("Transfer-Encoding"):
                    return
                self.body = BodyReader(self.rfile, self.headers, self.server.max_commit_bytes)
            if not self.body.drain():
                self.close_connection = True
        except HubError:
            self.close_connection = True

    def _send(self, status: int, body: bytes, headers: dict | None = None, content_type="application/json") -> None:
        self._finish_body()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, obj, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def _send_error(self, e: HubError, headers: dict | None = None) -> None:
        h = dict(headers or {})
        h["X-Error-Message"] = e.message.encode("ascii", "backslashreplace").decode().replace("\n", " ")[:2000]
        if e.code:
            h["X-Error-Code"] = e.code
        h.update(getattr(e, "extra_headers", {}) or {})
        try:
            self._send_json({"error": e.message}, e.status, h)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _base_url(self) -> str:
        host = self.headers.get("Host") or "%s:%s" % self.server.server_address[:2]
        return f"http://{host}"

    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        return f"{self._base_url()}/{_URL_PREFIX[repo_type]}{repo_id}"

    # ------------------------------------------------------------------ routing

    def _route(self, method: str, s: list[str]) -> None:
        store = self.server.store
        if s[:1] == ["api"]:
            rest = s[1:]
            if rest == ["whoami-v2"] and method == "GET":
                return self._whoami()
            if rest == ["repos", "create"] and method == "POST":
                return self._create_repo()
            if rest == ["validate-yaml"] and method == "POST":
                return self._validate_yaml()
            if len(rest) == 3 and rest[0] == "organizations" and rest[2] == "overview" and method == "GET":
                return self._org_overview(rest[1])
            if len(rest) >= 3 and rest[0] in _TYPE_BY_PLURAL:
                repo_type, repo_id = _TYPE_BY_PLURAL[rest[0]], f"{rest[1]}/{rest[2]}"
                return self._repo_api(method, repo_type, repo_id, rest[3:])
            raise HubError(404, f"No such API endpoint on this server: {method} {urlsplit(self.path).path}")
        # file URLs: /{prefix}{ns}/{name}/resolve/{rev}/{path...}; models have no prefix
        if len(s) >= 5 and s[0] in ("kernels", "datasets", "spaces") and s[3] == "resolve":
            return self._resolve(method, _TYPE_BY_PLURAL[s[0]], f"{s[1]}/{s[2]}", s[4], s[5:])
        if len(s) >= 4 and s[2] == "resolve":
            return self._resolve(method, "model", f"{s[0]}/{s[1]}", s[3], s[4:])
        raise HubError(404, f"Not found: {urlsplit(self.path).path}")

    def _open(self, repo_type: str, repo_id: str) -> Repo:
        try:
            validate_repo_id(repo_id)
        except HubError:
            raise HubError(404, f"Repository not found: '{repo_id}' is not a valid repo id.", "RepoNotFound")
        return self.server.store.open(repo_type, repo_id)

    def _repo_api(self, method: str, repo_type: str, repo_id: str, rest: list[str]) -> None:
        repo = self._open(repo_type, repo_id)
        op = rest[0] if rest else None
        if op is None and method == "GET":
            return self._info(repo, DEFAULT_BRANCH)
        if op == "revision" and len(rest) == 2 and method == "GET":
            return self._info(repo, rest[1])
        if op == "refs" and len(rest) == 1 and method == "GET":
            return self._refs(repo)
        if op == "tree" and len(rest) >= 2 and method == "GET":
            return self._tree(repo, rest[1], "/".join(rest[2:]))
        if op == "paths-info" and len(rest) == 2 and method == "POST":
            return self._paths_info(repo, rest[1])
        if op == "commits" and len(rest) == 2 and method == "GET":
            return self._send_json(repo.log(repo.resolve(rest[1])))
        if op == "preupload" and len(rest) == 2 and method == "POST":
            return self._preupload(repo, rest[1])
        if op == "commit" and len(rest) == 2 and method == "POST":
            return self._commit(repo, rest[1])
        if op == "branch" and len(rest) == 2 and method in ("POST", "DELETE"):
            return self._branch(repo, method, rest[1])
        if op == "tag" and len(rest) == 2 and method in ("POST", "DELETE"):
            return self._tag(repo, method, rest[1])
        raise HubError(404, f"No such API endpoint on this server: {method} {urlsplit(self.path).path}")

    # ------------------------------------------------------------------ endpoints

    def _whoami(self) -> None:
        orgs = sorted(self.server.store.namespaces() | self.server.trusted_orgs)
        self._send_json({
            "type": "user", "id": LOCAL_USER, "name": LOCAL_USER, "fullname": "Local user", "email": None,
            "emailVerified": False, "isPro": False, "canPay": False, "avatarUrl": "",
            "orgs": [{"type": "org", "name": o, "fullname": o, "roleInOrg": "admin", "avatarUrl": ""} for o in orgs],
            "auth": {"type": "access_token", "accessToken": {"displayName": "local", "role": "write"}},
        })

    def _create_repo(self) -> None:
        body = self._json_body(required=True)
        name, org = body.get("name"), body.get("organization") or LOCAL_USER
        repo_type = body.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Unknown repo type {repo_type!r}: expected one of {', '.join(REPO_TYPES)}.")
        validate_name_part(org, "namespace")
        validate_name_part(name, "repo name")
        repo_id = f"{org}/{name}"
        url = self._repo_url(repo_type, repo_id)
        if not self.server.store.create(repo_type, repo_id):
            e = HubError(409, f"You already created this {repo_type} repo: '{repo_id}'.")
            return self._send_error_with_body(e, {"error": e.message, "url": url})
        self._send_json({"url": url, "name": repo_id, "id": repo_id})

    def _send_error_with_body(self, e: HubError, body: dict) -> None:
        self._send_json(body, e.status, {"X-Error-Message": e.message})

    def _validate_yaml(self) -> None:
        body = self._json_body(required=True)
        content = body.get("content")
        if not isinstance(content, str):
            raise HubError(400, "validate-yaml expects {'content': str, 'repoType': str}.")
        errors = []
        lines = content.splitlines()
        if lines and lines[0].strip() == "---":
            try:
                end = next(i for i, l in enumerate(lines[1:], 1) if l.strip() == "---")
            except StopIteration:
                errors.append({"message": "YAML front matter starts with '---' but is never closed by '---'."})
            else:
                try:
                    import yaml  # optional: without PyYAML the front matter is not checked
                except ImportError:
                    yaml = None
                if yaml is not None:
                    try:
                        meta = yaml.safe_load("\n".join(lines[1:end]))
                        if meta is not None and not isinstance(meta, dict):
                            errors.append({"message": "YAML front matter must be a mapping."})
                    except yaml.YAMLError as ex:
                        errors.append({"message": f"Invalid YAML front matter: {ex}"})
        status = 400 if errors else 200
        self._send_json({"errors": errors, "warnings": []}, status)

    def _org_overview(self, org: str) -> None:
        try:
            validate_name_part(org, "organization")
        except HubError:
            raise HubError(404, f"Organization '{org}' not found.")
        trusted = org in self.server.trusted_orgs
        if not trusted and org not in self.server.store.namespaces():
            raise HubError(404, f"Organization '{org}' not found on this server.")
        self._send_json({"name": org, "fullname": org, "avatarUrl": "", "type": "org", "isVerified": trusted,
                         "trustedKernelPublisher": trusted})

    def _info(self, repo: Repo, rev: str) -> None:
        sha = repo.resolve(rev)
        info = {
            "id": repo.repo_id, "_id": repo.repo_id, "author": repo.repo_id.split("/")[0], "sha": sha,
            "lastModified": format_date(repo.commit_time(sha)), "private": False, "disabled": False,
            "gated": False, "downloads": 0, "likes": 0, "tags": [],
        }
        if repo.repo_type != "kernel":  # the Hub sends no siblings for kernels; hf_hub 1.x crashes on them
            info["siblings"] = [{"rfilename": p} for p in repo.all_files(sha)]
        self._send_json(info)

    def _refs(self, repo: Repo) -> None:
        branches, tags = repo.refs()
        out = {
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": c} for n, c in branches],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": c} for n, c in tags],
            "converts": [],
        }
        if self.query.get("include_prs") not in (None, "", "0", "false", "False"):
            out["pullRequests"] = []
        self._send_json(out)

    def _tree(self, repo: Repo, rev: str, path: str) -> None:
        sha = repo.resolve(rev)
        if path:
            path = validate_path(path, folder=True)
        recursive = self.query.get("recursive", "").lower() in ("1", "true", "yes")
        entries = repo.list_tree(sha, path, recursive)
        self._send_json([e.to_json() for e in entries])

    def _paths_info(self, repo: Repo, rev: str) -> None:
        sha = repo.resolve(rev)
        data = self._body().read_all()
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            try:
                paths = json.loads(data).get("paths", [])
            except (ValueError, AttributeError):
                raise HubError(400, "paths-info expects {'paths': [...]}.")
        else:
            paths = parse_qs(data.decode(errors="replace")).get("paths", [])
        if isinstance(paths, str):
            paths = [paths]
        paths = [validate_path(p, folder=True) for p in paths]
        self._send_json([e.to_json() for e in repo.lookup(sha, paths) if e is not None])

    def _preupload(self, repo: Repo, rev: str) -> None:
        sha = repo.resolve(rev)
        body = self._json_body(required=True)
        files = body.get("files")
        if not isinstance(files, list):
            raise HubError(400, "preupload expects {'files': [{'path', 'sample', 'size'}, ...]}.")
        paths = []
        for f in files:
            if not isinstance(f, dict):
                raise HubError(400, "preupload expects {'files': [{'path', 'sample', 'size'}, ...]}.")
            paths.append(validate_path(f.get("path")))
        entries = repo.lookup(sha, paths)
        self._send_json({"files": [
            {"path": p, "uploadMode": "regular", "shouldIgnore": False,
             "oid": e.oid if e is not None and e.type == "file" else None}
            for p, e in zip(paths, entries)
        ], "commitOid": sha})

    def _commit(self, repo: Repo, rev: str) -> None:
        if self.query.get("create_pr") not in (None, "", "0", "false", "False"):
            raise HubError(400, "Pull requests are not supported by this server; commit to a branch instead.")
        repo.branch_ref(rev)  # fail early on unknown revision or non-branch, before reading the body
        body = self._body(self.server.max_commit_bytes)
        tmp = new_tmpdir(self.server.store)
        try:
            header, ops, blob_files = None, [], []
            lineno = 0
            while True:
                line = body.readline()
                if not line:
                    break
                lineno += 1
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except (ValueError, UnicodeDecodeError):
                    raise HubError(400, f"Malformed commit payload: line {lineno} is not valid JSON "
                                        "(expected application/x-ndjson, one JSON object per line).")
                if not isinstance(item, dict) or not isinstance(item.get("value"), dict):
                    raise HubError(400, f"Malformed commit payload: line {lineno} must be "
                                        "{'key': ..., 'value': {...}}.")
                key, value = item.get("key"), item["value"]
                if header is None:
                    if key != "header":
                        raise HubError(400, "Malformed commit payload: the first line must be the 'header' item.")
                    summary = value.get("summary")
                    if not isinstance(summary, str) or not summary.strip():
                        raise HubError(400, "Malformed commit payload: header.summary (the commit title) is required.")
                    desc = value.get("description") or ""
                    if not isinstance(desc, str):
                        raise HubError(400, "Malformed commit payload: header.description must be a string.")
                    header = value
                    _maybe_crash("after-commit-header")
                    continue
                if key == "file":
                    path = validate_path(value.get("path"))
                    if value.get("encoding", "base64") != "base64" or not isinstance(value.get("content"), str):
                        raise HubError(400, f"Malformed commit payload: file '{path}' must have a base64 'content' "
                                            "and 'encoding': 'base64'.")
                    try:
                        data = base64.b64decode(value["content"], validate=True)
                    except (binascii.Error, ValueError):
                        raise HubError(400, f"Malformed commit payload: the content of '{path}' (line {lineno}) is not "
                                            "valid base64.")
                    f = tmp / f"{len(blob_files)}"
                    f.write_bytes(data)
                    blob_files.append(f)
                    ops.append(CommitOp("add", path))
                elif key == "deletedFile":
                    ops.append(CommitOp("delete_file", validate_path(value.get("path"))))
                elif key == "deletedFolder":
                    ops.append(CommitOp("delete_folder", validate_path(value.get("path"), folder=True)))
                elif key == "lfsFile":
                    raise HubError(400, "This server stores every file as a regular git blob and does not accept LFS "
                                        "files (its preupload always answers uploadMode 'regular'). Unset "
                                        "HF_HUB_DISABLE_XET tricks and upload with huggingface_hub>=2.4.")
                else:
                    raise HubError(400, f"Malformed commit payload: unknown key {key!r} on line {lineno} (expected "
                                        "'file', 'deletedFile' or 'deletedFolder').")
            if header is None:
                raise HubError(400, "Malformed commit payload: it is empty (no 'header' line).")
            oids = iter(repo.write_blobs(blob_files))
            for op in ops:
                if op.kind == "add":
                    op.blob = next(oids)
            sha = repo.commit(rev, ops, header["summary"], header.get("description") or "",
                              parent_commit=header.get("parentCommit"))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self._send_json({"success": True, "commitOid": sha, "hookOutput": "",
                         "commitUrl": f"{self._repo_url(repo.repo_type, repo.repo_id)}/commit/{sha}"})

    def _branch(self, repo: Repo, method: str, name: str) -> None:
        if method == "DELETE":
            repo.delete_branch(name)
            return self._send_json({})
        body = self._json_body()
        start = body.get("startingPoint") or DEFAULT_BRANCH
        if not isinstance(start, str):
            raise HubError(400, "startingPoint must be a revision string.")
        validate_ref_name(name, "branch")
        repo.create_branch(name, start)
        self._send_json({})

    def _tag(self, repo: Repo, method: str, rev_or_tag: str) -> None:
        if method == "DELETE":
            repo.delete_tag(rev_or_tag)
            return self._send_json({})
        body = self._json_body(required=True)
        tag, message = body.get("tag"), body.get("message")
        if message is not None and not isinstance(message, str):
            raise HubError(400, "Tag message must be a string.")
        repo.create_tag(tag, rev_or_tag, message)
        self._send_json({})

    def _resolve(self, method: str, repo_type: str, repo_id: str, rev: str, path_segs: list[str]) -> None:
        if method not in ("GET", "HEAD"):
            raise HubError(405, "Only GET and HEAD are allowed on file URLs.")
        repo = self._open(repo_type, repo_id)
        sha = repo.resolve(rev)
        path = validate_path("/".join(path_segs))
        entry = repo.lookup(sha, [path])[0]
        if entry is None or entry.type != "file":
            e = entry_not_found(repo_id, rev, path)
            return self._send_error(e, {"X-Repo-Commit": sha})
        size = entry.size
        headers = {"ETag": f'"{entry.oid}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng and method == "GET":
            parsed = _parse_range(rng, size)
            if parsed == "unsatisfiable":
                headers["Content-Range"] = f"bytes */{size}"
                e = HubError(416, f"Requested range {rng!r} is not satisfiable for a file of {size} bytes.")
                return self._send_error(e, headers)
            if parsed is not None:
                start, end = parsed
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(0, end - start + 1)
        self._finish_body()
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if method == "HEAD" or length == 0:
            return
        proc = repo.open_blob(entry.oid)
        # test-only (docs/hub-server.md): die after sending the first half of this file's body
        crash_after = length // 2 if os.environ.get(CRASH_ENV) == f"mid-download:{path}" else None
        try:
            skip = start
            while skip > 0:
                got = proc.stdout.read(min(skip, 1 << 20))
                if not got:
                    break
                skip -= len(got)
            left = length
            while left > 0:
                chunk = proc.stdout.read(min(left, 1 << 20))
                if not chunk:
                    break
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


def _parse_range(header: str, size: int):
    """'bytes=N-', 'bytes=N-M', 'bytes=-S' -> (start, end); None to ignore (multi-range, garbage)."""
    h = header.strip()
    if not h.startswith("bytes=") or "," in h:
        return None
    spec = h[len("bytes="):].strip()
    first, _, last = spec.partition("-")
    try:
        if first == "":
            n = int(last)
            if n <= 0:
                return "unsatisfiable"
            return (max(0, size - n), size - 1) if size else "unsatisfiable"
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


def make_server(root, host: str = "127.0.0.1", port: int = 0, trusted_orgs=DEFAULT_TRUSTED_ORGS,
                quiet: bool = False, max_commit_bytes: int = DEFAULT_MAX_COMMIT_BYTES) -> HubHTTPServer:
    return HubHTTPServer((host, port), GitStore(root), trusted_orgs, quiet, max_commit_bytes)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HubProcess:
    """A Hub server on a fixed root and port, in a subprocess (mode='subprocess') or a thread (mode='thread')."""

    def __init__(self, root, trusted_orgs=DEFAULT_TRUSTED_ORGS, host: str = "127.0.0.1", port: int = 0,
                 mode: str = "subprocess", env: dict | None = None, log_path=None):
        if mode not in ("subprocess", "thread"):
            raise ValueError("mode must be 'subprocess' or 'thread'")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.trusted_orgs = tuple(trusted_orgs)
        self.host, self.port, self.mode = host, port or _free_port(host), mode
        self.env = dict(env or {})
        self.log_path = Path(log_path) if log_path else self.root.parent / f"{self.root.name}.server.log"
        self._proc: subprocess.Popen | None = None
        self._server: HubHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

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
            self._server = make_server(self.root, self.host, self.port, self.trusted_orgs, quiet=True)
            self._thread = threading.Thread(target=self._server.serve_forever, name="hub-server", daemon=True)
            self._thread.start()
            return self
        url_file = self.root.parent / f".{self.root.name}.{os.getpid()}.{self.port}.url"
        url_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "kerneltools", "serve", "--root", str(self.root), "--host", self.host,
               "--port", str(self.port), "--url-file", str(url_file)]
        cmd += [a for o in self.trusted_orgs for a in ("--trusted-org", o)] or ["--no-trusted-orgs"]
        env = dict(os.environ)
        pkg_parent = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop(CRASH_ENV, None)
        env.update(self.env)
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)
        finally:
            log.close()
        deadline = time.monotonic() + 30
        while not url_file.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"The Hub server did not start on {self.url}. Its log ({self.log_path}):\n{tail}")
            time.sleep(0.02)
        url_file.unlink(missing_ok=True)
        return self

    def stop(self) -> None:
        """Stop gracefully (SIGTERM; SIGKILL after 10 s)."""
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
            self._proc = None

    def kill(self) -> None:
        """Kill abruptly (SIGKILL), like a crash or a power cut."""
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


@contextlib.contextmanager
def serve_hub(root, trusted_orgs=DEFAULT_TRUSTED_ORGS, *, host: str = "127.0.0.1", port: int = 0,
              mode: str = "subprocess", env: dict | None = None):
    """Run a Hub server on 127.0.0.1 and a free port for the duration of a with-block.

    Yields a :class:`HubProcess` with ``.url``, ``.stop()``, ``.restart()`` (same root and port) and ``.kill()``.
    """
    hub = HubProcess(root, trusted_orgs, host=host, port=port, mode=mode, env=env).start()
    try:
        yield hub
    finally:
        hub.stop()


# ----------------------------------------------------------------------------------------------------------------------
# CLI: python -m kerneltools serve
# ----------------------------------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run a Hub-compatible server on loopback (git-backed)",
        description="Serve a Hugging Face Hub-compatible API from git repositories under --root, for publishing and "
                    "loading kernels without huggingface.co. Point clients at it with HF_ENDPOINT=<printed URL>.")
    p.add_argument("--root", required=True, type=Path, help="storage directory (created if missing)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    p.add_argument("--trusted-org", action="append", dest="trusted_orgs", metavar="ORG",
                   help="organization reported as trustedKernelPublisher (repeatable; default: "
                        + ", ".join(DEFAULT_TRUSTED_ORGS) + ")")
    p.add_argument("--no-trusted-orgs", action="store_true", help="trust no organization at all")
    p.add_argument("--max-commit-bytes", type=int, default=DEFAULT_MAX_COMMIT_BYTES,
                   help="largest accepted commit request body (default 2 GiB)")
    p.add_argument("--url-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="do not log requests")
    p.set_defaults(_main=main)


def main(args) -> int:
    trusted = [] if args.no_trusted_orgs else (args.trusted_orgs or list(DEFAULT_TRUSTED_ORGS))
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: binding to {args.host}: this server has no authentication; anyone who can reach it can "
              "write to it.", file=sys.stderr)
    try:
        server = make_server(args.root, args.host, args.port, trusted, args.quiet, args.max_commit_bytes)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}. Pick another --port "
              "(0 picks a free one).", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(server.url, flush=True)
    print(f"Hub server on {server.url} (storage: {server.store.root}; trusted orgs: "
          f"{', '.join(sorted(trusted)) or 'none'}).\nUse it with: export HF_ENDPOINT={server.url}\n"
          "Stop with Ctrl-C.", file=sys.stderr, flush=True)
    if args.url_file:
        tmp = args.url_file.with_name(args.url_file.name + ".tmp")
        tmp.write_text(server.url)
        os.replace(tmp, args.url_file)

    def _term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
