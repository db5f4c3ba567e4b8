"""The one exception type of the loopback Hub server, and the Hub's typed errors.

The HTTP layer (:mod:`.http`) turns a :class:`HubError` into a status code, the Hub's ``X-Error-Code`` and
``X-Error-Message`` headers and a JSON ``{"error": ...}`` body. huggingface_hub maps ``X-Error-Code`` to its typed
exceptions (``RepoNotFound`` -> RepositoryNotFoundError, ...).
"""

from __future__ import annotations


class HubError(Exception):
    """An answer other than 2xx: status, message, optional ``X-Error-Code`` and extra headers."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})


def repo_not_found(repo_type: str, repo_id: str) -> HubError:
    return HubError(404, f"Repository not found: {repo_type} '{repo_id}' does not exist on this server.", "RepoNotFound")


def revision_not_found(repo_id: str, rev: str) -> HubError:
    return HubError(404, f"Invalid rev id: {rev!r} is not a branch, tag or commit of '{repo_id}'.", "RevisionNotFound")


def entry_not_found(repo_id: str, rev: str, path: str) -> HubError:
    return HubError(404, f"Entry not found: '{path}' does not exist in '{repo_id}' at revision '{rev}'.",
                    "EntryNotFound")


def unauthorized(message: str) -> HubError:
    """401: no token where one is needed, or a token this server does not know."""
    return HubError(401, message, "Unauthorized", {"WWW-Authenticate": 'Bearer realm="kerneltools-hub"'})


def forbidden(message: str) -> HubError:
    """403: a known token without the right role, or a request this server refuses to act on (cross-site)."""
    return HubError(403, message, "Forbidden")


def busy(message: str, retry_after: int = 1) -> HubError:
    """503 + Retry-After: try again shortly (limits reached, a lock held)."""
    return HubError(503, message, "ServiceUnavailable", {"Retry-After": str(retry_after)})


def disk_full(message: str) -> HubError:
    return HubError(507, message, "InsufficientStorage", {"Retry-After": "60"})
