"""deploy/examples/crd-conversion: the gateway's copy loads, and the re-pointed CRD is valid and aims
at the gateway's conversion route for that CRD (CNV-01/02)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config.load import load_documents
from gateway.server.app import ServerSettings

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "examples" / "crd-conversion"


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(into)
    for key, value in patch.items():
        out[key] = (
            _merge(out.get(key, {}), value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


def gateway_copy() -> dict[str, Any]:
    data = yaml.safe_load((EXAMPLE / "gateway-config.yaml").read_text())["data"]
    (text,) = data.values()
    doc: dict[str, Any] = yaml.safe_load(text)
    return doc


def test_the_gateways_copy_loads_as_a_conversion_entry():
    snapshot = load_documents([("crontabs-crd.yaml", gateway_copy())])
    assert snapshot.warnings == ()
    entry = snapshot.conversions["crontabs.stable.example.com"]
    assert entry.client_config.service is not None
    assert entry.client_config.service.name == "crontab-conversion"
    assert entry.timeout_seconds == 10


@pytest.mark.parametrize("version", ["1.29", "1.37"])
def test_the_re_pointed_crd_is_valid_and_calls_the_gateway(version):
    live = _merge(gateway_copy(), yaml.safe_load((EXAMPLE / "crd-patch.yaml").read_text()))
    kubernetes_validate.validate(live, version, strict=True)
    service = live["spec"]["conversion"]["webhook"]["clientConfig"]["service"]
    assert (service["namespace"], service["name"], service["port"]) == (
        "webhook-gateway",
        "webhook-gateway",
        443,
    )
    assert service["path"] == ServerSettings().convert_prefix + live["metadata"]["name"]
