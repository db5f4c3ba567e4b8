"""Helpers for tests/tools: a tiny synthetic kernel build, raw HTTP, repo state, and a runner for kernels code in a
subprocess (kernels and huggingface_hub read HF_ENDPOINT/KERNELS_CACHE at import). A unique module name, so that it
never clashes with another directory's conftest."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kerneltools.build.config import hub_repo_id  # noqa: E402

GEGLU_REPO = hub_repo_id()  # build.toml's [general.hub] repo-id: the real kernel's repository
TRUSTED_ORG = GEGLU_REPO.split("/", 1)[0]  # its organization, which the loopback Hub trusts
# the orgs the test hub's token (user "publisher") may write: the trusted one and two that kernels does not trust
WRITE_ORGS = (TRUSTED_ORG, "other-org", "someone-else")


def git(repo_dir: Path, *args: str, input: str | None = None) -> str:
    """Plain git on a bare repo of the store (as someone working on it by hand would)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_AUTHOR_NAME="outside", GIT_AUTHOR_EMAIL="outside@localhost", GIT_COMMITTER_NAME="outside",
               GIT_COMMITTER_EMAIL="outside@localhost")
    return subprocess.run(["git", f"--git-dir={repo_dir}", *args], capture_output=True, text=True, check=True,
                          env=env, input=input).stdout


def repo_dir(hub, repo_id: str, repo_type: str = "kernel") -> Path:
    ns, name = repo_id.split("/")
    return hub.root / f"{repo_type}s" / ns / f"{name}.git"


def make_variant(build_dir: Path, variant: str = "torch-cpu", *, name: str = "tiny", version: int = 1,
                 sha: str = "abc1234", backend: str = "cpu", dirty: bool = False, marker: str = "",
                 extra_files: dict[str, str] | None = None, archs: list[str] | None = None) -> str:
    """A minimal valid noarch variant for kernels 0.17.2; returns its id (unique per sha/backend)."""
    ops_id = f"_{name}_{backend}_{sha}" + ("_dirty" if dirty else "")
    d = build_dir / variant
    d.mkdir(parents=True, exist_ok=True)
    (d / "__init__.py").write_text(textwrap.dedent(f"""\
        from . import layers
        from ._ops import ops, add_op_namespace_prefix

        VERSION = {version}
        MARKER = {marker!r}


        def tiny_add(x, y):
            return x + y


        __all__ = ["layers", "tiny_add", "VERSION", "MARKER"]
        """))
    (d / "layers.py").write_text(textwrap.dedent("""\
        import torch


        class TinyDouble(torch.nn.Module):
            can_torch_compile = False
            has_backward = True

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x * 2
        """))
    (d / "_ops.py").write_text(textwrap.dedent(f"""\
        import torch
        ops = torch.ops.{ops_id}
        def add_op_namespace_prefix(n):
            return f"{ops_id}::{{n}}"
        """))
    backend_info = {"type": backend}
    if archs is not None:
        backend_info["archs"] = archs
    meta = {"name": name, "id": ops_id, "version": version, "license": "Apache-2.0", "python-depends": [],
            "backend": backend_info,
            "provenance": {"kernel-builder": {"version": "0.0.0-test", "commit": "0" * 40, "dirty": False},
                           "kernel": {"commit": (sha * 6)[:40], "dirty": dirty}}}
    (d / "metadata.json").write_text(json.dumps(meta, indent=2))
    for rel, text in (extra_files or {}).items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return ops_id


def make_project(root: Path, *, name: str = "tiny", version: int = 1, repo_id: str = f"{TRUSTED_ORG}/tiny") -> Path:
    """A kernel project dir with build.toml; returns its build/ path (empty)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "build.toml").write_text(textwrap.dedent(f"""\
        [general]
        name = "{name}"
        version = {version}
        license = "Apache-2.0"
        backends = ["cpu", "cuda"]

        [general.hub]
        repo-id = "{repo_id}"

        [kernel.{name}]
        backend = "cuda"
        cuda-capabilities = ["9.0", "8.0"]
        """))
    (root / "build").mkdir(exist_ok=True)
    return root / "build"


def kernels_env(hub_url: str, tmp: Path, token: str | None = None) -> dict:
    """The environment of a kernels/huggingface_hub subprocess using the Hub at hub_url; HF_TOKEN is `token`, else
    this process's HF_TOKEN (the hub fixture's), else none."""
    token = token or os.environ.get("HF_TOKEN")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "KERNELS_", "HUGGINGFACE_"))}
    # keep an inherited PYTHONPATH (packages installed with --target, as on the GPU machine), repo first
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(HF_ENDPOINT=hub_url, KERNELS_CACHE=str(tmp / "kcache"), HF_HOME=str(tmp / "hf_home"),
               PYTHONPATH=pythonpath, TQDM_DISABLE="1")
    if token:
        env["HF_TOKEN"] = token
    # never HF_HUB_DISABLE_TELEMETRY=1: it breaks kernels 0.17.2 (illegal User-Agent header)
    return env


def run_kernels(hub_url: str, tmp: Path, body: str, timeout: float = 120, extra_env: dict | None = None,
                prelude: str = "") -> dict:
    """Run python code with kernels against the server in a fresh process; the code fills `out` (a dict).
    extra_env is added to kernels_env (e.g. HF_HUB_OFFLINE=1); prelude (e.g. GEGLU_PROBE) runs before body."""
    script = ("import json, sys\nout = {}\n" + textwrap.dedent(prelude) + "\n" + textwrap.dedent(body)
              + "\nprint('@@OUT@@' + json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**kernels_env(hub_url, tmp), **(extra_env or {})}, timeout=timeout)
    marker = [l for l in r.stdout.splitlines() if l.startswith("@@OUT@@")]
    if r.returncode != 0 or not marker:
        raise AssertionError(f"kernels subprocess failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    out = json.loads(marker[-1][len("@@OUT@@"):])
    out["_stderr"] = r.stderr
    return out


KERNELS_CLI = shutil.which("kernels", path=str(Path(sys.executable).parent)) or "kernels"  # kernels' own CLI


def run_cli(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)


def bearer(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def raw_request(hub_url: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                token: str | None = None):
    """One HTTP request with exact control of path and body (and `Authorization: Bearer token` if given);
    returns (status, headers, body)."""
    import http.client
    from urllib.parse import urlsplit

    u = urlsplit(hub_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={**bearer(token), **(headers or {})})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def connect(hub, timeout: float = 10):
    """A raw TCP connection to the Hub server (for requests no HTTP client would send)."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(hub.url)
    return socket.create_connection((u.hostname, u.port), timeout=timeout)


def serve_hub_with_v1(root: Path, repo_id: str, server_args: list):
    """A loopback Hub (``serve_hub``) holding the kernel repo ``repo_id`` with a branch ``v1`` of one file."""
    from contextlib import contextmanager

    from huggingface_hub import CommitOperationAdd, HfApi

    from kerneltools.hub import serve_hub

    @contextmanager
    def served():
        with serve_hub(root, server_args=server_args) as h:
            api, k = HfApi(endpoint=h.url, token=h.token), dict(repo_type="kernel")
            api.create_repo(repo_id, **k)
            api.create_branch(repo_id, branch="v1", **k)
            api.create_commit(repo_id, operations=[CommitOperationAdd("a.py", b"A = 1\n")], commit_message="v1",
                              revision="v1", **k)
            yield h

    return served()


def repo_state(hub, repo_id: str, repo_type: str = "kernel") -> str:
    """Refs of the bare repo, after checking it is consistent (git fsck)."""
    d = repo_dir(hub, repo_id, repo_type)
    git(d, "fsck", "--no-dangling", "--no-progress")
    return git(d, "for-each-ref", "--format=%(refname) %(objectname)")


def commit_ndjson(header: dict, *items: dict) -> bytes:
    lines = [{"key": "header", "value": header}, *items]
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def file_item(path: str, data: bytes) -> dict:
    import base64

    return {"key": "file", "value": {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64"}}


# --- the real kernel -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GegluBuild:
    """Noarch variants of the real kernel built by kerneltools.build; ids are metadata.json's (module names)."""

    build_dir: Path
    build_toml: Path
    ids: dict  # variant -> metadata id
    dirty: bool

    def publish(self, hub, repo_id: str | None = None):
        from kerneltools.publish import publish

        # force_dirty only lets a developer run the tests on uncommitted changes of this checkout
        return publish(self.build_dir, repo_id=repo_id, endpoint=hub.url, build_toml=self.build_toml,
                       force_dirty=self.dirty, progress=False)


def build_geglu(src_root: Path, out: Path) -> GegluBuild:
    from kerneltools.build import build, source_id

    dirs = build(src_root, out, variants=["cpu", "cuda"], aot_capability="none", log=lambda *a: None)
    return GegluBuild(out, src_root / "build.toml",
                      {d.name: json.loads((d / "metadata.json").read_text())["id"] for d in dirs},
                      source_id(src_root).dirty)


def kernel_source_copy(dest: Path, *, version: int | None = None, note: str = "") -> Path:
    """A git repository with a copy of this checkout's kernel sources (build.toml, CARD.md, torch-ext/, geglu/,
    benchmarks/benchmark*.py), committed: the builder then gives it its own tree id, so its variants get ids (module
    names) of their own. `version` replaces build.toml's; `note` is appended as a comment to the package's
    __init__.py (a changed tree)."""
    dest.mkdir(parents=True)
    for f in ["build.toml", "CARD.md", *(p.relative_to(REPO_ROOT) for p in REPO_ROOT.glob("benchmarks/benchmark*.py"))]:
        if (REPO_ROOT / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / f, dest / f)
    generated = shutil.ignore_patterns("__pycache__", "*.pyc", "_ops.py", "registration.h", "*.so")
    for d in ("torch-ext", "geglu"):  # geglu/: the CUDA sources, where this checkout has them
        if (REPO_ROOT / d).is_dir():
            shutil.copytree(REPO_ROOT / d, dest / d, ignore=generated)
    if version is not None:
        toml = dest / "build.toml"
        text, n = re.subn(r"(?m)^version = \d+$", f"version = {version}", toml.read_text(), count=1)
        assert n == 1, "build.toml has no [general] version line"
        toml.write_text(text)
    if note:
        with open(dest / "torch-ext" / "geglu" / "__init__.py", "a") as f:
            f.write(f"# {note}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    ident = ["-c", "user.name=test", "-c", "user.email=test@localhost", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], [*ident, "commit", "-qm", "kernel sources"]):
        subprocess.run(["git", "-C", str(dest), *args], check=True, capture_output=True, env=env)
    return dest


# --- the kernels cache ($KERNELS_CACHE) --------------------------------------------------------------------------------


def cache_repo(cache: Path, repo_id: str) -> Path:
    return cache / f"kernels--{repo_id.replace('/', '--')}"


def cache_complete(cache: Path, repo_id: str, commit: str) -> bool:
    """What kernels asks offline: a complete snapshot of this commit (huggingface_hub checks it against the cached
    tree listing)."""
    from huggingface_hub import snapshot_download

    from kerneltools.lock import BYTECODE_IGNORE

    try:
        snapshot_download(repo_id, repo_type="kernel", revision=commit, cache_dir=cache, local_files_only=True,
                          ignore_patterns=BYTECODE_IGNORE)
    except FileNotFoundError:
        return False
    return True


def cache_ref(cache: Path, repo_id: str, ref: str) -> str | None:
    path = cache_repo(cache, repo_id) / "refs" / ref
    return path.read_text() if path.exists() else None


def cache_bad_blobs(cache: Path, repo_id: str) -> list[str]:
    """Blobs the cache treats as complete whose content is not what their name (the git blob id the server sent as
    ETag) says: a poisoned cache. Partial downloads (*.incomplete) are not treated as complete and are skipped."""
    import hashlib

    bad = []
    for blob in (cache_repo(cache, repo_id) / "blobs").iterdir():
        if not blob.name.endswith(".incomplete"):
            data = blob.read_bytes()
            if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != blob.name:
                bad.append(blob.name)
    return bad


# Prepended to run_kernels bodies that load the real kernel: what was loaded, and whether it computes exactly.
GEGLU_PROBE = """
from pathlib import Path

import torch
import torch.nn.functional as F


def exact(k):
    \"\"\"k.geglu(gate, up, approx) == F.gelu(gate, approximate=approx) * up bit for bit (CPU), both GELUs.\"\"\"
    g = torch.Generator().manual_seed(0)
    ok = []
    for dtype in (torch.float32, torch.bfloat16):
        gate = (torch.randn(4, 96, generator=g) * 3).to(dtype)
        up = torch.randn(4, 96, generator=g).to(dtype)
        for approx in ("tanh", "none"):
            ok.append(torch.equal(k.geglu(gate, up, approx), F.gelu(gate, approximate=approx) * up))
    return all(ok)


def describe(k):
    \"\"\"Module name (= metadata id), cache snapshot (= Hub commit) and variant it came from, and its numerics.\"\"\"
    init = Path(k.__file__)  # <cache>/kernels--org--name/snapshots/<commit>/build/<variant>/__init__.py
    return {"id": k.__name__, "commit": init.parents[2].name, "variant": init.parent.name, "exact": exact(k)}


def error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None
"""


def methods_of(node) -> dict:
    """The methods of a class's AST node, each as ``ast.dump`` (no field names): equal dumps, the same code."""
    import ast

    return {n.name: ast.dump(n, annotate_fields=False) for n in node.body if isinstance(n, ast.FunctionDef)}


def class_methods(cls) -> dict:
    """:func:`methods_of` the class ``cls`` as its module's source defines it (decorators do not hide it)."""
    import ast
    import inspect

    src = inspect.getsource(sys.modules[cls.__module__])
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    return methods_of(node)
