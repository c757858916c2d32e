"""TorchServe's management API, as the benchmarks call it on either server."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


class ManagementClient:
    """Register, describe and unregister models and workflows at ``self.management``; a
    refusal is raised as ``self.failure`` makes it (each server says where its logs are)."""

    management: str

    def failure(self, what: str, status: int, text: str) -> Exception:
        return RuntimeError(f"{what}: {status} {text}")

    def _call(self, method: str, path: str, what: str) -> bytes:
        request = urllib.request.Request(f"{self.management}{path}", method=method)
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as error:
            raise self.failure(what, error.code,
                               error.read().decode(errors="replace").strip()) from None

    def register(self, url: str, **params: object) -> None:
        query = urllib.parse.urlencode({"url": url, "synchronous": "true", **params})
        self._call("POST", f"/models?{query}", f"could not register {url}")

    def scale(self, name: str, workers: int) -> None:
        """``PUT /models/{name}``: exactly ``workers`` workers, answered once they are up."""
        query = urllib.parse.urlencode({"min_worker": workers, "max_worker": workers,
                                        "synchronous": "true"})
        self._call("PUT", f"/models/{name}?{query}", f"could not scale {name} to {workers}")

    def unregister(self, name: str) -> None:
        self._call("DELETE", f"/models/{name}", f"could not unregister {name}")

    def describe(self, name: str) -> dict[str, object]:
        return json.loads(self._call("GET", f"/models/{name}", f"no model {name}"))[0]  # type: ignore[no-any-return]

    def register_workflow(self, url: str, name: str | None = None) -> None:
        """``POST /workflows``: answers once the workflow's models are up (TorchServe always
        registers a workflow synchronously)."""
        query = urllib.parse.urlencode({"url": url, **({"workflow_name": name} if name else {})})
        self._call("POST", f"/workflows?{query}", f"could not register workflow {url}")

    def unregister_workflow(self, name: str) -> None:
        self._call("DELETE", f"/workflows/{name}", f"could not unregister workflow {name}")
