"""CRDs as conversion backend entries: loading, defaulting, validation, uniqueness, reload (CNV-02/03)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
import trio
import trustme
import yaml

from gateway.config.load import load_directory
from gateway.config.model import ClientConfig, ServiceReference
from gateway.errors import ConfigError
from tests.configs.builders import errors_of, load, problems_of
from tests.support.conversion import (
    CRD,
    CRD_V1,
    CRD_V1BETA1,
    conversion_review,
    crd,
    crontab,
    start_conversion,
    write_crds,
)

KUBECTL_GET = """\
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  annotations:
    controller-gen.kubebuilder.io/version: v0.14.0
    kubectl.kubernetes.io/last-applied-configuration: |
      {"apiVersion":"apiextensions.k8s.io/v1","kind":"CustomResourceDefinition"}
  creationTimestamp: "2026-01-02T03:04:05Z"
  generation: 3
  managedFields:
  - apiVersion: apiextensions.k8s.io/v1
    fieldsType: FieldsV1
    fieldsV1:
      f:spec:
        f:conversion: {}
    manager: kubectl-client-side-apply
    operation: Update
    time: "2026-01-02T03:04:05Z"
  name: crontabs.stable.example.com
  resourceVersion: "4711"
  uid: 0b6e1f0c-44a2-4a4e-9a4b-2f2e6f1a9c11
spec:
  conversion:
    strategy: Webhook
    webhook:
      clientConfig:
        service:
          name: crontab-conversion
          namespace: crontab
          path: /convert
          port: 8443
      conversionReviewVersions:
      - v1
  group: stable.example.com
  names:
    categories: [all]
    kind: CronTab
    listKind: CronTabList
    plural: crontabs
    shortNames: [ct]
    singular: crontab
  scope: Namespaced
  versions:
  - additionalPrinterColumns:
    - jsonPath: .spec.cronSpec
      name: Spec
      type: string
    name: v1
    schema:
      openAPIV3Schema:
        properties:
          spec:
            properties:
              cronSpec: {type: string}
            type: object
        type: object
    served: true
    storage: false
  - deprecated: true
    deprecationWarning: use v2
    name: v2
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
    selectableFields:
    - jsonPath: .spec.image
    served: true
    storage: true
    subresources:
      status: {}
status:
  acceptedNames:
    kind: CronTab
    listKind: CronTabList
    plural: crontabs
    shortNames: [ct]
    singular: crontab
  conditions:
  - lastTransitionTime: "2026-01-02T03:04:05Z"
    message: no conflicts found
    reason: NoConflicts
    status: "True"
    type: NamesAccepted
  storedVersions: [v2]
"""


def with_conversion(doc: dict[str, Any], conversion: dict[str, Any] | None) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    if conversion is None:
        out["spec"].pop("conversion", None)
    else:
        out["spec"]["conversion"] = conversion
    return out


URL = "https://conv.example.com/convert"


def test_kubectl_get_output_loads_unchanged():
    """CNV-02: status, managedFields and schemas are accepted silently; only conversion and names are used."""
    snapshot = load(yaml.safe_load(KUBECTL_GET))
    assert snapshot.warnings == ()
    entry = snapshot.conversions[CRD]
    assert entry.client_config == ClientConfig(
        service=ServiceReference(namespace="crontab", name="crontab-conversion", path="/convert", port=8443)
    )
    assert entry.conversion_review_versions == ("v1",)
    assert entry.versions == ("v1", "v2")
    assert entry.timeout_seconds == 30
    assert entry.cache is False


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        pytest.param(
            crd(url=URL),
            {"url": URL, "versions": ("v1", "v1beta1")},
            id="CNV-02 v1 webhook clientConfig and conversionReviewVersions",
        ),
        pytest.param(
            crd(url=URL, api_version=CRD_V1BETA1, review_versions=[]),
            {"url": URL, "versions": ("v1beta1",)},
            id="CNV-02 v1beta1 conversionReviewVersions default to [v1beta1]",
        ),
        pytest.param(
            with_conversion(
                crd(api_version=CRD_V1BETA1), {"strategy": "Webhook", "webhookClientConfig": {"url": URL}}
            ),
            {"url": URL, "versions": ("v1beta1",)},
            id="CNV-02 v1beta1 absent conversionReviewVersions default too",
        ),
        pytest.param(
            crd(service={"namespace": "ns", "name": "conv"}),
            {
                "service": ServiceReference(namespace="ns", name="conv", port=443),
                "versions": ("v1", "v1beta1"),
            },
            id="CNV-03 a service port defaults to 443",
        ),
        pytest.param(crd(strategy="None"), None, id="CNV-02 strategy None adds no entry"),
        pytest.param(with_conversion(crd(), None), None, id="CNV-02 no conversion means strategy None"),
        pytest.param(
            with_conversion(crd(api_version=CRD_V1BETA1), {}),
            None,
            id="CNV-02 an empty v1beta1 conversion means strategy None",
        ),
    ],
)
def test_entries_and_defaults(doc, expected):
    snapshot = load(doc)
    if expected is None:
        assert dict(snapshot.conversions) == {}
        return
    entry = snapshot.conversions[CRD]
    assert entry.conversion_review_versions == expected["versions"]
    if "url" in expected:
        assert entry.client_config.url == expected["url"]
    else:
        assert entry.client_config.service == expected["service"]


BAD_PEM = base64.b64encode(
    b"-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n"
).decode()


@pytest.mark.parametrize(
    ("doc", "errors"),
    [
        pytest.param(
            with_conversion(crd(), {"strategy": "Webhook"}),
            [
                "spec.conversion.webhook.clientConfig: Required value: required when strategy is set to Webhook",
                "spec.conversion.webhook.conversionReviewVersions: Required value: must specify one of v1, v1beta1",
            ],
            id="CNV-03 v1 Webhook requires clientConfig and conversionReviewVersions",
        ),
        pytest.param(
            with_conversion(crd(api_version=CRD_V1BETA1), {"strategy": "Webhook"}),
            ["spec.conversion.webhookClientConfig: Required value: required when strategy is set to Webhook"],
            id="CNV-03 v1beta1 Webhook requires webhookClientConfig",
        ),
        pytest.param(
            with_conversion(crd(), {"strategy": "webhook"}),
            ['spec.conversion.strategy: Unsupported value: "webhook": supported values: "None", "Webhook"'],
            id="CNV-03 the strategy is None or Webhook, case-sensitive",
        ),
        pytest.param(
            with_conversion(
                crd(),
                {
                    "strategy": "None",
                    "webhook": {"clientConfig": {"url": URL}, "conversionReviewVersions": ["v1"]},
                },
            ),
            [
                "spec.conversion.webhook.clientConfig: Forbidden: should not be set when strategy is not set to Webhook",
                "spec.conversion.webhook.conversionReviewVersions: Forbidden: should not be set when strategy is not set to Webhook",
            ],
            id="CNV-03 strategy None forbids the webhook fields (v1)",
        ),
        pytest.param(
            with_conversion(crd(api_version=CRD_V1BETA1), {"webhookClientConfig": {"url": URL}}),
            [
                "spec.conversion.webhookClientConfig: Forbidden: should not be set when strategy is not set to Webhook"
            ],
            id="CNV-03 defaulted strategy None forbids webhookClientConfig (v1beta1)",
        ),
        pytest.param(
            with_conversion(
                crd(),
                {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {"url": URL, "service": {"namespace": "ns", "name": "conv"}},
                        "conversionReviewVersions": ["v1"],
                    },
                },
            ),
            [
                "spec.conversion.webhook.clientConfig: Required value: exactly one of url or service is required"
            ],
            id="CNV-03 exactly one of url and service (CFG-13)",
        ),
        pytest.param(
            crd(url="ftp://conv.example.com/x"),
            [
                "spec.conversion.webhook.clientConfig.url: Invalid value: \"ftp\": 'https' is the only allowed URL scheme; desired format: https://host[/path]"
            ],
            id="CNV-03 url rules as CFG-14",
        ),
        pytest.param(
            crd(url="https://conv.example.com/x?a=b"),
            [
                'spec.conversion.webhook.clientConfig.url: Invalid value: "a=b": query parameters are not permitted in the URL'
            ],
            id="CNV-03 no query in the url (CFG-14)",
        ),
        pytest.param(
            crd(url="http://conv.example.com/x"),
            [
                "spec.conversion.webhook.clientConfig.url: Invalid value: \"http\": 'https' is the only allowed URL scheme; desired format: https://host[/path]"
            ],
            id="CNV-03 http only to loopback (CFG-15)",
        ),
        pytest.param(
            crd(service={"namespace": "ns", "name": "conv", "path": "/a//b", "port": 0}),
            [
                "spec.conversion.webhook.clientConfig.service.port: Invalid value: 0: port is not valid: must be between 1 and 65535, inclusive",
                'spec.conversion.webhook.clientConfig.service.path: Invalid value: "/a//b": segment[1] may not be empty',
            ],
            id="CNV-03 service rules as CFG-16",
        ),
        pytest.param(
            crd(url=URL, review_versions=["v2"]),
            [
                'spec.conversion.webhook.conversionReviewVersions: Invalid value: []string{"v2"}: must include at least one of v1, v1beta1'
            ],
            id="CNV-03 conversionReviewVersions need v1 or v1beta1 (CFG-12)",
        ),
        pytest.param(
            crd(url=URL, review_versions=["v1", "v1"]),
            ['spec.conversion.webhook.conversionReviewVersions[1]: Invalid value: "v1": duplicate version'],
            id="CNV-03 conversionReviewVersions are unique (CFG-12)",
        ),
        pytest.param(
            crd(url=URL, api_version=CRD_V1BETA1, review_versions=["V1"]),
            [
                'spec.conversion.conversionReviewVersions[0]: Invalid value: "V1": a DNS-1035 label must consist of lower case',
                'spec.conversion.conversionReviewVersions: Invalid value: []string{"V1"}: must include at least one of v1, v1beta1',
            ],
            id="CNV-03 conversionReviewVersions are DNS-1035 labels (v1beta1 paths)",
        ),
        pytest.param(
            with_conversion(
                crd(),
                {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {"url": URL, "caBundle": BAD_PEM},
                        "conversionReviewVersions": ["v1"],
                    },
                },
            ),
            ["spec.conversion.webhook.clientConfig.caBundle: no parseable PEM certificate"],
            id="CNV-03 a non-empty caBundle must hold a parseable PEM certificate",
        ),
        pytest.param(
            with_conversion(
                crd(),
                {
                    "strategy": "Webhook",
                    "webhook": {
                        "clientConfig": {"url": URL, "caBundle": "%%%"},
                        "conversionReviewVersions": ["v1"],
                    },
                },
            ),
            ["spec.conversion.webhook.clientConfig.caBundle: Invalid value: must be base64-encoded"],
            id="CNV-03 a caBundle must be base64",
        ),
        pytest.param(
            {**crd(url=URL), "metadata": {"name": "Crontabs"}},
            ['metadata.name: Invalid value: "Crontabs": a lowercase RFC 1123 subdomain'],
            id="CNV-03 the CRD name is a DNS-1123 subdomain",
        ),
        pytest.param(
            crd(url=URL, annotations={"webhook-gateway.io/conversion-timeout-seconds": "0"}),
            [
                'metadata.annotations[webhook-gateway.io/conversion-timeout-seconds]: Invalid value: "0": must be a whole number of seconds from 1 to 60'
            ],
            id="CNV-14 the timeout annotation is 1..60 seconds",
        ),
        pytest.param(
            crd(url=URL, annotations={"webhook-gateway.io/conversion-timeout-seconds": "2.5"}),
            [
                'metadata.annotations[webhook-gateway.io/conversion-timeout-seconds]: Invalid value: "2.5": must be a whole number of seconds from 1 to 60'
            ],
            id="CNV-14 the timeout annotation is whole seconds",
        ),
        pytest.param(
            crd(url=URL, annotations={"webhook-gateway.io/conversion-cache": "yes"}),
            [
                'metadata.annotations[webhook-gateway.io/conversion-cache]: Unsupported value: "yes": supported values: "false", "true"'
            ],
            id="the cache annotation is true or false",
        ),
        pytest.param(
            {**crd(url=URL), "spec": {"conversion": "Webhook"}},
            ['spec.conversion: Invalid value: "Webhook": must be an object, not a string'],
            id="CNV-03 wrong types are field errors",
        ),
    ],
)
def test_validation_errors(doc, errors):
    got = errors_of(doc)
    assert len(got) == len(errors), got
    for want, have in zip(errors, got, strict=True):
        assert have.startswith(want), (have, want)


def test_problems_name_file_kind_and_object():
    """CFG-23 for CRDs: one line naming file, object and field."""
    (problem,) = problems_of(
        with_conversion(crd(), {"strategy": "Webhook", "webhook": {"conversionReviewVersions": ["v1"]}})
    )
    assert str(problem) == (
        f't.yaml: CustomResourceDefinition "{CRD}" spec.conversion.webhook.clientConfig: '
        "Required value: required when strategy is set to Webhook"
    )


@pytest.mark.parametrize(
    ("doc", "warned"),
    [
        pytest.param(
            crd(
                service={"namespace": "webhook-gateway", "name": "webhook-gateway", "path": f"/convert/{CRD}"}
            ),
            True,
            id="a CRD pointing at the gateway's own route for it is a warning (it would call itself)",
        ),
        pytest.param(crd(url=f"https://gw.example.com/convert/{CRD}/"), True, id="the same through a url"),
        pytest.param(
            crd(url="https://conv.example.com/convert"), False, id="the original conversion webhook is fine"
        ),
    ],
)
def test_a_crd_pointing_at_the_gateway_itself_is_warned_about(doc, warned):
    warnings = [str(w) for w in load(doc).warnings]
    assert any("the gateway's own conversion route" in w for w in warnings) is warned, warnings


def test_whitespace_ca_bundle_counts_as_empty():
    """CNV-15: a whitespace-only caBundle means the system roots, not a broken bundle."""
    doc = with_conversion(
        crd(),
        {
            "strategy": "Webhook",
            "webhook": {
                "clientConfig": {"url": URL, "caBundle": base64.b64encode(b"  \n").decode()},
                "conversionReviewVersions": ["v1"],
            },
        },
    )
    assert load(doc).conversions[CRD].client_config.ca_bundle == b""


def test_a_valid_ca_bundle_is_kept_as_pem():
    pem = trustme.CA().cert_pem.bytes()
    assert load(crd(url=URL, ca_bundle=pem)).conversions[CRD].client_config.ca_bundle == pem


def test_duplicate_crd_names_across_files_name_both(tmp_path):
    """Two files defining the same CRD are one error naming both places."""
    write_crds(tmp_path, [crd(url=URL)], "a.yaml")
    write_crds(tmp_path, [crd(url=URL)], "b.yaml")
    with pytest.raises(ConfigError) as caught:
        load_directory(tmp_path)
    (error,) = caught.value.errors
    assert error.file.endswith("b.yaml")
    assert f'Duplicate value: "{CRD}"' in error.message
    assert "a.yaml" in error.message


@pytest.mark.parametrize(
    "wrapper",
    [
        pytest.param(
            lambda items: {"apiVersion": "v1", "kind": "List", "items": items},
            id="a List of CRDs (kubectl get crd -o yaml)",
        ),
        pytest.param(
            lambda items: {
                "apiVersion": CRD_V1,
                "kind": "CustomResourceDefinitionList",
                "items": [{k: v for k, v in i.items() if k not in ("apiVersion", "kind")} for i in items],
            },
            id="a typed CustomResourceDefinitionList",
        ),
    ],
)
def test_lists_of_crds(wrapper):
    snapshot = load(wrapper([crd(url=URL), crd("olds.example.com", url=URL)]))
    assert sorted(snapshot.conversions) == [CRD, "olds.example.com"]


def test_crds_and_webhook_configurations_share_a_directory(tmp_path):
    from tests.support.gateway import write_config

    write_config(
        tmp_path,
        validating={
            "a": [
                {
                    "name": "a.b.c",
                    "clientConfig": {"url": URL},
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                }
            ]
        },
    )
    write_crds(tmp_path, [crd(url=URL)])
    snapshot = load_directory(tmp_path)
    assert len(snapshot.validating) == 1
    assert list(snapshot.conversions) == [CRD]


async def test_reload_is_atomic_for_crds(nursery, tmp_path):
    """CFG-25 for CRDs: a changed CRD is used by later conversions; a broken file keeps the last good set."""
    setup = await start_conversion(nursery, tmp_path, gateway_args=("--config-poll-seconds", "0.05"))
    base = setup.backend.url("").rstrip("/")

    async def result() -> dict[str, Any]:
        resp = await setup.send(conversion_review([crontab()]))
        return dict(resp.json["response"]["result"])

    assert (await result())["status"] == "Success"

    def replace(doc: dict[str, Any]) -> None:  # atomically, so no poll sees a half-written file
        write_crds(tmp_path, [doc], ".next.yaml").rename(tmp_path / "crds.yaml")

    replace(crd(url=f"{base}/convert/fail/changed"))
    with trio.fail_after(5):
        while (await result()).get("message", "").endswith("changed") is False:
            await trio.sleep(0.05)
    broken = crd(url=f"{base}/convert", review_versions=["v9"])
    replace(broken)
    await trio.sleep(0.5)
    assert (await result())["message"].endswith("failed: changed")  # still the last good entry
    generation = setup.running.app.snapshot().generation  # type: ignore[union-attr]
    assert generation == 2
    assert 'webhook_gateway_config_reloads_total{result="failure"} 1.0' in setup.metrics()


@pytest.mark.parametrize(
    ("docs", "code", "expected"),
    [
        pytest.param(
            [
                crd(
                    url="http://127.0.0.1:9/convert",
                    annotations={"webhook-gateway.io/conversion-cache": "true"},
                )
            ],
            0,
            f"  conversion {CRD} -> http://127.0.0.1:9/convert (review versions v1, v1beta1; timeout 30s, cache on)",
            id="check lists the conversion entries",
        ),
        pytest.param(
            [crd(url="http://conv.example.com/convert")],
            1,
            f'crds.yaml: CustomResourceDefinition "{CRD}" spec.conversion.webhook.clientConfig.url: Invalid value',
            id="check refuses a bad CRD with one line naming file, object and field",
        ),
    ],
)
def test_check_command(tmp_path, capsys, docs, code, expected):
    from gateway.__main__ import main

    write_crds(tmp_path, docs)
    assert main(["check", "--config", str(tmp_path)]) == code
    captured = capsys.readouterr()
    assert expected in captured.out + captured.err
