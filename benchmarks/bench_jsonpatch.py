"""Benchmark: apply a 3-operation JSON Patch to an ~8 KB Pod (decoded), as the mutating chain does.

Run: ``/work/venv/bin/python benchmarks/bench_jsonpatch.py``. Prints microseconds per call for
``apply_patch`` (copy-on-write), for ``copy.deepcopy`` of the same Pod (the cost copy-on-write avoids),
for ``json_equal`` of the result against the input and of two equal copies (MUT-12), and for
``diff_patch`` (MUT-24).
"""

from __future__ import annotations

import copy
import json
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.dispatch.jsonpatch import apply_patch, decode_patch, diff_patch, json_equal


def make_pod() -> dict[str, Any]:
    """A realistic Pod of about 8 KB of JSON: labels, annotations, three containers, volumes."""

    def container(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "image": f"registry.example.com/shop/{name}:1.4.2",
            "args": ["--port=8080", "--log-level=info", f"--name={name}"],
            "env": [{"name": f"VAR_{i}", "value": f"value-{i}-{name}"} for i in range(26)],
            "ports": [{"containerPort": 8080, "name": "http", "protocol": "TCP"}],
            "resources": {
                "limits": {"cpu": "500m", "memory": "256Mi"},
                "requests": {"cpu": "100m", "memory": "64Mi"},
            },
            "volumeMounts": [{"mountPath": f"/data/{i}", "name": f"vol-{i}"} for i in range(3)],
            "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 10},
            "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8080}, "periodSeconds": 5},
            "securityContext": {"runAsNonRoot": True, "readOnlyRootFilesystem": True},
            "terminationMessagePath": "/dev/termination-log",
            "imagePullPolicy": "IfNotPresent",
        }

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "web-1",
            "namespace": "shop",
            "uid": "9d1c4c5e-3a0f-4d39-8f39-5f1d0b6a8e21",
            "labels": {f"label-{i}": f"value-{i}" for i in range(10)},
            "annotations": {f"example.com/annotation-{i}": "x" * 60 for i in range(16)},
            "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f", "uid": "1"}
            ],
        },
        "spec": {
            "containers": [container(n) for n in ("web", "sidecar", "metrics")],
            "volumes": [{"name": f"vol-{i}", "emptyDir": {}} for i in range(3)],
            "serviceAccountName": "web",
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}
            ],
        },
        "status": {},
    }


PATCH = b"""[
 {"op":"add","path":"/metadata/labels/team","value":"payments"},
 {"op":"replace","path":"/spec/containers/0/image","value":"registry.example.com/shop/web:1.4.3"},
 {"op":"add","path":"/spec/containers/-1/env/-","value":{"name":"INJECTED","value":"1"}}
]"""


def per_call_us(func: Any, number: int) -> float:
    """Best of 5 repeats, in microseconds per call."""
    return min(timeit.repeat(func, number=number, repeat=5)) / number * 1e6


def main() -> None:
    pod = make_pod()
    ops = decode_patch(PATCH)
    patched = apply_patch(pod, ops)
    print(
        f"Pod size: {len(json.dumps(pod, separators=(',', ':')))} bytes of JSON; patch: {len(ops)} operations"
    )
    print(f"apply_patch (copy-on-write):   {per_call_us(lambda: apply_patch(pod, ops), 20000):8.1f} µs")
    print(f"copy.deepcopy of the Pod:      {per_call_us(lambda: copy.deepcopy(pod), 500):8.1f} µs")
    print(f"json_equal(result, input):     {per_call_us(lambda: json_equal(patched, pod), 20000):8.1f} µs")
    twin = copy.deepcopy(pod)
    print(f"json_equal(Pod, deep copy):    {per_call_us(lambda: json_equal(pod, twin), 2000):8.1f} µs")
    print(f"diff_patch(input, result):     {per_call_us(lambda: diff_patch(pod, patched), 2000):8.1f} µs")


if __name__ == "__main__":
    main()
