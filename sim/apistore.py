"""Object storage of the simulated API server: the etcd-plus-registry part.

One lock guards every object, the single global resourceVersion counter and the bounded event
history that watches read from. Stored objects are never mutated in place (each write stores a
new dict), so events can share them, and readers get copies. Every write goes through the same
admission path (defaulting, canonicalisation, validation, resourceVersion preconditions), whether
it came over HTTP or from a test in the same process.

A backup and its restore: `snapshot` keeps the objects and the revision, `restore` puts them
back as etcd restored from that backup does (the backup's objects with their old
resourceVersions, numbering going on from its revision; `restore()` with none is an API server
started empty). The API server is restarted on it, so every watch ends and the event history
starts afresh at the restored revision: a watch from before it is 410 Gone, and one from beyond
it (a client that saw the lost history) is refused as kube-apiserver's watch cache refuses it,
504 "Too large resource version" (a real one first waits up to 3 s for its cache to catch up).
"""

from __future__ import annotations

import copy
import datetime
import json
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sim import apievents, apissa, apivalidate
from sim.apierrors import (
    ApiError,
    already_exists,
    bad_request,
    conflict,
    invalid,
    not_found,
)
from sim.apiselect import Predicate
from sim.apitypes import BY_KIND, RESOURCE_TYPES, ResourceType

# apimachinery's utilrand alphabet: no vowels (no accidental words), no confusable 0/1/3.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_GENERATED_SUFFIX_LEN = 5
_IMMUTABLE_SLICE_FIELDS = (("driver",), ("pool", "name"), ("nodeName",))

Key = tuple[str, str]  # (namespace or "", name)


def now_rfc3339() -> str:
    """The server's clock in metav1.Time form (RFC 3339, whole seconds, UTC), for every timestamp
    the simulated cluster writes."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clone(obj: Any) -> Any:
    """A deep copy of a JSON value (faster than copy.deepcopy for plain JSON)."""
    return json.loads(json.dumps(obj))


@dataclass
class Event:
    """One stored change, kept in the bounded history that watches replay."""

    rv: int
    type: str  # ADDED, MODIFIED or DELETED
    rtype: ResourceType
    obj: dict[str, Any]
    old: dict[str, Any] | None = None


@dataclass(frozen=True)
class Snapshot:
    """The objects and the revision at one moment: what an etcd backup holds."""

    objects: dict[str, dict[Key, dict[str, Any]]]
    rv: int


@dataclass
class Store:
    """All objects of all resource types, with resourceVersions and watch history."""

    validate: bool = True
    history: int = 1000
    list_attributes_enabled: bool = True
    device_taints_enabled: bool = True
    partitionable_devices_enabled: bool = True
    consumable_capacity_enabled: bool = True
    binding_conditions_enabled: bool = True
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _objects: dict[str, dict[Key, dict[str, Any]]] = field(
        default_factory=lambda: {t.plural: {} for t in RESOURCE_TYPES}
    )
    _rv: int = 0
    _events: deque[Event] = field(default_factory=deque)
    _evicted_rv: int = 0  # events up to and including this resourceVersion are gone
    _epoch: int = 0  # bumped to end every open watch
    _closed: bool = False
    _open_watches: int = 0

    # --- reads ----------------------------------------------------------------------------------

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        with self._cond:
            return clone(self._require(rtype, namespace, name))

    def list(self, rtype: ResourceType, namespace: str | None, match: Predicate) -> tuple[list[dict[str, Any]], str]:
        """Matching objects (sorted by namespace and name, like etcd keys) and the list resourceVersion."""
        with self._cond:
            items = [
                obj
                for (ns, _), obj in sorted(self._objects[rtype.plural].items())
                if (namespace is None or ns == namespace) and match(obj)
            ]
            return clone(items), str(self._rv)

    def find_kind(self, obj: dict[str, Any]) -> ResourceType:
        rtype = BY_KIND.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
        if rtype is None:
            raise bad_request(f"the simulator does not serve {obj.get('apiVersion')}/{obj.get('kind')}")
        return rtype

    # --- writes ---------------------------------------------------------------------------------

    def create(
        self,
        rtype: ResourceType,
        namespace: str | None,
        body: dict[str, Any],
        *,
        dry_run: bool = False,
        keep_status: bool = False,
    ) -> dict[str, Any]:
        """POST. `keep_status` (in-process only) lets a test create a claim that is already allocated."""
        obj = self._check_body(rtype, body)
        meta = obj.setdefault("metadata", {})
        namespace = self._namespace(rtype, namespace, meta)
        for server_owned in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp", "managedFields"):
            meta.pop(server_owned, None)
        if "status" in rtype.subresources and not keep_status:
            obj.pop("status", None)
        with self._cond:
            if not meta.get("name"):
                prefix = meta.get("generateName")
                if not prefix:
                    raise invalid(
                        rtype.kind_group, "", ["metadata.name: Required value: name or generateName is required"], {}
                    )
                meta["name"] = self._generate_name(rtype, namespace or "", prefix)
            name = meta["name"]
            key = (namespace or "", name)
            if key in self._objects[rtype.plural]:
                raise already_exists(rtype.group_resource, name, rtype.details(name))
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            if rtype.has_generation:
                meta["generation"] = 1
            obj = self._admit(rtype, obj, None)
            if dry_run:
                return obj
            return clone(self._commit(rtype, key, obj, "ADDED", None))

    def update(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str | None,
        body: dict[str, Any],
        *,
        subresource: str = "",
        dry_run: bool = False,
        replace_status: bool = False,
    ) -> dict[str, Any]:
        """PUT of the object (status kept unless `replace_status`) or of its status subresource."""
        obj = self._check_body(rtype, body)
        meta = obj.setdefault("metadata", {})
        name = name or meta.get("name")
        if not name:
            raise invalid(rtype.kind_group, "", ["metadata.name: Required value: name is required"], {})
        if meta.get("name") not in (None, name):
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})"
            )
        namespace = self._namespace(rtype, namespace, meta)
        with self._cond:
            old = self._require(rtype, namespace, name)
            self._check_resource_version(rtype, name, old, meta.get("resourceVersion"))
            if subresource == "status":
                new = clone(old)
                if "status" in obj:
                    new["status"] = obj["status"]
                else:
                    new.pop("status", None)
            else:
                new = obj
                if "status" in rtype.subresources and not replace_status:
                    if "status" in old:
                        new["status"] = clone(old["status"])
                    else:
                        new.pop("status", None)
                new_meta = new["metadata"]
                new_meta["name"], new_meta["namespace"] = name, old["metadata"].get("namespace")
                if new_meta["namespace"] is None:
                    new_meta.pop("namespace")
                for server_owned in ("uid", "creationTimestamp", "deletionTimestamp", "managedFields", "generation"):
                    if server_owned in old["metadata"]:
                        new_meta[server_owned] = old["metadata"][server_owned]
                    else:
                        new_meta.pop(server_owned, None)
            return self._write_update(rtype, old, new, dry_run)

    def patch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        content_type: str,
        *,
        subresource: str = "",
        manager: str | None = None,
        force: bool = False,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """PATCH with a JSON merge patch, or server-side apply of a claim's status."""
        if not isinstance(patch, dict):
            raise bad_request("the patch must be a JSON object")
        if content_type == "application/apply-patch+yaml":
            return self._apply(rtype, namespace, name, patch, subresource, manager, force, dry_run)
        if content_type != "application/merge-patch+json":
            raise ApiError(
                415,
                f'the simulator accepts only "application/merge-patch+json" and "application/apply-patch+yaml" '
                f"(on resourceclaims/status) patches, not {content_type!r}",
            )
        with self._cond:
            old = self._require(rtype, namespace, name)
            merged = _merge_patch(clone(old), patch)
            if not isinstance(merged, dict):
                raise bad_request("the patched object is not a JSON object")
            if subresource == "status":
                new = clone(old)
                if "status" in merged:
                    new["status"] = merged["status"]
                else:
                    new.pop("status", None)
            else:
                new = merged
                if "status" in rtype.subresources:
                    new["status"] = old.get("status")
                    if new["status"] is None:
                        new.pop("status")
            self._check_resource_version(rtype, name, old, (patch.get("metadata") or {}).get("resourceVersion"))
            for server_owned in ("uid", "creationTimestamp", "name", "namespace", "managedFields", "generation"):
                if server_owned in old["metadata"]:
                    new["metadata"][server_owned] = old["metadata"][server_owned]
            return self._write_update(rtype, old, new, dry_run)

    def delete(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        preconditions: dict[str, Any] | None = None,
        *,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """DELETE; returns the deleted object (or, with finalizers, the object now being deleted)."""
        with self._cond:
            old = self._require(rtype, namespace, name)
            meta = old["metadata"]
            for field_name, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                wanted = (preconditions or {}).get(field_name)
                if wanted is not None and wanted != meta.get(field_name):
                    raise conflict(
                        rtype.group_resource,
                        name,
                        f"Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {meta.get(field_name)}",
                        rtype.details(name),
                    )
            if dry_run:
                return clone(old)
            key = (meta.get("namespace", ""), name)
            if meta.get("finalizers"):
                if meta.get("deletionTimestamp"):
                    return clone(old)
                new = clone(old)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                return clone(self._commit(rtype, key, new, "MODIFIED", old))
            return clone(self._remove(rtype, key))

    def delete_collection(
        self, rtype: ResourceType, namespace: str | None, match: Predicate, *, dry_run: bool = False
    ) -> list[dict[str, Any]]:
        items, _ = self.list(rtype, namespace, match)
        deleted = []
        for item in items:
            try:
                deleted.append(self.delete(rtype, namespace, item["metadata"]["name"], dry_run=dry_run))
            except ApiError as e:
                if e.code != 404:  # deleted concurrently: nothing left to do
                    raise
        return deleted

    # --- watches --------------------------------------------------------------------------------

    def watch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        match: Predicate,
        resource_version: str | None,
        send_initial_events: bool = False,
    ) -> Watcher:
        """A watch from `resource_version` (None or "0": all current objects first, as ADDED).

        `send_initial_events` is a watch-list request (client-go's default reflector since 1.35):
        the current objects as ADDED, then a BOOKMARK annotated `k8s.io/initial-events-end`, which
        the client waits for before it treats its cache as synced.
        """
        with self._cond:
            if resource_version in (None, "", "0") or send_initial_events:
                initial, since = self.list(rtype, namespace, match)
                events = [("ADDED", o) for o in initial]
                if send_initial_events:
                    events.append(("BOOKMARK", _initial_events_end(rtype, since)))
                return Watcher(self, rtype, namespace, match, int(since), events, self._epoch)
            try:
                since_rv = int(resource_version)
            except ValueError:
                raise bad_request(f"invalid resource version {resource_version!r}") from None
            if since_rv < self._evicted_rv:
                raise gone(since_rv, self._evicted_rv + 1)
            if since_rv > self._rv:
                raise too_large(since_rv, self._rv)
            return Watcher(self, rtype, namespace, match, since_rv, [], self._epoch)

    # --- backup and restore ---------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The objects and the revision now (the objects are shared: stored ones never change)."""
        with self._cond:
            return Snapshot({plural: dict(objs) for plural, objs in self._objects.items()}, self._rv)

    def restore(self, snapshot: Snapshot | None = None) -> None:
        """Put the objects and the revision back to `snapshot`, or to an empty store at revision 0
        (module docstring); every open watch ends."""
        with self._cond:
            self._objects = {t.plural: dict(snapshot.objects[t.plural]) if snapshot else {} for t in RESOURCE_TYPES}
            self._rv = snapshot.rv if snapshot else 0
            self._events.clear()
            self._evicted_rv = self._rv
            self._epoch += 1
            self._cond.notify_all()

    @property
    def open_watches(self) -> int:
        """How many watches are being served right now (tests wait on it before breaking them)."""
        with self._cond:
            return self._open_watches

    def close_watches(self) -> None:
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._epoch += 1
            self._cond.notify_all()

    # --- internals ------------------------------------------------------------------------------

    def _require(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._objects[rtype.plural].get(((namespace or "") if rtype.namespaced else "", name))
        if obj is None:
            raise not_found(rtype.group_resource, name, rtype.details(name))
        return obj

    def _check_body(self, rtype: ResourceType, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        obj = clone(body)
        obj.setdefault("apiVersion", rtype.api_version)
        obj.setdefault("kind", rtype.kind)
        if (obj["apiVersion"], obj["kind"]) != (rtype.api_version, rtype.kind):
            raise bad_request(
                f"the body is a {obj['apiVersion']}/{obj['kind']}, but the request is for "
                f"{rtype.api_version}/{rtype.kind}"
            )
        if not isinstance(obj.get("metadata", {}), dict):
            raise bad_request("metadata must be an object")
        return obj

    def _namespace(self, rtype: ResourceType, namespace: str | None, meta: dict[str, Any]) -> str | None:
        if not rtype.namespaced:
            meta.pop("namespace", None)
            return None
        namespace = namespace or meta.get("namespace")
        if not namespace:
            raise bad_request(f"{rtype.kind} is namespaced: a namespace is required")
        if meta.get("namespace") not in (None, namespace):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        meta["namespace"] = namespace
        return namespace

    def _generate_name(self, rtype: ResourceType, namespace: str, prefix: str) -> str:
        while True:
            name = prefix + "".join(random.choices(_NAME_ALPHABET, k=_GENERATED_SUFFIX_LEN))
            if (namespace, name) not in self._objects[rtype.plural]:
                return name

    def _check_resource_version(self, rtype: ResourceType, name: str, old: dict[str, Any], wanted: Any) -> None:
        if wanted not in (None, "") and wanted != old["metadata"]["resourceVersion"]:
            raise conflict(
                rtype.group_resource,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
                rtype.details(name),
            )

    def _apply(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        patch: dict[str, Any],
        subresource: str,
        manager: str | None,
        force: bool,
        dry_run: bool,
    ) -> dict[str, Any]:
        if not manager:
            raise invalid(
                "PatchOptions.meta.k8s.io", "", ["fieldManager: Required value: is required for apply patch"], {}
            )
        if rtype.plural != "resourceclaims" or subresource != "status":
            raise ApiError(415, "the simulator supports server-side apply only on resourceclaims/status")
        if (patch.get("apiVersion"), patch.get("kind")) != (rtype.api_version, rtype.kind):
            raise bad_request(f"apply body must have apiVersion {rtype.api_version} and kind {rtype.kind}")
        if (patch.get("metadata") or {}).get("name") not in (None, name):
            raise bad_request("the name of the applied object does not match the name on the URL")
        applied = patch.get("status") or {}
        if not isinstance(applied, dict):
            raise bad_request("status must be an object")
        with self._cond:
            old = self._require(rtype, namespace, name)
            self._check_resource_version(rtype, name, old, (patch.get("metadata") or {}).get("resourceVersion"))
            uid = (patch.get("metadata") or {}).get("uid")
            if uid and uid != old["metadata"].get("uid"):
                # As the real server does: a UID in the applied object is a precondition.
                raise ApiError(
                    409,
                    f"Precondition failed: UID in precondition: {uid}, UID in object meta: {old['metadata'].get('uid')}",
                    reason="Conflict",
                )
            new = apissa.apply_status(old, applied, manager, force, now_rfc3339())
            return self._write_update(rtype, old, new, dry_run, applied=True)

    def _write_update(
        self, rtype: ResourceType, old: dict[str, Any], new: dict[str, Any], dry_run: bool, applied: bool = False
    ) -> dict[str, Any]:
        """Admit and store `new` in place of `old` (caller holds the lock)."""
        meta = new["metadata"]
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if rtype.has_generation:
            meta["generation"] = old["metadata"].get("generation", 1) + (new.get("spec") != old.get("spec"))
        if "status" in rtype.subresources and not applied and old.get("status") != new.get("status"):
            meta["managedFields"] = apissa.release_changed(
                old.get("status") or {}, new.get("status") or {}, meta.get("managedFields") or []
            )
            if not meta["managedFields"]:
                meta.pop("managedFields")
        new = self._admit(rtype, new, old)
        if dry_run:
            return new
        key = (meta.get("namespace", ""), meta["name"])
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._objects[rtype.plural][key] = new
            return clone(self._remove(rtype, key))
        if new == old:
            return clone(old)  # a no-op write does not bump the resourceVersion, as on a real server
        return clone(self._commit(rtype, key, new, "MODIFIED", old))

    def _admit(self, rtype: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """Defaulting, canonicalisation and validation, as a real server's strategy does them."""
        problems: list[str] = []
        name = obj["metadata"].get("name", "")
        if rtype.plural == "resourceslices":
            obj = self._prepare_slice(obj, old, problems)
        elif rtype.plural == "resourceclaims":
            obj = _prepare_claim(obj, old, problems)
        problems += _immutable_problems(rtype, obj, old)
        if self.validate:
            problems += apivalidate.dns_subdomain_problems("metadata.name", name)
            problems += apivalidate.schema_problems(obj)
            if rtype.plural == "resourceslices" and isinstance(obj.get("spec"), dict):
                problems += apivalidate.slice_problems(obj["spec"])
            if rtype.plural == "resourceclaims" and isinstance(obj.get("status"), dict):
                problems += apivalidate.claim_status_problems(obj["status"])
            if rtype.plural == "events":
                problems += apievents.event_problems(obj, old)
        if problems:
            raise invalid(rtype.kind_group, name, problems, rtype.details(name))
        return obj

    def _prepare_slice(self, obj: dict[str, Any], old: dict[str, Any] | None, problems: list[str]) -> dict[str, Any]:
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            return obj
        old_uses_lists = old is not None and any(
            _has_list_attribute(d) for d in ((old.get("spec") or {}).get("devices") or [])
        )
        drop_lists = not self.list_attributes_enabled and not old_uses_lists
        old_uses_taints = old is not None and any(
            d.get("taints") for d in ((old.get("spec") or {}).get("devices") or [])
        )
        drop_taints = not self.device_taints_enabled and not old_uses_taints
        old_spec = (old or {}).get("spec") or {}
        old_uses_counters = bool(old_spec.get("sharedCounters")) or any(
            d.get("consumesCounters") for d in old_spec.get("devices") or []
        )
        if not self.partitionable_devices_enabled and not old_uses_counters:
            spec.pop("sharedCounters", None)  # the fields of DRAPartitionableDevices, dropped with it off
            for device in spec.get("devices") or []:
                if isinstance(device, dict):
                    device.pop("consumesCounters", None)
        old_uses_binding = any(
            d.get("bindingConditions") or d.get("bindingFailureConditions") or d.get("bindsToNode") is not None
            for d in old_spec.get("devices") or []
        )
        if not self.binding_conditions_enabled and not old_uses_binding:
            for device in spec.get("devices") or []:  # the fields of DRADeviceBindingConditions, dropped with it off
                if isinstance(device, dict):
                    for binding_field in ("bindingConditions", "bindingFailureConditions", "bindsToNode"):
                        device.pop(binding_field, None)
        old_uses_sharing = any(d.get("allowMultipleAllocations") for d in old_spec.get("devices") or [])
        if not self.consumable_capacity_enabled and not old_uses_sharing:
            for device in spec.get("devices") or []:  # the fields of DRAConsumableCapacity, dropped with it off
                if isinstance(device, dict):
                    device.pop("allowMultipleAllocations", None)
                    for cap in (device.get("capacity") or {}).values():
                        if isinstance(cap, dict):
                            cap.pop("requestPolicy", None)
        stamp = now_rfc3339()
        for device in spec.get("devices") or []:
            if not isinstance(device, dict):
                continue
            if drop_lists:
                for attr in (device.get("attributes") or {}).values():
                    for list_field in apivalidate.LIST_VALUE_FIELDS:
                        if isinstance(attr, dict):
                            attr.pop(list_field, None)
            if drop_taints:
                device.pop("taints", None)  # a disabled gate drops the field, as the real strategy does
            for taint in device.get("taints") or []:
                if isinstance(taint, dict) and not taint.get("timeAdded"):
                    taint["timeAdded"] = stamp
        obj["spec"] = apivalidate.rewrite_quantities(spec, "spec", problems, apivalidate.slice_quantity_path)
        return obj

    def _commit(
        self, rtype: ResourceType, key: Key, obj: dict[str, Any], event_type: str, old: dict[str, Any] | None
    ) -> dict[str, Any]:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[rtype.plural][key] = obj
        self._record(Event(self._rv, event_type, rtype, obj, old))
        return obj

    def _remove(self, rtype: ResourceType, key: Key) -> dict[str, Any]:
        """Delete and garbage-collect dependants (objects whose ownerReferences name the deleted uid)."""
        old = self._objects[rtype.plural].pop(key)
        self._rv += 1
        gone_obj = clone(old)
        gone_obj["metadata"]["resourceVersion"] = str(self._rv)
        self._record(Event(self._rv, "DELETED", rtype, gone_obj))
        uid = old["metadata"].get("uid")
        for dep_type in RESOURCE_TYPES:
            for dep_key, dep in list(self._objects[dep_type.plural].items()):
                if any(ref.get("uid") == uid for ref in dep["metadata"].get("ownerReferences") or []):
                    self._remove(dep_type, dep_key)
        return gone_obj

    def _record(self, event: Event) -> None:
        if len(self._events) >= self.history:
            self._evicted_rv = self._events.popleft().rv
        self._events.append(event)
        self._cond.notify_all()

    def _events_after(self, rv: int) -> list[Event]:
        out = []
        for event in reversed(self._events):
            if event.rv <= rv:
                break
            out.append(event)
        out.reverse()
        return out


def _initial_events_end(rtype: ResourceType, resource_version: str) -> dict[str, Any]:
    """The bookmark that ends a watch-list's initial events: an object of the watched kind with
    only the resourceVersion they were read at and the annotation."""
    return {
        "kind": rtype.kind,
        "apiVersion": rtype.api_version,
        "metadata": {"resourceVersion": resource_version, "annotations": {"k8s.io/initial-events-end": "true"}},
    }


class Watcher:
    """One open watch: hands out the events after its position, filtered and typed for its selectors."""

    def __init__(
        self,
        store: Store,
        rtype: ResourceType,
        namespace: str | None,
        match: Predicate,
        since: int,
        initial: list[tuple[str, dict[str, Any]]],
        epoch: int,
    ):
        self._store = store
        self._rtype = rtype
        self._namespace = namespace
        self._match = match
        self._last = since
        self._pending = list(initial)
        self._epoch = epoch
        self._open = True
        store._open_watches += 1  # the caller holds the store's lock

    def close(self) -> None:
        with self._store._cond:
            if self._open:
                self._open = False
                self._store._open_watches -= 1

    def next_events(self, timeout: float) -> list[tuple[str, dict[str, Any]]] | None:
        """Events that arrive within `timeout` ([] if none); None once the watch was closed.

        Raises ApiError 410 if the watcher fell so far behind that its next events left the history.
        """
        if self._pending:
            pending, self._pending = self._pending, []
            return pending
        store = self._store
        deadline = time.monotonic() + timeout
        with store._cond:
            while True:
                if store._closed or store._epoch != self._epoch:
                    return None
                if self._last < store._evicted_rv:
                    raise gone(self._last, store._evicted_rv + 1)
                events = store._events_after(self._last)
                if events:
                    self._last = events[-1].rv
                    out = [e for e in (self._typed(ev) for ev in events) if e is not None]
                    if out:
                        return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                store._cond.wait(remaining)

    def _matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        if self._namespace is not None and obj["metadata"].get("namespace") != self._namespace:
            return False
        return self._match(obj)

    def _typed(self, event: Event) -> tuple[str, dict[str, Any]] | None:
        if event.rtype is not self._rtype:
            return None
        now, before = self._matches(event.obj), self._matches(event.old)
        if event.type == "MODIFIED":
            if now and not before:
                return ("ADDED", event.obj)
            if before and not now:
                return ("DELETED", event.obj)
        return (event.type, event.obj) if now else None


def gone(requested: int, oldest: int) -> ApiError:
    return ApiError(410, f"too old resource version: {requested} ({oldest})", "Expired")


def too_large(requested: int, current: int) -> ApiError:
    """kube-apiserver's answer to a watch from a resourceVersion it has not reached."""
    message = f"Too large resource version: {requested}, current: {current}"
    return ApiError(
        504,
        message,
        "Timeout",
        {"causes": [{"reason": "ResourceVersionTooLarge", "message": message}], "retryAfterSeconds": 1},
    )


# --- per-resource strategies ----------------------------------------------------------------------


def _has_list_attribute(device: dict[str, Any]) -> bool:
    return any(
        isinstance(a, dict) and any(a.get(f) is not None for f in apivalidate.LIST_VALUE_FIELDS)
        for a in (device.get("attributes") or {}).values()
    )


def _prepare_claim(obj: dict[str, Any], old: dict[str, Any] | None, problems: list[str]) -> dict[str, Any]:
    """Request defaults on create; quantities canonical; on deallocation, drop the device status
    entries of freed devices."""
    for part in ("spec", "status"):
        if isinstance(obj.get(part), dict):
            obj[part] = apivalidate.rewrite_quantities(obj[part], part, problems, apivalidate.claim_quantity_path)
    if old is None:
        for request in ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []:
            for sub in [request.get("exactly"), *(request.get("firstAvailable") or [])]:
                if isinstance(sub, dict):
                    sub.setdefault("allocationMode", "ExactCount")
                    if sub["allocationMode"] == "ExactCount":
                        sub.setdefault("count", 1)
                    for toleration in sub.get("tolerations") or []:
                        toleration.setdefault("operator", "Equal")
        return obj
    status = obj.get("status")
    if (
        isinstance(status, dict)
        and status.get("devices")
        and status.get("allocation") != (old.get("status") or {}).get("allocation")
    ):
        allocated = {
            apivalidate.device_status_key(r)
            for r in (((status.get("allocation") or {}).get("devices") or {}).get("results") or [])
        }
        status["devices"] = [d for d in status["devices"] if apivalidate.device_status_key(d) in allocated]
        if not status["devices"]:
            status.pop("devices")
    return obj


def _immutable_problems(rtype: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
    if old is None:
        return []
    problems = []
    if rtype.plural == "resourceslices":
        for path in _IMMUTABLE_SLICE_FIELDS:
            before, after = _dig(old.get("spec"), path), _dig(obj.get("spec"), path)
            if before != after:
                problems.append(f"spec.{'.'.join(path)}: Invalid value: {after!r}: field is immutable")
    if rtype.plural == "resourceclaims":
        if obj.get("spec") != old.get("spec"):
            problems.append("spec: Invalid value: field is immutable")
        before = (old.get("status") or {}).get("allocation")
        after = (obj.get("status") or {}).get("allocation")
        if before is not None and after is not None and before != after:
            problems.append("status.allocation: Invalid value: field is immutable once set (it may only be removed)")
    return problems


def _dig(node: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge_patch(target.get(key), value)
    return target
