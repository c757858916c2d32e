"""Each tenant's requests, refusals and latency, per model version (issue 35; kept only when
the server tells tenants apart: ``tenant_header`` or ``tenant_weights``, docs/scheduling.md):

* ``batchserve_tenant_requests_total{model_name,model_version,tenant,status}``: predictions
  answered, by status code (0: the client left first);
* ``batchserve_tenant_refused_total{model_name,model_version,tenant,reason}``: those answered
  without running, and why (``CallFacts.refusal``: queue_full, displaced, level_full,
  deadline_unmeetable, unavailable, deadline);
* ``batchserve_tenant_latency_seconds{model_name,model_version,tenant}``: their end-to-end
  latency.
"""

from __future__ import annotations

from collections.abc import Iterator

from frontend.observe.events import CallFacts
from frontend.observe.exposition import Family
from frontend.observe.histograms import MODEL_LABELS, TIME_BUCKETS, Histogram

TENANT_LABELS = (*MODEL_LABELS, "tenant")


class TenantMetrics:
    """Per model version and tenant: requests by status, refusals by reason, latency."""

    def __init__(self) -> None:
        self.latency = Histogram("batchserve_tenant_latency_seconds",
                                 "End-to-end latency of a tenant's predictions, in the server",
                                 TIME_BUCKETS, TENANT_LABELS)
        #: (model, version, tenant, status) -> predictions answered.
        self.requests: dict[tuple[str, str, str, str], int] = {}
        #: (model, version, tenant, reason) -> predictions answered without running.
        self.refused: dict[tuple[str, str, str, str], int] = {}

    def call_ended(self, call: CallFacts) -> None:
        key = call.key
        if key is None:
            return
        tenant = call.job.tenant
        counted = (*key, tenant, str(call.status))
        self.requests[counted] = self.requests.get(counted, 0) + 1
        self.latency.observe((*key, tenant), call.latency_s)
        reason = call.refusal()
        if reason is not None:
            refused = (*key, tenant, reason)
            self.refused[refused] = self.refused.get(refused, 0) + 1

    def of_model(self, name: str, version: str) -> dict[str, dict[str, int]]:
        """Describe's view of one model version: each tenant's requests (answered by a
        worker: status 200) and refusals (by reason), since the server started."""
        tenants: dict[str, dict[str, int]] = {}
        for (model, model_version, tenant, status), count in list(self.requests.items()):
            if (model, model_version) == (name, version):
                seen = tenants.setdefault(tenant, {"requests": 0, "ok": 0})
                seen["requests"] += count
                seen["ok"] += count if status == "200" else 0
        for (model, model_version, tenant, reason), count in list(self.refused.items()):
            if (model, model_version) == (name, version):
                seen = tenants.setdefault(tenant, {"requests": 0, "ok": 0})
                seen[f"refused_{reason}"] = seen.get(f"refused_{reason}", 0) + count
        return tenants

    def families(self) -> Iterator[Family]:
        counters = (
            ("batchserve_tenant_requests_total", "status", self.requests,
             "A tenant's predictions answered, by status (0: the client left first)"),
            ("batchserve_tenant_refused_total", "reason", self.refused,
             "A tenant's predictions answered without running, by reason"))
        for name, label, counts, documentation in counters:
            family = Family(name, documentation, "counter")
            for key, count in list(counts.items()):
                family.add((*TENANT_LABELS, label), key, float(count))
            yield family
        yield self.latency.family()
