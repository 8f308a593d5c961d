"""A sample CRD conversion webhook, served by the sample backend server under ``/convert``.

It converts the sample CRD ``crontabs.stable.example.com`` (``gateway/data/demo/crd.yaml``) between
``v1`` (``spec.cronSpec``) and ``v2`` (``spec.schedule.cron``); objects of any other kind only get
the desired apiVersion. Like the admission sample backends, the path picks the behaviour, so tests
can point a CRD at a misbehaving backend::

    /convert                            correct conversion (replies in the review's own version)
    /convert/sleep/<ms>/...             wait first (composes with any terminal below)
    /convert/only-v1beta1/...           HTTP 400 unless the review is apiextensions.k8s.io/v1beta1
    /convert/wrong-count                one object fewer than sent (or one more when none would remain)
    /convert/wrong-api-version          objects keep their input apiVersion
    /convert/wrong-kind                 objects get kind ``Other``
    /convert/change-name | change-namespace | change-uid
    /convert/bad-labels                 adds the label value ``not a valid value!``
    /convert/missing-metadata           objects without metadata
    /convert/metadata-not-object        ``metadata`` is a string
    /convert/labels-not-map             ``metadata.labels`` is a list
    /convert/non-string-label           adds the label ``converted: 5`` (a number)
    /convert/non-string-annotation      adds the annotation ``converted: true`` (a boolean)
    /convert/not-object                 converted objects are strings
    /convert/no-response                a ConversionReview without ``response``
    /convert/wrong-uid                  ``response.uid`` differs from the request's
    /convert/wrong-review-version       replies as the other ConversionReview version
    /convert/fail[/<message>]           ``result: {status: Failure, message}``
    /convert/failure-no-message         ``result: {status: Failure}``
    /convert/status/<code>              plain-text HTTP error
    /convert/empty-body                 HTTP 200 with no body
"""

from __future__ import annotations

import copy
from typing import Any, Final
from urllib.parse import unquote

import msgspec
import trio

from gateway.devtools.backends import Reply

GROUP: Final = "apiextensions.k8s.io"
SAMPLE_GROUP: Final = "stable.example.com"
_TERMINALS: Final = frozenset(
    {
        "",
        "wrong-count",
        "wrong-api-version",
        "wrong-kind",
        "change-name",
        "change-namespace",
        "change-uid",
        "bad-labels",
        "missing-metadata",
        "metadata-not-object",
        "labels-not-map",
        "non-string-label",
        "non-string-annotation",
        "not-object",
        "no-response",
        "wrong-uid",
        "wrong-review-version",
        "fail",
        "failure-no-message",
        "status",
        "empty-body",
    }
)


def _text(status: int, message: str) -> Reply:
    return Reply(status, message.encode() + b"\n", b"text/plain; charset=utf-8")


def convert_object(obj: dict[str, Any], desired: str) -> dict[str, Any]:
    """The sample conversion: CronTab v1 ``spec.cronSpec`` <-> v2 ``spec.schedule.cron``."""
    out = copy.deepcopy(obj)
    source = str(obj.get("apiVersion", ""))
    out["apiVersion"] = desired
    spec = out.get("spec")
    if obj.get("kind") != "CronTab" or not isinstance(spec, dict) or source == desired:
        return out
    if desired == f"{SAMPLE_GROUP}/v2" and "cronSpec" in spec:
        spec["schedule"] = {"cron": spec.pop("cronSpec")}
    elif desired == f"{SAMPLE_GROUP}/v1" and isinstance(spec.get("schedule"), dict):
        spec["cronSpec"] = spec.pop("schedule").get("cron", "")
    return out


def _broken(terminal: str, obj: dict[str, Any], original: dict[str, Any]) -> Any:
    meta = obj.setdefault("metadata", {})
    if terminal == "wrong-api-version":
        obj["apiVersion"] = original.get("apiVersion")
    elif terminal == "wrong-kind":
        obj["kind"] = "Other"
    elif terminal in ("change-name", "change-namespace", "change-uid"):
        field = terminal.removeprefix("change-")
        meta[field] = f"{meta.get(field, '')}-changed"
    elif terminal == "bad-labels":
        meta.setdefault("labels", {})["converted"] = "not a valid value!"
    elif terminal == "missing-metadata":
        del obj["metadata"]
    elif terminal == "metadata-not-object":
        obj["metadata"] = "converted"
    elif terminal == "labels-not-map":
        meta["labels"] = ["converted"]
    elif terminal == "non-string-label":
        meta.setdefault("labels", {})["converted"] = 5
    elif terminal == "non-string-annotation":
        meta.setdefault("annotations", {})["converted"] = True
    elif terminal == "not-object":
        return "converted"
    return obj


async def respond(path: str, body: bytes) -> Reply:
    """The reply of the sample conversion webhook for ``path`` (below ``/convert``)."""
    steps = [unquote(s) for s in path.split("?", 1)[0].removeprefix("/convert").split("/") if s]
    only_v1beta1 = False
    while steps and steps[0] in ("sleep", "only-v1beta1"):
        if steps[0] == "sleep" and len(steps) > 1:
            await trio.sleep(min(float(steps[1]), 120_000.0) / 1000.0)
            steps = steps[2:]
        elif steps[0] == "only-v1beta1":
            only_v1beta1 = True
            steps = steps[1:]
        else:
            return _text(404, f"unknown conversion behaviour {path!r}")
    terminal, args = (steps[0], steps[1:]) if steps else ("", [])
    if terminal not in _TERMINALS:
        return _text(404, f"unknown conversion behaviour {path!r}")
    if terminal == "status":
        return _text(int(args[0]) if args else 500, "conversion backend error")
    if terminal == "empty-body":
        return Reply(200, b"")
    try:
        review = msgspec.json.decode(body)
        request = review["request"]
        version, uid = str(review["apiVersion"]), str(request["uid"])
        desired, objects = str(request["desiredAPIVersion"]), list(request["objects"])
    except (msgspec.DecodeError, KeyError, TypeError) as exc:
        return _text(400, f"cannot decode ConversionReview: {exc}")
    if only_v1beta1 and version != f"{GROUP}/v1beta1":
        return _text(400, f"this backend only accepts {GROUP}/v1beta1, got {version!r}")
    if terminal == "wrong-review-version":
        version = f"{GROUP}/v1beta1" if version == f"{GROUP}/v1" else f"{GROUP}/v1"
    reply: dict[str, Any] = {"apiVersion": version, "kind": "ConversionReview"}
    if terminal == "no-response":
        return Reply(200, msgspec.json.encode(reply))
    converted = [_broken(terminal, convert_object(o, desired), o) for o in objects]
    if terminal == "wrong-count":
        converted = converted[:-1] if len(converted) > 1 else [*converted, *converted, {}][:2]
    result: dict[str, Any] = {"status": "Success"}
    if terminal == "fail":
        result = {"status": "Failure", "message": "/".join(args) or "conversion refused by test backend"}
    elif terminal == "failure-no-message":
        result = {"status": "Failure"}
    response = {
        "uid": uid + "-wrong" if terminal == "wrong-uid" else uid,
        "result": result,
        "convertedObjects": converted if result["status"] == "Success" else [],
    }
    reply["response"] = response
    return Reply(200, msgspec.json.encode(reply))
