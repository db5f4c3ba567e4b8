"""What the loopback Hub accepts as a repo id, file path, branch, tag or revision.

Everything a client names is checked here before it reaches git or the file system, with the Hub's own rules where
they are known (huggingface_hub's ``validate_repo_id``: 1-96 characters of letters, digits, ``-``, ``_``, ``.``, no
``--`` or ``..``, not ending in ``.git``) and with limits that keep every accepted name usable by the clients (a
name that the server stores but ``snapshot_download`` cannot write is refused up front):

- path components of at most 255 bytes (the file-name limit of the client's cache), at most 64 components and
  1024 bytes in all (deeper paths made huggingface_hub recurse out of stack);
- no component that is empty, only dots (``.``, ``..``, ``...``), has leading or trailing white space, or is
  ``.git`` in any case or with trailing dots or spaces;
- git's ref-name rules for branches and tags (``git check-ref-format``), plus: not ``@``, not a 40-hex commit id,
  no leading ``-``, components of at most 200 bytes;
- namespaces that the Hub's URL scheme uses for routes (``api``, ``kernels``, ...) are reserved: a model repo
  ``api/x`` would have file URLs ``/api/x/resolve/...``, which are API routes.
"""

from __future__ import annotations

import re

from .errors import HubError, revision_not_found

REPO_TYPES = ("model", "dataset", "space", "kernel")
DEFAULT_BRANCH = "main"
RESERVED_NAMESPACES = frozenset({"api", "models", "datasets", "spaces", "kernels", "organizations"})

MAX_PATH_BYTES = 1024
MAX_PATH_DEPTH = 64
MAX_COMPONENT_BYTES = 255
MAX_REF_BYTES = 255
MAX_REF_COMPONENT_BYTES = 200

# every pattern here is applied with fullmatch: '$' would also match before a final newline ("x\n")
_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
HEX40_RE = re.compile(r"[0-9a-fA-F]{40}")  # a commit id, in either case: never a branch or tag name
_REF_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def validate_repo_type(repo_type: object) -> str:
    if repo_type not in REPO_TYPES:
        raise HubError(400, f"Unknown repo type {repo_type!r}: expected one of {', '.join(REPO_TYPES)}.")
    return repo_type


def validate_name_part(part: object, what: str) -> str:
    """A namespace or repo name: huggingface_hub's rules, ASCII only, starting and ending with a letter or digit."""
    if (not isinstance(part, str) or not _NAME_RE.fullmatch(part) or ".." in part or "--" in part
            or part.lower().endswith(".git")):
        raise HubError(400, f"Invalid {what} {part!r}: use 1-96 letters, digits, '-', '_' or '.', starting and ending "
                            "with a letter or digit, without '--' or '..' and not ending in '.git'.")
    return part


def validate_namespace(ns: object, what: str = "namespace") -> str:
    validate_name_part(ns, what)
    if ns.lower() in RESERVED_NAMESPACES:
        raise HubError(400, f"Invalid {what} {ns!r}: it is reserved (the Hub's URLs use "
                            f"{', '.join(sorted(RESERVED_NAMESPACES))} for routes). Pick another name.")
    return ns


def validate_repo_id(repo_id: object) -> str:
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise HubError(400, f"Invalid repo id {repo_id!r}: expected '<namespace>/<name>'.")
    ns, name = repo_id.split("/")
    validate_name_part(ns, "namespace")
    validate_name_part(name, "repo name")
    return repo_id


def utf8_ok(s: str) -> bool:
    """Whether s is valid Unicode text (no lone surrogates such as '\\ud800', which JSON can carry but UTF-8,
    git and file systems cannot)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path_problem(p: str) -> str | None:
    if not p:
        return "it is empty"
    if not utf8_ok(p):
        return "it is not valid Unicode (it has a lone surrogate)"
    if len(p.encode("utf-8")) > MAX_PATH_BYTES:
        return f"it is longer than {MAX_PATH_BYTES} bytes"
    if p.startswith("/"):
        return "it is absolute (starts with '/')"
    if "\\" in p:
        return "it contains a backslash"
    if any(ord(c) < 32 or ord(c) == 127 for c in p):
        return "it contains a control character"
    comps = p.split("/")
    if len(comps) > MAX_PATH_DEPTH:
        return f"it has more than {MAX_PATH_DEPTH} components"
    for comp in comps:
        if comp == "" or set(comp) == {"."}:
            return f"it has an empty or all-dots component ({comp!r})"
        if comp != comp.strip():
            return f"the component {comp!r} starts or ends with white space"
        if comp.rstrip(". ").lower() == ".git":
            return "it has a '.git' component"
        if len(comp.encode("utf-8")) > MAX_COMPONENT_BYTES:
            return f"a component is longer than {MAX_COMPONENT_BYTES} bytes"
    return None


def validate_path(path: object, *, folder: bool = False) -> str:
    """A file (or folder) path inside a repo: relative, '/'-separated, every component usable as a file name."""
    if not isinstance(path, str):
        raise HubError(400, f"Invalid path {path!r}: expected a string.")
    p = path[:-1] if folder and path.endswith("/") else path
    problem = _path_problem(p)
    if problem:
        shown = path if len(path) <= 200 else path[:200] + "..."
        raise HubError(400, f"Invalid path {shown!r}: {problem}. Paths are relative, '/'-separated, like "
                            "'build/x/a.py'.")
    return p


def ref_name_ok(name: str) -> bool:
    """git check-ref-format's rules for ``refs/heads/<name>``, and the limits above."""
    if not name or name == "@" or "@{" in name or ".." in name or _REF_FORBIDDEN.search(name) or not utf8_ok(name):
        return False
    if len(name.encode()) > MAX_REF_BYTES or name.endswith((".", "/")) or name.startswith("/"):
        return False
    for comp in name.split("/"):
        if (not comp or comp.startswith(".") or comp.endswith(".lock") or comp == "@"
                or len(comp.encode()) > MAX_REF_COMPONENT_BYTES):
            return False
    return True


def validate_ref_name(name: object, kind: str = "branch") -> str:
    """A branch or tag short name, as the Hub accepts it (``v1``, ``release/2``)."""
    if not isinstance(name, str) or not name:
        raise HubError(400, f"Invalid {kind} name {name!r}: expected a non-empty string.")
    bad = None
    if name.startswith("-"):
        bad = "it starts with '-'"
    elif name.startswith("refs/") or name == "HEAD":
        bad = "'refs/...' and 'HEAD' are reserved"
    elif HEX40_RE.fullmatch(name):
        bad = "it looks like a commit id (40 hex digits, in any case), so revisions could not tell them apart"
    elif not ref_name_ok(name):
        bad = ("git's ref-name rules reject it (no spaces, control characters, '..', '~', '^', ':', '?', '*', '[', "
               f"'\\\\', '@{{', '@' alone, components starting with '.' or ending in '.lock', at most "
               f"{MAX_REF_COMPONENT_BYTES} bytes per component)")
    if bad:
        raise HubError(400, f"Invalid {kind} name {name!r}: {bad}.")
    return name


_TEXT_FORBIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # C0 controls but tab, LF and CR; DEL


def validate_text(text: object, what: str) -> str:
    """Commit summaries and descriptions, tag messages: git stores them, and every later read (the commit listing,
    ``git log``) must be able to serve them, so they are valid Unicode without NUL or other control characters
    (tab, line feed and carriage return are fine)."""
    if not isinstance(text, str):
        raise HubError(400, f"Invalid {what}: expected a string.")
    bad = None
    if not utf8_ok(text):
        bad = "it is not valid Unicode (it has a lone surrogate such as '\\ud800')"
    elif m := _TEXT_FORBIDDEN.search(text):
        bad = f"it contains the control character {m.group()!r} at position {m.start()}"
    if bad:
        raise HubError(400, f"Invalid {what}: {bad}. Send plain UTF-8 text (tabs and line breaks are fine).")
    return text


def revision_candidates(repo_id: str, rev: object) -> list[str]:
    """The full refs (or the commit id) a client's revision may name, in the Hub's order: branch, then tag.

    Raises RevisionNotFound for anything that cannot name a revision at all (control characters, git revision
    syntax like ``v1^{tree}``, option-like names)."""
    if (not isinstance(rev, str) or not rev or any(ord(c) < 32 or ord(c) == 127 for c in rev)
            or not utf8_ok(rev)):
        raise revision_not_found(repo_id, str(rev))
    if HEX40_RE.fullmatch(rev):
        return [rev.lower()]
    for prefix in ("refs/heads/", "refs/tags/"):
        if rev.startswith(prefix):
            short = rev[len(prefix):]
            if ref_name_ok(short) and not short.startswith("-"):
                return [rev]
            raise revision_not_found(repo_id, rev)
    if rev.startswith("-") or not ref_name_ok(rev):
        raise revision_not_found(repo_id, rev)
    return [f"refs/heads/{rev}", f"refs/tags/{rev}"]
