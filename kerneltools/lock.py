"""Offline use of locked or versioned kernels: ``python -m kerneltools prefetch``.

    python -m kerneltools prefetch ORG/NAME --version N [--cache-dir DIR] [--endpoint URL]
    python -m kerneltools prefetch [ORG/NAME] --lockfile kernels.lock [--cache-dir DIR] [--endpoint URL]

Locking itself is kernels' own (docs/locking.md): ``kernels lock <project>`` writes ``kernels.lock`` from the
project's ``[tool.kernels.dependencies]``, and ``get_locked_kernel`` / ``load_kernel`` / ``LockedLayerRepository``
read it (pass ``lockfile=Path(...)``: the default lookup is broken in kernels 0.17.2).

What this module adds is the step that makes those loads, and ``get_kernel(version=N)``, work with
``HF_HUB_OFFLINE=1``. kernels 0.17.2's offline resolvers read only the cache (``$KERNELS_CACHE``, else the hub cache):

1. ``get_kernel(version=N)`` reads ``kernels--ORG--NAME/refs/vN`` to find the commit. A normal online load
   downloads by commit and never writes that file.
2. Every offline load calls ``snapshot_download(revision=<commit>, local_files_only=True)``. huggingface_hub >= 1.22
   accepts the snapshot only if it holds *every* file that ``trees/<commit>.json`` lists, while a normal online load
   downloads one variant: so it fails, even for a kernel loaded a minute earlier.
3. The loaded variant's ``kernel-depends`` are resolved the same way, recursively.

prefetch therefore downloads whole commits (every variant and the files outside ``build/``; bytecode excluded, as
kernels does), checks each snapshot with the very call kernels makes offline, checks each variant against the
digest in its metadata.json (``kernels_data.Digest``; a mismatch is refused and the snapshot evicted), and only
then writes ``refs/vN``, so an interrupted or refused prefetch never leaves ``refs/vN`` pointing at an incomplete
or wrong snapshot. It follows ``kernel-depends`` (at their locked commits with ``--lockfile``). It also runs
kernels' publisher-trust check: offline loads skip it, on the assumption that it passed when the kernel was
downloaded, and prefetch is that download.

What kernels 0.17.2 already has is used as it is (lock files: ``KernelLocks``; metadata: ``Metadata``; the
downloads: huggingface_hub). Its own download helpers (``kernels download``, ``install_kernel``,
``install_kernel_all_variants``) fetch single variants or ``build/*`` only, write no ``refs/vN`` and take the
endpoint and cache fixed at import; its trust check has no endpoint argument. docs/locking.md has the table.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

# what kernels never downloads nor requires offline (kernels.resolver._BYTECODE_IGNORE_PATTERNS)
BYTECODE_IGNORE = ["*.pyc", "**/__pycache__/**"]
_COMMIT_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")


class PrefetchError(Exception):
    """A problem the user can fix; the message says what was wrong and what to do."""


@dataclass
class Prefetched:
    repo_id: str
    commit: str
    path: Path  # the snapshot folder
    variants: list[str]
    refs: list[str] = field(default_factory=list)  # cache refs written, e.g. ["v1"]


def kernels_cache_dir(cache_dir=None) -> Path:
    """The cache kernels uses: ``$KERNELS_CACHE``, else huggingface_hub's ``HF_HUB_CACHE``."""
    if cache_dir:
        return Path(cache_dir)
    if os.environ.get("KERNELS_CACHE"):
        return Path(os.environ["KERNELS_CACHE"])
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def read_lockfile(path) -> list[tuple[object, str]]:
    """``[(KernelDependency, commit)]`` from a kernels.lock (or a project folder holding one), parsed by kernels."""
    from .kernels_api import read_locks

    path = Path(path)
    if path.is_dir():
        path = path / "kernels.lock"
    if not path.is_file():
        raise PrefetchError(f"Lock file {path} does not exist. Create it with `kernels lock <project dir>` (the "
                            "project's pyproject.toml lists [tool.kernels.dependencies]).")
    try:
        return read_locks(path.read_text())
    except ValueError as e:
        raise PrefetchError(f"{path} is not a lock file this kernels reads ({e}). Regenerate it with "
                            "`kernels lock <project dir>`.") from None


def _is_transport_error(e: BaseException | None) -> bool:
    """A network failure (possibly wrapped by huggingface_hub), as opposed to an answer from the Hub."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if e is None or isinstance(e, HfHubHTTPError):
        return False
    if isinstance(e, LocalEntryNotFoundError):  # "cannot reach the Hub and not in the cache"
        return _is_transport_error(e.__cause__)
    mods = {c.__module__.split(".")[0] for c in type(e).__mro__}
    return isinstance(e, (ConnectionError, TimeoutError)) or bool(
        mods & {"httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"})


class _Prefetcher:
    def __init__(self, api, cache: Path, trust_remote_code, locks: dict | None, log):
        self.api, self.cache, self.trust, self.locks, self.log = api, cache, trust_remote_code, locks, log
        self.done: dict[tuple[str, str], Prefetched] = {}

    # --- what to fetch --------------------------------------------------------------------------------------------

    def version(self, repo_id: str, version: int) -> Prefetched:
        self._check_trust(repo_id)
        branches = {b.name: b.target_commit for b in self.api.list_repo_refs(repo_id, repo_type="kernel").branches}
        versions = {int(n[1:]): sha for n, sha in branches.items() if re.fullmatch(r"v\d+", n)}
        if version not in versions:
            raise PrefetchError(f"Version {version} of {repo_id} not found on {self.api.endpoint}, available "
                                f"versions: {', '.join(str(v) for v in sorted(versions)) or 'none'}.")
        return self._fetch(repo_id, versions[version], ref=f"v{version}")

    def commit(self, repo_id: str, commit: str) -> Prefetched:
        self._check_trust(repo_id)
        return self._fetch(repo_id, commit, ref=None)

    def revision(self, repo_id: str, revision: str) -> Prefetched:
        if _COMMIT_RE.match(revision):
            return self.commit(repo_id, revision)
        self._check_trust(repo_id)
        sha = self.api.repo_info(repo_id, repo_type="kernel", revision=revision).sha
        return self._fetch(repo_id, sha, ref=revision)

    def dependency(self, dep, needed_by: str) -> Prefetched:
        from .kernels_api import dependency_revision, dependency_version

        if self.locks is not None:
            commit = self.locks.get(dep)
            if commit is None:
                raise PrefetchError(f"{needed_by} depends on {dep.repo_id}, which the lock file does not pin. "
                                    "Re-run `kernels lock <project dir>`.")
            return self.commit(dep.repo_id, commit)
        if dependency_version(dep) is not None:
            return self.version(dep.repo_id, dependency_version(dep))
        return self.revision(dep.repo_id, dependency_revision(dep))

    # --- how ------------------------------------------------------------------------------------------------------

    def _check_trust(self, repo_id: str) -> None:
        """kernels' check (kernels.hf_hub._check_trust_remote_code), against this endpoint."""
        trust = self.trust
        if trust is True or (isinstance(trust, (list, tuple, set)) and repo_id in trust):
            return
        opt_in = (f"Offline loads skip this check, so prefetch does it: pass --trust-repo {repo_id} (like "
                  f"trust_remote_code=[{repo_id!r}]) or --trust-remote-code to fetch it anyway.")
        try:
            info = self.api.get_organization_overview(repo_id.split("/", 1)[0])
        except Exception as e:
            if _is_transport_error(e):
                raise
            raise PrefetchError(f"Kernel repository '{repo_id}' could not verify publisher trust status "
                                f"({type(e).__name__}). {opt_in}") from None
        if not getattr(info, "trustedKernelPublisher", False):
            raise PrefetchError(f"Kernel repository '{repo_id}' is not from a trusted publisher. {opt_in}")

    def _snapshot(self, repo_id: str, commit: str, local_files_only: bool) -> Path:
        return Path(self.api.snapshot_download(repo_id, repo_type="kernel", revision=commit, cache_dir=str(self.cache),
                                               ignore_patterns=BYTECODE_IGNORE, local_files_only=local_files_only))

    def _fetch(self, repo_id: str, commit: str, ref: str | None) -> Prefetched:
        from huggingface_hub.errors import LocalEntryNotFoundError
        from kernels import Metadata

        key = (repo_id, commit)
        if key not in self.done:
            self._snapshot(repo_id, commit, local_files_only=False)  # everything, no allow_patterns
            try:
                path = self._snapshot(repo_id, commit, local_files_only=True)  # what kernels calls offline
            except LocalEntryNotFoundError as e:
                raise PrefetchError(f"The snapshot of {repo_id} at {commit} is still incomplete after downloading "
                                    f"it ({e}). Run prefetch again.") from None
            metas = sorted((path / "build").glob("*/metadata.json"))
            if not metas:
                raise PrefetchError(f"{repo_id} at {commit} has no build/<variant>/metadata.json: it is not a kernel "
                                    "build (publish one with `python -m kerneltools publish`).")
            for m in metas:
                verify_variant(repo_id, commit, m.parent)
            self.done[key] = got = Prefetched(repo_id, commit, path, [m.parent.name for m in metas])
            self.log(f"{repo_id} @ {commit[:12]}: {', '.join(got.variants)}")
            for m in metas:
                try:
                    deps = Metadata.read_from_file(m).kernel_depends
                except ValueError as e:
                    raise PrefetchError(f"{repo_id} at {commit}: kernels cannot parse build/{m.parent.name}/"
                                        f"metadata.json ({e}), so it would not load it either.") from None
                for dep in deps:
                    self.dependency(dep, needed_by=f"{repo_id} ({m.parent.name})")
        got = self.done[key]
        if ref is not None and ref not in got.refs:
            _write_ref(self.cache, repo_id, ref, commit)  # only now: the snapshot it names is complete
            got.refs.append(ref)
        return got


def verify_variant(repo_id: str, commit: str, variant_dir: Path) -> bool:
    """Check a cached variant's files against the digest in its metadata.json (kernels_data.Digest: sha256 of every
    file but metadata.json, as kernel-builder writes it). True if they match, False if the metadata has no digest.

    On a mismatch the snapshot of that commit is taken out of the cache (its folder, and the blobs of the
    mismatching files, so that neither an offline load nor the next prefetch reuses them) and PrefetchError names
    the variant and the first mismatching file."""
    from kernels_data import Digest, DigestValidationError, Metadata

    try:
        meta = Metadata.read_from_file(variant_dir / "metadata.json")
    except ValueError as e:
        raise PrefetchError(f"{repo_id} at {commit}: kernels cannot parse build/{variant_dir.name}/metadata.json "
                            f"({e}), so it would not load it either.") from None
    if meta.digest is None:
        return False
    try:
        meta.digest.validate(Digest.hash_variant(meta.digest.algorithm, variant_dir))
    except DigestValidationError as e:
        bad = sorted(e.violations, key=lambda v: getattr(v, "path", ""))
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        _evict_snapshot(variant_dir.parents[1], [variant_dir / v.path for v in bad if hasattr(v, "path")])
        raise PrefetchError(
            f"{repo_id} at {commit}: variant {variant_dir.name} does not match the digest in its metadata.json: "
            f"{bad[0]} (build/{variant_dir.name}/{getattr(bad[0], 'path', '')}){more}. Either the cached copy was "
            "changed or the Hub serves files other than the ones this build was made with. The snapshot was "
            "removed from the cache, so nothing loads it offline. Run prefetch again to download it afresh; if it "
            "fails the same way, the published build is inconsistent (republish it), and pin a known-good commit "
            "with `kernels lock` (docs/locking.md).") from None
    return True


def _evict_snapshot(snapshot: Path, bad_files: list[Path]) -> None:
    import shutil

    for f in bad_files:
        if f.is_symlink():  # snapshots/<commit>/<path> -> ../../blobs/<etag>
            f.resolve().unlink(missing_ok=True)
    shutil.rmtree(snapshot, ignore_errors=True)


def _write_ref(cache: Path, repo_id: str, ref: str, commit: str) -> None:
    from huggingface_hub.file_download import repo_folder_name

    path = cache / repo_folder_name(repo_id=repo_id, repo_type="kernel") / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(commit)  # the hub's format: the bare commit id, no newline
    os.replace(tmp, path)


def prefetch(repo_id: str | None = None, *, version: int | None = None, lockfile=None, cache_dir=None,
             endpoint: str | None = None, token=None, trust_remote_code: bool | list[str] = False,
             log=lambda msg: None) -> list[Prefetched]:
    """Download what offline loads of ``repo_id`` at ``version`` (or of the kernels pinned by ``lockfile``; all of
    them when ``repo_id`` is None) need into the kernels cache. Raises PrefetchError."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    if (version is None) == (lockfile is None):
        raise PrefetchError("Pass exactly one of --version N and --lockfile PATH.")
    if version is not None and not repo_id:
        raise PrefetchError("--version needs the repo id (ORG/NAME).")
    if constants.HF_HUB_OFFLINE:
        raise PrefetchError("HF_HUB_OFFLINE is set, but prefetch has to download: run it online (unset "
                            "HF_HUB_OFFLINE for this command), then load with HF_HUB_OFFLINE=1.")
    locks = None
    wanted: list[tuple[str, str]] = []
    if lockfile is not None:
        entries = read_lockfile(lockfile)
        locks = {dep: commit for dep, commit in entries}
        wanted = [(dep.repo_id, commit) for dep, commit in entries if repo_id in (None, dep.repo_id)]
        if not wanted:
            raise PrefetchError(f"{repo_id} is not in {lockfile} (it pins "
                                f"{', '.join(d.repo_id for d, _ in entries) or 'nothing'}). Add it to the project's "
                                "[tool.kernels.dependencies] and re-run `kernels lock <project dir>`.")

    api = HfApi(endpoint=endpoint, token=token)
    cache = kernels_cache_dir(cache_dir)
    p = _Prefetcher(api, cache, trust_remote_code, locks, log)
    what = f"{repo_id} version {version}" if version is not None else f"the kernels locked in {lockfile}"
    try:
        if version is not None:
            p.version(repo_id, version)
        else:
            for rid, commit in wanted:
                p.commit(rid, commit)
    except PrefetchError:
        raise
    except RepositoryNotFoundError as e:
        raise PrefetchError(f"The Hub at {api.endpoint} has no kernel repo {_repo_of(e) or repo_id} (or you may not "
                            "read it). Check the repo id, HF_ENDPOINT/--endpoint and your token.") from None
    except RevisionNotFoundError as e:
        raise PrefetchError(f"The Hub at {api.endpoint} lacks a revision needed for {what} ({_first_line(e)}). A "
                            "locked commit disappears only if the repo's history was rewritten: re-run "
                            "`kernels lock <project dir>`.") from None
    except HfHubHTTPError as e:
        raise PrefetchError(f"The Hub at {api.endpoint} refused a request for {what}: {_first_line(e)}.") from None
    except Exception as e:
        if not _is_transport_error(e):
            raise
        raise PrefetchError(f"Lost the connection to the Hub at {api.endpoint} while prefetching {what} "
                            f"({type(e).__name__}: {e}). The cache is still consistent: huggingface_hub keeps partial "
                            "files apart (*.incomplete) and refs/vN is written only once its snapshot is complete. "
                            "Run prefetch again when the Hub is reachable; it resumes.") from None
    return list(p.done.values())


def _repo_of(e: Exception) -> str | None:
    m = re.search(r"/api/kernels/([^/\s]+/[^/\s]+)", str(e))
    return m.group(1) if m else None


def _first_line(e: Exception) -> str:
    server = getattr(e, "server_message", None)
    lines = [line for line in str(e).splitlines() if line.strip()]
    return (server or (lines[0] if lines else type(e).__name__)).strip().rstrip(".")


# ----------------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "prefetch", help="download kernels so that they load offline (HF_HUB_OFFLINE=1)",
        description="Download complete snapshots of a kernel version, or of the kernels pinned by a kernels.lock, "
                    "into the kernels cache ($KERNELS_CACHE, else the hub cache), so that get_kernel(version=N), "
                    "get_locked_kernel, load_kernel and LockedLayerRepository work with HF_HUB_OFFLINE=1. "
                    "Needed with kernels 0.17, where a normal online load leaves a cache that offline loads reject; "
                    "with kernels 0.19 it adds the digest check of every variant.")
    p.add_argument("repo_id", nargs="?", help="ORG/NAME (required with --version; with --lockfile: only this kernel)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", type=int, help="major version N (branch vN)")
    which.add_argument("--lockfile", type=Path, help="kernels.lock, or the project folder holding it")
    p.add_argument("--cache-dir", type=Path, help="cache to fill (default: $KERNELS_CACHE, else the hub cache)")
    p.add_argument("--endpoint", help="Hub URL (default: $HF_ENDPOINT, else https://huggingface.co)")
    p.add_argument("--trust-repo", action="append", default=[], metavar="ORG/NAME",
                   help="fetch this repo even if its publisher is not trusted (repeatable)")
    p.add_argument("--trust-remote-code", action="store_true", help="fetch from any publisher")
    p.set_defaults(_main=main)


def main(args) -> int:
    try:
        got = prefetch(args.repo_id, version=args.version, lockfile=args.lockfile, cache_dir=args.cache_dir,
                       endpoint=args.endpoint or os.environ.get("HF_ENDPOINT") or None,
                       trust_remote_code=True if args.trust_remote_code else args.trust_repo,
                       log=lambda msg: print(f"fetched {msg}", file=sys.stderr))
    except PrefetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cache = kernels_cache_dir(args.cache_dir)
    for g in got:
        refs = f" (refs: {', '.join(g.refs)})" if g.refs else ""
        print(f"{g.repo_id} @ {g.commit}{refs}: {', '.join(g.variants)}")
    print(f"Prefetched into {cache}. Load offline with HF_HUB_OFFLINE=1"
          + ("" if args.cache_dir is None or os.environ.get("KERNELS_CACHE") == str(args.cache_dir)
             else f" KERNELS_CACHE={cache}") + ".")
    return 0
