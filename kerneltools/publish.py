"""Publish the builder's ``build/`` tree to a kernel repo on the Hub (or the loopback Hub server).

    python -m kerneltools publish [--build-dir build] [--repo-id ORG/NAME] [--endpoint URL] [--force-dirty]

Layout, as kernel-builder's upload makes it:

- ``build/<variant>/**`` goes to branch ``v<version>`` (``version`` from the variants' ``metadata.json``), which is
  what ``kernels.get_kernel(repo, version=N)`` resolves.
  - New branch: it is created from ``main`` and starts with no ``build/`` files other than the uploaded ones. The
    commit is made on a temporary branch first and ``v<N>`` is created pointing at it, so ``v<N>`` never exists
    half-filled (an interrupted publish leaves at most a ``tmp-publish-*`` branch, which kernels ignores).
  - Existing branch: only the uploaded variants are replaced (their stale files deleted); other variants stay.
- ``benchmarks/benchmark*.py`` of the kernel repository (the folder of ``build.toml``) go to the same branch, beside
  ``build/``, for ``kernels benchmark ORG/NAME@v<version>``; benchmark scripts the checkout no longer has are
  removed from the branch.
- ``README.md`` on ``main``: the repository's ``CARD.md`` rendered with the version and variant tables
  (:mod:`kerneltools.card`).

Files whose content the branch already holds are left out of the commit; when nothing changed, no commit is made
(and the result says so).

Every change is one ``create_commit`` with ``parent_commit`` set: the Hub applies it entirely or not at all, and if
the branch moved meanwhile (another publish), it is refused with 412 and this tool **retries on the new head**
(recomputing which files to delete), so two concurrent publishes both land, in order, and neither is lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .build.config import toml_repo_id, validate_repo_id
from .card import CardError, CardVariant, card_context, render_card

REQUIRED_METADATA = ("name", "id", "version", "license", "python-depends", "backend")
MAX_ATTEMPTS = 8
TMP_BRANCH_PREFIX = "tmp-publish-"
BENCHMARK_GLOB = "benchmark*.py"  # benchmarks/<these> go to branch v<N>, as kernel-builder's upload does


class PublishError(Exception):
    """A problem the user can fix; the message says what was wrong, what was expected and what to do."""


@dataclass
class Variant:
    name: str
    path: Path
    metadata: dict
    files: dict[str, Path] = field(default_factory=dict)  # path in repo -> local file

    @property
    def dirty(self) -> bool:
        prov = self.metadata.get("provenance") or {}
        kernel = prov.get("kernel") if isinstance(prov, dict) else None
        return bool(isinstance(kernel, dict) and kernel.get("dirty")) or str(self.metadata.get("id", "")).endswith(
            "_dirty")

    @property
    def backend(self) -> str:
        return str((self.metadata.get("backend") or {}).get("type", "?"))

    @property
    def archs(self) -> list[str]:
        return [str(a) for a in ((self.metadata.get("backend") or {}).get("archs") or [])]


@dataclass
class PublishResult:
    repo_id: str
    version: int
    branch: str
    commit: str
    variants: list[str]
    card_commit: str | None
    endpoint: str
    notes: list[str] = field(default_factory=list)
    benchmarks: list[str] = field(default_factory=list)  # paths in the repo, e.g. benchmarks/benchmark.py
    build_changed: bool = True  # False: branch v<N> already held exactly these files (no new commit)
    card_changed: bool = True  # False: main's README.md was already this card


# ----------------------------------------------------------------------------------------------------------------------
# reading the local build
# ----------------------------------------------------------------------------------------------------------------------


def load_build_toml(path: Path) -> dict:
    import tomllib

    if not path.is_file():
        raise PublishError(f"build.toml not found at {path}. Run from the kernel repo root, or pass --build-toml PATH.")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PublishError(f"{path} is not valid TOML: {e}. Fix the file and retry.")


def scan_build(build_dir: Path) -> list[Variant]:
    if not build_dir.is_dir():
        raise PublishError(f"Build directory {build_dir} does not exist. Build the kernel first "
                           "(python -m kerneltools build), or pass --build-dir to where the variants are.")
    variants = []
    for d in sorted(p for p in build_dir.iterdir() if p.is_dir() and p.name != "__pycache__"):
        meta_path = d / "metadata.json"
        if not meta_path.is_file():
            raise PublishError(f"{d} has no metadata.json, so it is not a build variant the kernels loader can use. "
                               "Rebuild, or remove that folder from the build directory.")
        try:
            meta = json.loads(meta_path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise PublishError(f"{meta_path} is not valid JSON ({e}). Rebuild the variant.")
        if not isinstance(meta, dict):
            raise PublishError(f"{meta_path} must hold a JSON object. Rebuild the variant.")
        missing = [k for k in REQUIRED_METADATA if k not in meta]
        if missing:
            raise PublishError(f"{meta_path} lacks required field(s) {', '.join(missing)}; kernels refuses to "
                               f"load a variant without them (it needs {', '.join(REQUIRED_METADATA)}). Rebuild with "
                               "the current builder.")
        if not isinstance(meta["version"], int) or isinstance(meta["version"], bool) or meta["version"] < 0:
            raise PublishError(f"{meta_path}: 'version' must be the integer major version (e.g. 1), got "
                               f"{meta['version']!r}.")
        if not isinstance(meta["id"], str) or not meta["id"].isidentifier():
            raise PublishError(f"{meta_path}: 'id' must be a Python identifier (it becomes the module name and the "
                               f"torch ops namespace), got {meta['id']!r}.")
        if not isinstance(meta["backend"], dict) or "type" not in meta["backend"]:
            raise PublishError(f"{meta_path}: 'backend' must be an object like {{\"type\": \"cuda\", \"archs\": [...]}}.")
        _strict_parse(meta_path)
        v = Variant(d.name, d, meta)
        for f in sorted(d.rglob("*")):
            rel = f.relative_to(d)
            if "__pycache__" in rel.parts or f.suffix == ".pyc" or f.is_dir():
                continue
            if not f.is_file():
                raise PublishError(f"{f} is not a regular file (a broken symlink?). Rebuild the variant.")
            v.files[f"build/{d.name}/{rel.as_posix()}"] = f
        variants.append(v)
    if not variants:
        raise PublishError(f"No build variants in {build_dir}: expected folders like {build_dir}/torch-cpu/ each with "
                           "a metadata.json. Build the kernel first.")
    return variants


def _strict_parse(meta_path: Path) -> None:
    """Parse metadata.json with the loader's own parser when it is installed, so that a variant kernels cannot load
    is never published (e.g. a provenance without 'kernel-builder', or a short commit id)."""
    try:
        from kernels import Metadata
    except Exception:
        return
    try:
        Metadata.from_bytes(meta_path.read_bytes())
    except ValueError as e:
        raise PublishError(f"{meta_path} would not load: the kernels loader cannot parse it ({e}). Fix the builder "
                           "output and rebuild.")


def check_build(variants: list[Variant], toml: dict, force_dirty: bool) -> int:
    versions = {v.metadata["version"] for v in variants}
    if len(versions) > 1:
        detail = ", ".join(f"{v.name}: {v.metadata['version']}" for v in variants)
        raise PublishError(f"The variants disagree on the version ({detail}); one publish goes to one branch v<N>. "
                           "Rebuild all variants from the same build.toml.")
    version = versions.pop()
    general = toml.get("general", {})
    if "version" in general and general["version"] != version:
        raise PublishError(f"build.toml says version {general['version']} but the build is version {version}: the "
                           "build is stale. Rebuild, or publish from the checkout that made it (--build-toml).")
    names = {v.metadata["name"] for v in variants}
    if "name" in general and names != {general["name"]}:
        raise PublishError(f"build.toml names the kernel {general['name']!r} but the variants say "
                           f"{', '.join(sorted(map(repr, names)))}. Rebuild.")
    ids: dict[str, str] = {}
    for v in variants:
        if v.metadata["id"] in ids:
            raise PublishError(f"Variants {ids[v.metadata['id']]} and {v.name} share the id {v.metadata['id']!r}; "
                               "ids must be unique (kernels registers each variant as sys.modules[id]). Rebuild.")
        ids[v.metadata["id"]] = v.name
    dirty = [v.name for v in variants if v.dirty]
    if dirty and not force_dirty:
        raise PublishError(f"Refusing to publish a dirty build: {', '.join(dirty)} were built from uncommitted "
                           "changes (metadata provenance.kernel.dirty / id suffix '_dirty'), so nobody could rebuild "
                           "them from git. Commit your changes and rebuild, or pass --force-dirty to publish anyway.")
    return version


def benchmark_files(root: Path) -> dict[str, Path]:
    """The kernel repository's ``benchmarks/benchmark*.py`` (path in the repo -> local file), for branch v<N>."""
    folder = root / "benchmarks"
    return {f"benchmarks/{p.name}": p for p in sorted(folder.glob(BENCHMARK_GLOB)) if p.is_file()}


def card_text(toml: dict, root: Path, repo_id: str, version: int, variants: list[Variant],
              versions_on_hub: dict[int, list[str]], benchmarks: list[str]) -> str:
    """The README.md for main: ``root``'s CARD.md filled in (kerneltools.card). Raises PublishError."""
    card_variants = [CardVariant(v.name, v.backend, tuple(v.archs)) for v in variants]
    context = card_context(toml, repo_id, version, card_variants, versions_on_hub, root, benchmarks)
    try:
        return render_card(context, root)
    except CardError as e:
        raise PublishError(f"Cannot render the card: {e}") from None


# ----------------------------------------------------------------------------------------------------------------------
# talking to the Hub
# ----------------------------------------------------------------------------------------------------------------------


def _status(e: Exception) -> int | None:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)


def _is_transport_error(e: BaseException) -> bool:
    mods = {c.__module__.split(".")[0] for c in type(e).__mro__}
    return isinstance(e, (OSError, ConnectionError)) or bool(mods & {"httpx", "httpx2", "httpcore", "httpcore2",
                                                                   "requests", "urllib3"})


def _tree_files(api, repo_id: str, rev: str, path: str | None, recursive: bool = True) -> dict:
    """The files under ``path`` (None: the top level) at ``rev``: path in the repo -> RepoFile."""
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.hf_api import RepoFile

    try:
        return {e.path: e for e in api.list_repo_tree(repo_id, path_in_repo=path, repo_type="kernel", revision=rev,
                                                      recursive=recursive) if isinstance(e, RepoFile)}
    except EntryNotFoundError:
        return {}


def _holds(remote, data: bytes) -> bool:
    """Whether the Hub's file ``remote`` (a RepoFile) has exactly the content ``data``: its LFS sha256, or its git
    blob id."""
    if remote is None:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == hashlib.sha256(data).hexdigest()
    return remote.blob_id == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_benchmark(path: str) -> bool:
    folder, _, name = path.rpartition("/")
    return folder == "benchmarks" and Path(name).match(BENCHMARK_GLOB)


def _heads(api, repo_id: str) -> dict[str, str]:
    refs = api.list_repo_refs(repo_id, repo_type="kernel")
    return {b.name: b.target_commit for b in refs.branches}


class _Steps:
    """A step progress bar (tqdm, on stderr; silent when not a terminal unless forced)."""

    def __init__(self, total: int, enabled: bool | None):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="publish", unit="step", disable=(None if enabled is None else not enabled),
                        file=sys.stderr, bar_format="{desc}: {n_fmt}/{total_fmt} {bar} {postfix}")

    def step(self, what: str) -> None:
        self.bar.set_postfix_str(what)

    def done(self) -> None:
        self.bar.update(1)

    def write(self, msg: str) -> None:
        self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def _commit_with_retry(api, repo_id: str, branch: str, make_ops, message: str, say) -> tuple[str, bool] | None:
    """create_commit(parent_commit=head) on branch; on 412 (moved meanwhile) recompute on the new head and retry.

    Returns (head after it, whether a commit was made: make_ops returning no operation means the branch already
    holds everything), or None when the branch does not exist."""
    from huggingface_hub.errors import HfHubHTTPError

    for attempt in range(1, MAX_ATTEMPTS + 1):
        head = _heads(api, repo_id).get(branch)
        if head is None:
            return None
        ops = make_ops(head)
        if not ops:
            return head, False
        try:
            return api.create_commit(repo_id, operations=ops, commit_message=message, repo_type="kernel",
                                     revision=branch, parent_commit=head).oid, True
        except HfHubHTTPError as e:
            if _status(e) != 412:
                raise
            say(f"branch {branch} moved while uploading (another publish?); retrying on its new head "
                f"(attempt {attempt + 1}/{MAX_ATTEMPTS})")
    raise PublishError(f"Branch {branch} of {repo_id} kept changing during {MAX_ATTEMPTS} attempts (several publishes "
                       "at once?). Nothing from this attempt was committed; run publish again.")


def _upload_build(api, repo_id: str, version: int, variants: list[Variant], benchmarks: dict[str, Path], say,
                  notes: list[str]) -> tuple[str, bool]:
    """Commit the variants (and benchmark scripts) to branch v<version>; returns (its head, whether it changed)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import HfHubHTTPError

    branch = f"v{version}"
    adds = {p: f for v in variants for p, f in v.files.items()}
    adds.update(benchmarks)
    names = ", ".join(v.name for v in variants)
    message = f"Upload {names} (version {version})"

    def remote_files(head: str) -> dict:
        return {**_tree_files(api, repo_id, head, "build"), **_tree_files(api, repo_id, head, "benchmarks")}

    def stale(path: str, uploaded_variants: bool) -> bool:
        if path in adds:
            return False
        if path.startswith("build/"):
            return not uploaded_variants or any(path.startswith(f"build/{v.name}/") for v in variants)
        return bool(benchmarks) and _is_benchmark(path)  # benchmark scripts the checkout no longer has

    def ops_replacing_variants(head: str) -> list:
        # existing branch: replace the uploaded variants (and benchmark scripts) only; unchanged files stay out
        remote = remote_files(head)
        dels = [p for p in remote if stale(p, uploaded_variants=True)]
        new = [p for p, f in adds.items() if not _holds(remote.get(p), f.read_bytes())]
        return [CommitOperationDelete(p) for p in dels] + [CommitOperationAdd(p, str(adds[p])) for p in new]

    def ops_fresh(head: str) -> list:
        # new branch from main: no build/ file but the uploaded ones
        dels = [p for p in remote_files(head) if stale(p, uploaded_variants=False)]
        return [CommitOperationDelete(p) for p in dels] + [CommitOperationAdd(p, str(f)) for p, f in adds.items()]

    for _ in range(MAX_ATTEMPTS):
        heads = _heads(api, repo_id)
        if branch in heads:
            done = _commit_with_retry(api, repo_id, branch, ops_replacing_variants, message, say)
            if done is not None:
                return done
            continue  # the branch was deleted meanwhile: start over
        if "main" not in heads:
            raise PublishError(f"{repo_id} has no 'main' branch to start {branch} from. Create it (any commit on "
                               "main), or delete and recreate the repo.")
        # Build v<N> on a temporary branch, then create v<N> at that commit in one step: v<N> never exists half-made.
        tmp = f"{TMP_BRANCH_PREFIX}{branch}-{uuid.uuid4().hex[:8]}"
        api.create_branch(repo_id, branch=tmp, revision=heads["main"], repo_type="kernel")
        try:
            sha = api.create_commit(repo_id, operations=ops_fresh(heads["main"]), commit_message=message,
                                    repo_type="kernel", revision=tmp, parent_commit=heads["main"]).oid
            try:
                api.create_branch(repo_id, branch=branch, revision=sha, repo_type="kernel")
                return sha, True
            except HfHubHTTPError as e:
                if _status(e) != 409:
                    raise
                say(f"branch {branch} was created by someone else meanwhile (another publish?); adding {names} to it")
        finally:
            try:
                api.delete_branch(repo_id, branch=tmp, repo_type="kernel")
            except Exception as e:  # the server may be gone: say so, it is harmless (kernels ignores it)
                notes.append(f"could not delete the temporary branch {tmp} ({type(e).__name__}); kernels ignores it, "
                             f"delete it later with HfApi().delete_branch({repo_id!r}, branch={tmp!r}, "
                             "repo_type='kernel')")
    raise PublishError(f"Branch {branch} of {repo_id} kept appearing and disappearing (concurrent publishes or "
                       "deletes?). Run publish again.")


def _versions_on_hub(api, repo_id: str) -> dict[int, list[str]]:
    from huggingface_hub.hf_api import RepoFolder

    out = {}
    for name, sha in _heads(api, repo_id).items():
        if name.startswith("v") and name[1:].isdigit():
            try:
                tree = api.list_repo_tree(repo_id, path_in_repo="build", repo_type="kernel", revision=sha)
                out[int(name[1:])] = sorted(e.path.split("/", 1)[1] for e in tree if isinstance(e, RepoFolder))
            except Exception:
                out[int(name[1:])] = []
    return out


def publish(build_dir="build", repo_id: str | None = None, endpoint: str | None = None, token=None,
            force_dirty: bool = False, build_toml=None, progress: bool | None = None) -> PublishResult:
    """Publish build_dir to repo_id (default: [general.hub] repo-id of build.toml) with the benchmark scripts and
    the card of the repository that holds build.toml. Raises PublishError."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    build_dir = Path(build_dir)
    toml_path = Path(build_toml) if build_toml else build_dir.resolve().parent / "build.toml"
    toml = load_build_toml(toml_path)
    root = toml_path.resolve().parent
    repo_id = repo_id or toml_repo_id(toml)
    if not repo_id:
        raise PublishError(f"No repo id: pass --repo-id ORG/NAME or set repo-id under [general.hub] in {toml_path}.")
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise PublishError(f"{e} Pass --repo-id ORG/NAME, or fix [general.hub] repo-id in {toml_path}.") from None
    variants = scan_build(build_dir)
    version = check_build(variants, toml, force_dirty)
    benchmarks = benchmark_files(root)
    # a card that cannot render stops the publish here, before anything is uploaded
    card_text(toml, root, repo_id, version, variants, {version: [v.name for v in variants]}, list(benchmarks))

    api = HfApi(endpoint=endpoint, token=token)
    endpoint = api.endpoint
    steps = _Steps(3, progress)
    notes: list[str] = []
    state = "nothing was published"
    try:
        steps.step(f"create {repo_id}")
        api.create_repo(repo_id, repo_type="kernel", exist_ok=True)
        steps.done()
        files = [f for v in variants for f in v.files.values()] + list(benchmarks.values())
        steps.step(f"upload v{version}: {len(files)} files, {sum(f.stat().st_size for f in files) / 1e6:.1f} MB")
        sha, build_changed = _upload_build(api, repo_id, version, variants, benchmarks, steps.write, notes)
        state = f"version {version} was published (branch v{version} at {sha[:12]}) but the card on main was not updated"
        steps.done()
        steps.step("card README.md on main")
        card = card_text(toml, root, repo_id, version, variants, _versions_on_hub(api, repo_id),
                         list(benchmarks)).encode()

        def card_ops(head: str) -> list:
            current = _tree_files(api, repo_id, head, None, recursive=False).get("README.md")
            return [] if _holds(current, card) else [CommitOperationAdd("README.md", card)]

        card_done = _commit_with_retry(api, repo_id, "main", card_ops, f"Update card for version {version}",
                                       steps.write)
        steps.done()
    except PublishError:
        raise
    except RepositoryNotFoundError as e:
        raise PublishError(f"The Hub at {endpoint} says {repo_id} does not exist or you may not write to it "
                           f"({_first_line(e)}). Check the repo id and your token (HF_TOKEN or `hf auth login`); "
                           f"{state}." + _notes(notes))
    except HfHubHTTPError as e:
        hint = " Check your token (HF_TOKEN or `hf auth login`)." if _status(e) in (401, 403) else ""
        raise PublishError(f"The Hub at {endpoint} refused a request: {_first_line(e)}.{hint} So far {state}."
                           + _notes(notes))
    except Exception as e:
        if not _is_transport_error(e):
            raise
        raise PublishError(f"Lost the connection to the Hub at {endpoint} ({type(e).__name__}: {e}). So far {state}: "
                           "commits are atomic, so the Hub holds either the whole commit or none of it. Check that "
                           "the server is up (python -m kerneltools serve --root DIR) and run publish again; "
                           "repeating it is safe." + _notes(notes))
    finally:
        steps.close()
    card_sha, card_changed = card_done if card_done is not None else (None, False)
    return PublishResult(repo_id, version, f"v{version}", sha, [v.name for v in variants], card_sha, endpoint, notes,
                         benchmarks=list(benchmarks), build_changed=build_changed, card_changed=card_changed)


def _notes(notes: list[str]) -> str:
    return "".join(f"\nNote: {n}" for n in notes)


def _first_line(e: Exception) -> str:
    lines = [l for l in str(e).splitlines() if l.strip()]
    server = getattr(e, "server_message", None)
    return (server or (lines[0] if lines else type(e).__name__)).strip().rstrip(".")


# ----------------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "publish", help="upload build/ to a kernel repo on the Hub (branch v<version>)",
        description="Upload the variants in the build directory to branch v<version> of a kernel repo and update "
                    "the card on main. Uses HF_ENDPOINT/--endpoint and your Hugging Face token.")
    p.add_argument("--build-dir", type=Path, default=Path("build"), help="builder output (default: build)")
    p.add_argument("--repo-id", help="ORG/NAME (default: [general.hub] repo-id in build.toml)")
    p.add_argument("--endpoint", help="Hub URL (default: $HF_ENDPOINT, else https://huggingface.co)")
    p.add_argument("--build-toml", type=Path, help="build.toml to read (default: next to the build directory); its "
                   "folder's CARD.md and benchmarks/benchmark*.py are published with the build")
    p.add_argument("--force-dirty", action="store_true", help="publish a build made from uncommitted changes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(_main=main)


def main(args) -> int:
    endpoint = args.endpoint or os.environ.get("HF_ENDPOINT") or None
    try:
        r = publish(args.build_dir, repo_id=args.repo_id, endpoint=endpoint, force_dirty=args.force_dirty,
                    build_toml=args.build_toml, progress=False if args.no_progress else None)
    except PublishError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for n in r.notes:
        print(f"note: {n}", file=sys.stderr)
    what = ", ".join(r.variants + r.benchmarks)
    if r.build_changed:
        print(f"Published {r.repo_id} version {r.version} to {r.endpoint}: branch {r.branch} at {r.commit[:12]} "
              f"({what}).")
    else:  # one line for a republish of the same build, not one "nothing changed" per commit
        print(f"{r.repo_id} version {r.version} on {r.endpoint} already holds this build: branch {r.branch} at "
              f"{r.commit[:12]} ({what}); "
              + ("the card on main was updated." if r.card_changed else "nothing new was committed."))
    print(f'Load it with: get_kernel("{r.repo_id}", version={r.version})')
    return 0
