"""Device time: what each model version's batches took of its device, and each tenant's part.

* ``batchserve_device_time_seconds_total{device,model_name,model_version}``: the measured
  service time of the batches of a model in a ``deviceGroup`` (read from its status when
  scraped: the group's scheduler, frontend/serving/devices.py, keeps the sums it schedules by);
* ``batchserve_tenant_device_time_seconds_total{model_name,model_version,tenant}``: each
  batch's service time split over its requests' tenants by their cost (a request's items: a
  KServe request counts its instances), for every model.

The live page reads the same (``tenant_rows``, ``device_rows``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from frontend.observe.events import DEFAULT_TENANT, Batch, JobFacts, ModelKey
from frontend.observe.exposition import Family
from frontend.observe.histograms import MODEL_LABELS
from frontend.observe.status import Statuses
from protos import worker_pb2


def tenant_of(job: JobFacts) -> str:
    """The tenant a request was queued for (``Job.tenant``, set by the inference plane)."""
    return job.tenant or DEFAULT_TENANT


def _cost(job: JobFacts) -> int:
    weight = getattr(job, "weight", 1)
    return weight if isinstance(weight, int) and weight > 0 else 1


class DeviceMetrics:
    """Device time per model version (from the statuses) and per tenant (from the batches)."""

    def __init__(self, models: Statuses) -> None:
        self._models = models
        #: (model, version, tenant) -> device seconds, and requests served.
        self.tenant_time: dict[tuple[str, str, str], float] = {}
        self.tenant_requests: dict[tuple[str, str, str], int] = {}

    def batch_ended(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
                    result: worker_pb2.PredictResult | None) -> None:
        if not jobs or batch.service_s <= 0.0:
            return
        if len(jobs) == 1:
            self._add((*key, tenant_of(jobs[0])), batch.service_s, 1)
            return
        costs = [_cost(job) for job in jobs]
        per_item = batch.service_s / sum(costs)
        for job, cost in zip(jobs, costs, strict=True):
            self._add((*key, tenant_of(job)), per_item * cost, 1)

    def _add(self, key: tuple[str, str, str], seconds: float, requests: int) -> None:
        self.tenant_time[key] = self.tenant_time.get(key, 0.0) + seconds
        self.tenant_requests[key] = self.tenant_requests.get(key, 0) + requests

    def removed(self, key: ModelKey) -> None:
        for held in [k for k in self.tenant_time if k[:2] == key]:
            del self.tenant_time[held]
            self.tenant_requests.pop(held, None)

    def families(self) -> Iterator[Family]:
        devices = Family("batchserve_device_time_seconds_total",
                         "Device time (measured batch service time) of the models of a device "
                         "group", "counter")
        for model in list(self._models()):
            if model.device is not None:
                devices.add(("device", *MODEL_LABELS),
                            (model.device.group, model.name, model.version),
                            model.device.device_time_s)
        tenants = Family("batchserve_tenant_device_time_seconds_total",
                         "Device time of a model's batches, split over their requests' "
                         "tenants by cost", "counter")
        for key, seconds in list(self.tenant_time.items()):
            tenants.add((*MODEL_LABELS, "tenant"), key, seconds)
        yield from (devices, tenants)

    def tenant_rows(self) -> list[dict[str, object]]:
        """The live page's tenant table: each model's tenants, their requests served, device
        seconds and share of the model's device time."""
        totals: dict[tuple[str, str], float] = {}
        for (name, version, _), seconds in self.tenant_time.items():
            totals[(name, version)] = totals.get((name, version), 0.0) + seconds
        rows: list[dict[str, object]] = []
        for (name, version, tenant), seconds in sorted(self.tenant_time.items()):
            total = totals[(name, version)]
            rows.append({"model": name, "version": version, "tenant": tenant,
                         "requests": self.tenant_requests.get((name, version, tenant), 0),
                         "deviceTimeS": round(seconds, 3),
                         "share": round(seconds / total, 4) if total > 0 else 0.0})
        return rows

    def device_rows(self) -> list[dict[str, object]]:
        """The live page's device table: each model of a device group, and its share."""
        return [{"model": model.name, "version": model.version, **model.device.fields()}
                for model in sorted(self._models(), key=lambda m: (m.name, m.version))
                if model.device is not None]
