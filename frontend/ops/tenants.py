"""Who sent a request, and at which priority (issue 35; docs/scheduling.md).

A request's tenant is the tenant whose inference key authorized it (the key file's
``tenants``: a header cannot then claim another), else the value of ``tenant_header`` (HTTP
header or gRPC metadata of that name), else ``default``. Its priority level is
``priority_header``'s value (or KServe v2's ``priority`` parameter, which the transport
passes to the plane), for a model with ``priorityLevels``. The plane stamps both on the job
of a model that tells requests apart (``Model.tenanted``); for any other it reads nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from frontend.config.values import TENANT_NAME
from frontend.errors import BadRequest, quoted
from frontend.ops.auth import TokenAuthority, bearer_token
from frontend.serving.batching import Job
from frontend.serving.fairness import DEFAULT_TENANT
from frontend.settings import MAX_PRIORITY_LEVELS

logger = logging.getLogger(__name__)

#: At most this many tenants are told apart by name (those in ``tenant_weights`` first, then
#: names in the order requests bring them); a request naming another is the default tenant's.
#: Every name is a queue, a weight and series in the metrics: clients must not make them
#: without end.
MAX_TENANTS = 256


def parse_priority(name: str, value: object) -> int:
    """A request's priority level, an integer from 1 (the highest); BadRequest otherwise."""
    try:
        level = int(value.decode("latin-1") if isinstance(value, bytes) else str(value))
    except ValueError:
        level = 0
    if isinstance(value, bool) or not 1 <= level <= MAX_PRIORITY_LEVELS:
        raise BadRequest(f"{name} must be an integer from 1 (the highest priority) to "
                         f"{MAX_PRIORITY_LEVELS}, got {quoted(value)}")
    return level


class Tenancy:
    """Reads a request's tenant and priority from its headers (see the module's docstring)."""

    def __init__(self, tenant_header: str, priority_header: str,
                 auth: TokenAuthority | None = None, listed: Iterable[str] = ()) -> None:
        self._tenant_name = tenant_header.lower().encode() if tenant_header else None
        self._tenant_header = tenant_header
        self._priority_name = priority_header.lower().encode() if priority_header else None
        self._priority_header = priority_header
        #: Tenants' keys, when the key file has some.
        self._auth = auth if auth is not None and auth.has_tenant_keys else None
        #: The names told apart so far (``MAX_TENANTS`` at most; the listed ones first).
        self._known: set[str] = set(list(dict.fromkeys(listed))[:MAX_TENANTS])
        self._full = False

    def stamp(self, job: Job, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Set ``job``'s tenant and priority from ``headers`` (BadRequest for bad values)."""
        tenant: str | None = None
        for name, value in headers:
            if name == self._tenant_name:
                tenant = value.decode("latin-1")
                if not TENANT_NAME.fullmatch(tenant):
                    raise BadRequest(f"{self._tenant_header} must be 1 to 64 letters, digits, "
                                     f"'_', '-' or '.', got {quoted(tenant)}")
            elif name == self._priority_name:
                job.priority = parse_priority(self._priority_header, value)
        if self._auth is not None:
            keyed = self._auth.tenant_of(bearer_token(headers))
            if keyed is not None:
                tenant = keyed
        job.tenant = self._bounded(tenant) if tenant else DEFAULT_TENANT

    def _bounded(self, tenant: str) -> str:
        """``tenant``, or the default tenant once ``MAX_TENANTS`` others are known."""
        known = self._known
        if tenant in known:
            return tenant
        if len(known) < MAX_TENANTS:
            known.add(tenant)
            return tenant
        if not self._full:  # said once
            self._full = True
            logger.warning("%d tenants are told apart already: requests naming another are "
                           "the default tenant's", MAX_TENANTS)
        return DEFAULT_TENANT
