"""Self-managed registration: the ready, elected gateway keeps its own two registrations in the cluster.

Opt-in (``--manage-registration``), as Kyverno's webhook controller does. Every replica runs
``Registrar.run``; only a *ready* replica competes for a coordination.k8s.io Lease, and only the
holder writes. The holder keeps the ValidatingWebhookConfiguration and MutatingWebhookConfiguration
equal to what ``gateway.registration.compute`` derives from the configuration in force (caBundle
included), so a configuration reload is reflected on the next round, and a registration edited or
deleted by hand is put back. On shutdown, when the Deployment itself is gone or scaled to zero (an
uninstall, not a rolling update), the holder relaxes both registrations to ``failurePolicy: Ignore``
so that the apiserver stops rejecting reviews once no gateway answers.

The writes go through the one API client (``gateway.sources.kube.KubeClient.request_json``):
GET, POST (create), PUT (replace, with the read ``resourceVersion`` for optimistic concurrency: a
409 Conflict means someone else wrote first, and the next round starts from a fresh read), and a
JSON merge PATCH for relaxing. Every request runs under the client's deadlines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import structlog
import trio

from gateway.config.model import Snapshot
from gateway.errors import ConfigError
from gateway.registration import Settings, compute
from gateway.sources.kube import KubeAPIError, KubeClient, KubeError

log = structlog.get_logger("gateway.registrar")

ADMISSION: Final = "/apis/admissionregistration.k8s.io/v1"
COLLECTIONS: Final = {
    "ValidatingWebhookConfiguration": f"{ADMISSION}/validatingwebhookconfigurations",
    "MutatingWebhookConfiguration": f"{ADMISSION}/mutatingwebhookconfigurations",
}
MANAGED_BY: Final = {"app.kubernetes.io/managed-by": "webhook-gateway"}


def _micro_time(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # metav1.MicroTime


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z")
    except ValueError:
        try:
            return datetime.strptime(text.replace("Z", "+0000"), "%Y-%m-%dT%H:%M:%S%z")
        except ValueError:
            return None


@dataclass
class LeaderElection:
    """One candidate for a coordination.k8s.io/v1 Lease (client-go's leaderelection, reduced)."""

    client: KubeClient
    namespace: str
    name: str
    identity: str
    lease_seconds: int = 15
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)

    @property
    def path(self) -> str:
        return f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/{self.name}"

    async def try_acquire_or_renew(self) -> bool:
        """One round: True when this candidate holds the Lease afterwards."""
        now = self.clock()
        lease = await self.client.get_object(self.path)
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": self.lease_seconds,
            "acquireTime": _micro_time(now),
            "renewTime": _micro_time(now),
            "leaseTransitions": 0,
        }
        try:
            if lease is None:
                await self.client.request_json(
                    "POST",
                    self.path.rsplit("/", 1)[0],
                    {
                        "apiVersion": "coordination.k8s.io/v1",
                        "kind": "Lease",
                        "metadata": {"name": self.name, "namespace": self.namespace},
                        "spec": spec,
                    },
                )
                return True
            current = lease.get("spec") or {}
            holder = current.get("holderIdentity") or ""
            renewed = _parse_time(current.get("renewTime"))
            duration = int(current.get("leaseDurationSeconds") or self.lease_seconds)
            held_by_other = holder and holder != self.identity and renewed is not None
            if held_by_other and renewed is not None and (now - renewed).total_seconds() < duration:
                return False  # someone else holds a lease that has not expired
            if holder == self.identity:
                spec["acquireTime"] = current.get("acquireTime") or spec["acquireTime"]
                spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0)
            else:
                spec["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + 1
            lease["spec"] = spec
            await self.client.request_json("PUT", self.path, lease)  # carries the read resourceVersion
            return True
        except KubeAPIError as exc:
            if exc.code == 409:
                return False  # another candidate wrote first: it leads this round
            raise

    async def release(self) -> None:
        """Give the Lease up at once, so that another ready replica takes over without waiting."""
        lease = await self.client.get_object(self.path)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        lease["spec"] = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
        try:
            await self.client.request_json("PUT", self.path, lease)
        except KubeAPIError as exc:
            if exc.code != 409:
                raise


def _owned(doc: Mapping[str, Any]) -> tuple[Any, Any]:
    return doc.get("webhooks") or [], (doc.get("metadata") or {}).get("labels") or {}


@dataclass
class Registrar:
    """Keeps the cluster's registrations equal to the computed ones while this replica leads."""

    client: KubeClient
    election: LeaderElection
    snapshot: Callable[[], Snapshot]
    ready: Callable[[], bool]
    settings: Callable[[], Settings]  # read each round: the caBundle file may have been rotated
    deployment: str = "webhook-gateway"
    interval: float = 2.0
    leading: bool = False
    rounds: int = 0
    stopped: bool = False

    def desired(self) -> list[dict[str, Any]]:
        docs = [dict(d) for d in compute(self.snapshot(), self.settings()).documents()]
        for doc in docs:
            doc["metadata"] = {**doc["metadata"], "labels": {**doc["metadata"]["labels"], **MANAGED_BY}}
        return docs

    async def reconcile(self) -> int:
        """Create or replace what differs; the number of writes."""
        writes = 0
        for doc in self.desired():
            collection = COLLECTIONS[doc["kind"]]
            path = f"{collection}/{doc['metadata']['name']}"
            current = await self.client.get_object(path)
            if current is None:
                await self.client.request_json("POST", collection, doc)
                log.info("registration created", kind=doc["kind"], name=doc["metadata"]["name"])
                writes += 1
            elif _owned(current) != _owned(doc):
                replacement = {**doc, "metadata": {**doc["metadata"], **_kept_metadata(current)}}
                await self.client.request_json("PUT", path, replacement)
                log.info("registration updated", kind=doc["kind"], name=doc["metadata"]["name"])
                writes += 1
        return writes

    async def round(self) -> None:
        """One election round, and a reconcile when leading. Errors end the round, not the loop."""
        self.rounds += 1
        if self.stopped:
            return
        try:
            if not self.ready():
                self.leading = False
                return
            leading = await self.election.try_acquire_or_renew()
            if leading != self.leading:
                log.info("registration leadership", leading=leading, identity=self.election.identity)
            self.leading = leading
            if leading:
                await self.reconcile()
        except KubeAPIError as exc:
            if exc.code != 409:
                log.warning("registration round failed", error=str(exc), code=exc.code)
        except (KubeError, ConfigError) as exc:
            log.warning("registration round failed", error=str(exc))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.round()
            await trio.sleep(self.interval)

    async def shutdown(self) -> None:
        """On SIGTERM: relax the registrations if this is an uninstall, then give the Lease up."""
        self.stopped = True
        if not self.leading:
            return
        try:
            if await self._uninstalling():
                for doc in self.desired():
                    path = f"{COLLECTIONS[doc['kind']]}/{doc['metadata']['name']}"
                    current = await self.client.get_object(path)
                    if current is None or not current.get("webhooks"):
                        continue
                    relaxed = [{**hook, "failurePolicy": "Ignore"} for hook in current["webhooks"]]
                    await self.client.request_json(
                        "PATCH", path, {"webhooks": relaxed}, content_type="application/merge-patch+json"
                    )
                    log.info("registration relaxed: failurePolicy Ignore", kind=doc["kind"])
            await self.election.release()
        except (KubeError, ConfigError) as exc:
            log.warning("registration shutdown failed", error=str(exc))
        self.leading = False

    async def _uninstalling(self) -> bool:
        path = f"/apis/apps/v1/namespaces/{self.election.namespace}/deployments/{self.deployment}"
        deployment = await self.client.get_object(path)
        if deployment is None:
            return True
        if (deployment.get("metadata") or {}).get("deletionTimestamp"):
            return True
        return int((deployment.get("spec") or {}).get("replicas", 1)) == 0


def _kept_metadata(current: Mapping[str, Any]) -> dict[str, Any]:
    """What a replace must carry over from the stored object: its version, and others' annotations."""
    meta = current.get("metadata") or {}
    kept = {"resourceVersion": meta.get("resourceVersion")}
    if meta.get("annotations"):
        kept["annotations"] = meta["annotations"]  # e.g. cert-manager's inject-ca-from
    return kept


def lease_seconds_for(interval: float) -> int:
    """A Lease outlives a few missed renewals, as client-go's defaults do (15 s for a 2 s retry)."""
    return max(5, math.ceil(interval * 7.5))
