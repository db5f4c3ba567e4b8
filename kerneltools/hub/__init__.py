"""A Hugging Face Hub-compatible server for loopback, backed by git (docs/hub-server.md).

Modules, each depending only on those before it: :mod:`.errors` (HubError), :mod:`.names` (what names are
accepted), :mod:`.storage` (git repositories), :mod:`.http` (bodies, limits, timeouts, error answers),
:mod:`.upload` (streaming commit payloads), :mod:`.auth` (tokens, roles, trust; ``hub-auth`` CLI) and
:mod:`.server` (routes, ``serve_hub``, ``HubProcess``, ``serve`` CLI).
"""

from .server import DEFAULT_TRUSTED_ORGS, HubProcess, make_server, serve_hub

__all__ = ["DEFAULT_TRUSTED_ORGS", "HubProcess", "make_server", "serve_hub"]
