"""Who may do what on the loopback Hub: tokens, users, org roles, trusted publishers; ``python -m kerneltools hub-auth``.

The model is huggingface.co's:

- A request is anonymous or carries ``Authorization: Bearer <token>`` (what huggingface_hub sends from
  ``HF_TOKEN``). A token belongs to a user and has a role, ``read`` or ``write``.
- Writes (create a repo; commit, preupload, branch and tag changes) need a ``write`` token whose user may write
  the repo's namespace: it is the user's own name, or an org where the user's role is ``write`` or ``admin``.
- Reads are anonymous, or (``reads = "token"``) need any valid token.
- An unknown or malformed token is a 401 (``Invalid credentials in Authorization header``, the Hub's text), a
  missing one where one is needed a 401 too, a token without the right role a 403.
- Trusted kernel publishers (``trustedKernelPublisher`` in the org overview, which kernels checks before loading)
  are set by the server's owner. No HTTP call changes any of this: the configuration is the file
  ``<root>/hub-auth.json`` (mode 0600), edited only through this module (the ``hub-auth`` CLI, or the functions
  below, which :func:`kerneltools.hub.serve_hub` uses for tests and the demo). The server rereads it when it
  changes, so edits apply without a restart. Tokens are stored as SHA-256 hashes; the plain token is printed once.

CLI::

    python -m kerneltools hub-auth --root DIR member ORG USER [--role read|write|admin|none]
    python -m kerneltools hub-auth --root DIR token USER [--name NAME] [--role read|write] [--replace]
    python -m kerneltools hub-auth --root DIR revoke NAME
    python -m kerneltools hub-auth --root DIR trust ORG [--off]
    python -m kerneltools hub-auth --root DIR reads anonymous|token
    python -m kerneltools hub-auth --root DIR show
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import secrets
import string
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import HubError, busy, forbidden, unauthorized
from .names import validate_namespace
from .storage import file_lock

AUTH_FILE = "hub-auth.json"
ORG_ROLES = ("read", "write", "admin")
TOKEN_ROLES = ("read", "write")
READ_MODES = ("anonymous", "token")
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"  # huggingface.co's text; the client knows it


class AuthFileError(ValueError):
    """hub-auth.json is unreadable or inconsistent; the message says where."""


@dataclass(frozen=True)
class Identity:
    user: str
    token_name: str
    token_role: str
    orgs: dict  # org -> role


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    alphabet = string.ascii_letters + string.digits
    return "hf_" + "".join(secrets.choice(alphabet) for _ in range(34))


# --------------------------------------------------------------------------------------------------------------------
# the configuration
# --------------------------------------------------------------------------------------------------------------------


def empty_config() -> dict:
    return {"format": 1, "reads": "anonymous", "users": {}, "orgs": {}, "tokens": {}}


def check_config(cfg: object, where: str) -> dict:
    """The parsed file, checked; AuthFileError naming the first problem."""
    def bad(msg):
        return AuthFileError(f"{where}: {msg}. Fix it with `python -m kerneltools hub-auth` (or restore a backup).")

    if not isinstance(cfg, dict) or cfg.get("format") != 1:
        raise bad("not a format-1 hub-auth file")
    if cfg.get("reads") not in READ_MODES:
        raise bad(f"'reads' must be one of {', '.join(READ_MODES)}")
    for key in ("users", "orgs", "tokens"):
        if not isinstance(cfg.get(key), dict):
            raise bad(f"'{key}' must be an object")
    for user, u in cfg["users"].items():
        if not isinstance(u, dict) or not isinstance(u.get("orgs"), dict) or \
                any(r not in ORG_ROLES for r in u["orgs"].values()):
            raise bad(f"user {user!r} must be {{'orgs': {{org: {'|'.join(ORG_ROLES)}}}}}")
    for org, o in cfg["orgs"].items():
        if not isinstance(o, dict) or not isinstance(o.get("trustedKernelPublisher"), bool):
            raise bad(f"org {org!r} must be {{'trustedKernelPublisher': true|false}}")
    for h, t in cfg["tokens"].items():
        if not isinstance(t, dict) or t.get("role") not in TOKEN_ROLES or t.get("user") not in cfg["users"]:
            raise bad(f"token {h[:8]}... must name a known user and a role ({', '.join(TOKEN_ROLES)})")
    return cfg


class AuthFile:
    """``<root>/hub-auth.json``: read (and reread when it changes) by the server, edited under a lock."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.path = self.root / AUTH_FILE
        self._stamp: tuple | None = None
        self._cfg: dict | None = None
        self._lock = threading.Lock()

    def current(self) -> dict:
        """The configuration in force (AuthFileError if the file is broken: the server then refuses to act)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if self._cfg is None or stamp != self._stamp:
                self._cfg = self._load() if stamp is not None else empty_config()
                self._stamp = stamp
            return self._cfg

    def _load(self) -> dict:
        try:
            return check_config(json.loads(self.path.read_text()), str(self.path))
        except (OSError, ValueError) as e:
            if isinstance(e, AuthFileError):
                raise
            raise AuthFileError(f"{self.path}: cannot be read as JSON ({e}).") from None

    @contextlib.contextmanager
    def edit(self):
        """Yield the configuration as a dict to change in place; written back atomically (and durably)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with file_lock(self.root / ".hub-auth.flock", 30, "The hub-auth file"):
            cfg = self._load() if self.path.exists() else empty_config()
            yield cfg
            check_config(cfg, "the edited configuration")
            tmp = self.path.with_name(f".{AUTH_FILE}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)


# --------------------------------------------------------------------------------------------------------------------
# the owner's operations (CLI and serve_hub)
# --------------------------------------------------------------------------------------------------------------------


def _org_names(cfg: dict) -> set[str]:
    return set(cfg["orgs"]) | {o for u in cfg["users"].values() for o in u["orgs"]}


def _ensure_user(cfg: dict, user: str) -> dict:
    validate_namespace(user, "user name")
    if user in _org_names(cfg):
        raise AuthFileError(f"{user!r} is an organization here; users and organizations share one namespace.")
    return cfg["users"].setdefault(user, {"orgs": {}})


def set_member(root, org: str, user: str, role: str) -> None:
    """Give ``user`` a role in ``org`` (``none`` removes it)."""
    if role not in ORG_ROLES + ("none",):
        raise AuthFileError(f"Unknown role {role!r}: expected one of {', '.join(ORG_ROLES)} or none.")
    validate_namespace(org, "organization")
    with AuthFile(root).edit() as cfg:
        if org in cfg["users"]:
            raise AuthFileError(f"{org!r} is a user here; users and organizations share one namespace.")
        orgs = _ensure_user(cfg, user)["orgs"]
        if role == "none":
            orgs.pop(org, None)
        else:
            orgs[org] = role


def set_trusted(root, org: str, trusted: bool = True) -> None:
    validate_namespace(org, "organization")
    with AuthFile(root).edit() as cfg:
        if org in cfg["users"]:
            raise AuthFileError(f"{org!r} is a user; only organizations can be trusted kernel publishers.")
        cfg["orgs"][org] = {"trustedKernelPublisher": bool(trusted)}


def set_reads(root, mode: str) -> None:
    if mode not in READ_MODES:
        raise AuthFileError(f"Unknown read mode {mode!r}: expected one of {', '.join(READ_MODES)}.")
    with AuthFile(root).edit() as cfg:
        cfg["reads"] = mode


def create_token(root, user: str, name: str | None = None, role: str = "write", replace: bool = False) -> str:
    """A new token for ``user`` (created if needed); returns the plain token, which is stored only hashed."""
    if role not in TOKEN_ROLES:
        raise AuthFileError(f"Unknown token role {role!r}: expected one of {', '.join(TOKEN_ROLES)}.")
    token = new_token()
    with AuthFile(root).edit() as cfg:
        _ensure_user(cfg, user)
        name = name or f"{user}-{len(cfg['tokens']) + 1}"
        same = [h for h, t in cfg["tokens"].items() if t["name"] == name]
        if same and not replace:
            raise AuthFileError(f"A token named {name!r} exists; pick another --name, or --replace it.")
        for h in same:
            del cfg["tokens"][h]
        created = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        cfg["tokens"][hash_token(token)] = {"name": name, "user": user, "role": role, "created": created}
    return token


def revoke_token(root, name: str) -> int:
    """Remove the tokens named ``name``; how many were removed."""
    with AuthFile(root).edit() as cfg:
        doomed = [h for h, t in cfg["tokens"].items() if t["name"] == name]
        for h in doomed:
            del cfg["tokens"][h]
    return len(doomed)


# --------------------------------------------------------------------------------------------------------------------
# what the server asks
# --------------------------------------------------------------------------------------------------------------------


def identify(cfg: dict, authorization: str | None) -> Identity | None:
    """The identity an Authorization header proves; None for none; 401 for anything this server does not know."""
    if authorization is None:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    t = cfg["tokens"].get(hash_token(token.strip())) if scheme.lower() == "bearer" and token.strip() else None
    if t is None:
        raise unauthorized(INVALID_CREDENTIALS)
    return Identity(t["user"], t["name"], t["role"], dict(cfg["users"][t["user"]]["orgs"]))


def require_read(cfg: dict, ident: Identity | None) -> None:
    if cfg["reads"] == "token" and ident is None:
        raise unauthorized("This Hub server only serves authenticated reads: send a token (set HF_TOKEN, or "
                           "`hf auth login`). Ask the server's owner for one (python -m kerneltools hub-auth token).")


def require_write(ident: Identity | None, namespace: str, what: str) -> None:
    if ident is None:
        raise unauthorized(f"You must be authenticated to {what}: send a write token (set HF_TOKEN, or "
                           "`hf auth login`). The server's owner creates them with "
                           "`python -m kerneltools hub-auth token USER --role write`.")
    if ident.token_role != "write":
        raise forbidden(f"The token '{ident.token_name}' of {ident.user} is read-only; {what} needs a write token.")
    role = ident.orgs.get(namespace)
    if namespace != ident.user and role not in ("write", "admin"):
        has = f"role '{role}'" if role else "no role"
        raise forbidden(f"{ident.user} may not {what}: they have {has} in '{namespace}' (write or admin is needed). "
                        f"The server's owner grants it with `python -m kerneltools hub-auth member {namespace} "
                        f"{ident.user} --role write`.")


def is_trusted(cfg: dict, org: str) -> bool:
    return bool(cfg["orgs"].get(org, {}).get("trustedKernelPublisher"))


def known_org(cfg: dict, org: str) -> bool:
    return org in _org_names(cfg)


def whoami(ident: Identity) -> dict:
    return {
        "type": "user", "id": ident.user, "name": ident.user, "fullname": ident.user, "email": None,
        "emailVerified": False, "isPro": False, "canPay": False, "avatarUrl": "",
        "orgs": [{"type": "org", "name": o, "fullname": o, "roleInOrg": r, "avatarUrl": "", "isEnterprise": False}
                 for o, r in sorted(ident.orgs.items())],
        "auth": {"type": "access_token", "accessToken": {"displayName": ident.token_name, "role": ident.token_role}},
    }


def config_or_503(auth: AuthFile) -> dict:
    try:
        return auth.current()
    except AuthFileError as e:
        raise busy(f"The server's access configuration is broken, so it refuses every request until its owner fixes "
                   f"it: {e}", retry_after=30) from None


# --------------------------------------------------------------------------------------------------------------------
# CLI: python -m kerneltools hub-auth
# --------------------------------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "hub-auth", help="manage the loopback Hub's tokens, org members, trusted publishers",
        description="Edit <root>/hub-auth.json of a loopback Hub (`python -m kerneltools serve --root DIR`); a running "
                    "server picks changes up at once. No HTTP call can do this.")
    p.add_argument("--root", required=True, type=Path, help="the server's storage directory")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    m = sub.add_parser("member", help="set USER's role in ORG")
    m.add_argument("org")
    m.add_argument("user")
    m.add_argument("--role", default="write", choices=ORG_ROLES + ("none",))
    t = sub.add_parser("token", help="create a token for USER and print it (once)")
    t.add_argument("user")
    t.add_argument("--name", help="label (default USER-N); shown by whoami and used by revoke")
    t.add_argument("--role", default="write", choices=TOKEN_ROLES)
    t.add_argument("--replace", action="store_true", help="replace a token of the same name")
    r = sub.add_parser("revoke", help="delete the token(s) named NAME")
    r.add_argument("name")
    tr = sub.add_parser("trust", help="mark ORG a trusted kernel publisher (--off: no longer)")
    tr.add_argument("org")
    tr.add_argument("--off", action="store_true")
    rd = sub.add_parser("reads", help="anonymous reads, or reads with any valid token only")
    rd.add_argument("mode", choices=READ_MODES)
    sub.add_parser("show", help="print users, roles, trusted orgs and token names (never tokens)")
    p.set_defaults(_main=main)


def main(args) -> int:
    try:
        if args.action == "member":
            set_member(args.root, args.org, args.user, args.role)
        elif args.action == "token":
            print(create_token(args.root, args.user, args.name, args.role, args.replace))
        elif args.action == "revoke":
            if not revoke_token(args.root, args.name):
                raise AuthFileError(f"No token named {args.name!r} (see `hub-auth --root {args.root} show`).")
        elif args.action == "trust":
            set_trusted(args.root, args.org, not args.off)
        elif args.action == "reads":
            set_reads(args.root, args.mode)
        else:
            cfg = AuthFile(args.root).current()
            shown = dict(cfg, tokens=sorted(({k: v for k, v in t.items()} for t in cfg["tokens"].values()),
                                            key=lambda t: t["name"]))
            print(json.dumps(shown, indent=2, sort_keys=True))
    except (AuthFileError, HubError) as e:
        print(f"error: {getattr(e, 'message', e)}", file=sys.stderr)
        return 1
    return 0
