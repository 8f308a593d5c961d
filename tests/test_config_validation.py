"""Validation of configuration objects (CFG-06..22): every rule refuses a bad config with upstream's text."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.fielderrors import go_quote
from tests.configs.builders import V1, V1BETA1, VALIDATING, config, errors_of, hook, load, rule

DNS1123_SUBDOMAIN = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
    "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
DNS1035_LABEL = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_VALUE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
    "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
LABEL_NAME = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
URL_FORM = "; desired format: https://host[/path]"


def with_hook(**overrides: Any) -> dict[str, Any]:
    """A v1 mutating configuration whose only webhook has ``overrides``."""
    return config(hook(**overrides))


def with_rule(**overrides: Any) -> dict[str, Any]:
    """A configuration whose only rule has ``overrides``."""
    return with_hook(rules=[rule(**overrides)])


def with_url(url: str) -> dict[str, Any]:
    return with_hook(clientConfig={"url": url})


def with_service(**service: Any) -> dict[str, Any]:
    return with_hook(clientConfig={"service": {"namespace": "ns", "name": "svc"} | service})


def test_a_valid_configuration_has_no_errors() -> None:
    """The builders' baseline configuration loads, so every row below fails only for its own reason."""
    snapshot = load(with_hook())
    assert [h.name for h in snapshot.mutating] == ["a.b.c"]


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        pytest.param(
            {"apiVersion": V1, "kind": VALIDATING, "metadata": {}},
            ["metadata.name: Required value: name or generateName is required"],
            id="CFG-06: a configuration without metadata.name is refused",
        ),
        pytest.param(
            {"apiVersion": V1, "kind": VALIDATING},
            ["metadata.name: Required value: name or generateName is required"],
            id="CFG-06: a configuration without metadata is refused",
        ),
        pytest.param(
            config(name="Team_A"),
            [f'metadata.name: Invalid value: "Team_A": {DNS1123_SUBDOMAIN}'],
            id="CFG-06: metadata.name must be a DNS-1123 subdomain",
        ),
        pytest.param(
            config(name="a" * 254),
            [f'metadata.name: Invalid value: "{"a" * 254}": must be no more than 253 characters'],
            id="CFG-06: metadata.name has at most 253 characters",
        ),
        pytest.param(
            config(name="a.-b"),
            [f'metadata.name: Invalid value: "a.-b": {DNS1123_SUBDOMAIN}'],
            id="CFG-06: each dot-separated part of metadata.name starts alphanumeric",
        ),
        pytest.param(
            {"apiVersion": V1, "kind": VALIDATING, "metadata": {"name": "x", "labels": {"a": 1}}},
            ["metadata.labels[a]: Invalid value: 1: must be a string, not an integer"],
            id="CFG-06: metadata.labels must be a map of strings",
        ),
        pytest.param(
            {"apiVersion": V1, "kind": VALIDATING, "metadata": {"name": "x", "annotations": ["a"]}},
            ["metadata.annotations: Invalid value: must be a map of strings, not a list"],
            id="CFG-06: metadata.annotations must be a map of strings",
        ),
    ],
)
def test_cfg06_metadata(doc: dict[str, Any], expected: list[str]) -> None:
    """CFG-06: metadata.name is required and a DNS-1123 subdomain; labels/annotations are string maps."""
    assert errors_of(doc) == expected


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(
            {"apiVersion": V1, "kind": VALIDATING, "metadata": {"name": "x"}}, id="CFG-06: webhooks absent"
        ),
        pytest.param(config(name="x"), id="CFG-06: webhooks empty"),
        pytest.param(
            config(name="a.b-c.d0", kind=VALIDATING),
            id="CFG-06: a dotted DNS-1123 subdomain name is accepted",
        ),
        pytest.param(
            {
                "apiVersion": V1,
                "kind": VALIDATING,
                "metadata": {"name": "x", "labels": {"not a key!": ""}, "annotations": {"???": "any text"}},
            },
            id="CFG-06: label and annotation keys and values are not otherwise validated",
        ),
    ],
)
def test_cfg06_accepted(doc: dict[str, Any]) -> None:
    """CFG-06: a named configuration with no webhooks is valid; metadata maps are not checked further."""
    snapshot = load(doc)
    assert snapshot.validating == ()
    assert snapshot.mutating == ()


def test_cfg06_metadata_namespace_is_a_warning() -> None:
    """CFG-06 [GW]: a namespaced-looking configuration loads, with a warning naming file and object."""
    doc = config(hook())
    doc["metadata"]["namespace"] = "team-a"
    snapshot = load(doc)
    assert [str(w) for w in snapshot.warnings] == [
        't.yaml: MutatingWebhookConfiguration "team-a" metadata.namespace: '
        'the object is cluster-scoped; namespace "team-a" is ignored'
    ]
    assert snapshot.mutating[0].name == "a.b.c"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        pytest.param(
            ..., ["webhooks[0].name: Required value"], id="CFG-07: a webhook without name is refused"
        ),
        pytest.param("", ["webhooks[0].name: Required value"], id="CFG-07: an empty webhook name is refused"),
        pytest.param(
            "k8s.io",
            [
                'webhooks[0].name: Invalid value: "k8s.io": should be a domain with at least three segments separated by dots'
            ],
            id="CFG-07: k8s.io has only two segments",
        ),
        pytest.param(
            "my-hook",
            [
                'webhooks[0].name: Invalid value: "my-hook": should be a domain with at least three segments separated by dots'
            ],
            id="CFG-07: my-hook has one segment",
        ),
        pytest.param(
            "A.b.c",
            [f'webhooks[0].name: Invalid value: "A.b.c": {DNS1123_SUBDOMAIN}'],
            id="CFG-07: a webhook name must be a lowercase DNS-1123 subdomain",
        ),
        pytest.param(
            "a..b.c",
            [f'webhooks[0].name: Invalid value: "a..b.c": {DNS1123_SUBDOMAIN}'],
            id="CFG-07: empty segments are refused by the subdomain rule first",
        ),
        pytest.param("a.b.c", [], id="CFG-07: a.b.c is accepted"),
        pytest.param("validate.team-a.example.com", [], id="CFG-07: a long dotted name is accepted"),
    ],
)
def test_cfg07_webhook_name(name: Any, expected: list[str]) -> None:
    """CFG-07: the webhook name is required, a DNS-1123 subdomain with at least three segments."""
    doc = config(hook(name=name)) if name is not ... else config(hook(name=...))
    assert errors_of(doc) == expected


@pytest.mark.parametrize(
    ("api_version", "expected"),
    [
        pytest.param(
            V1, ['webhooks[2].name: Duplicate value: "a.b.c"'], id="CFG-08: v1 refuses a repeated name"
        ),
        pytest.param(V1BETA1, [], id="CFG-08: v1beta1 may repeat webhook names"),
    ],
)
def test_cfg08_duplicate_webhook_names(api_version: str, expected: list[str]) -> None:
    """CFG-08: webhook names are unique within one v1 configuration; v1beta1 may repeat them."""
    doc = config(hook("a.b.c"), hook("x.y.z"), hook("a.b.c"), api_version=api_version)
    assert errors_of(doc) == expected


def test_cfg08_same_name_in_two_configurations() -> None:
    """CFG-08: the same webhook name in different configurations is always allowed."""
    snapshot = load(config(hook("a.b.c"), name="one"), config(hook("a.b.c"), name="two"))
    assert [h.identity for h in snapshot.mutating] == ["one/a.b.c/0", "two/a.b.c/0"]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        pytest.param(
            "failurePolicy",
            "fail",
            'webhooks[0].failurePolicy: Unsupported value: "fail": supported values: "Fail", "Ignore"',
            id="CFG-09: failurePolicy is case-sensitive",
        ),
        pytest.param(
            "failurePolicy",
            "Retry",
            'webhooks[0].failurePolicy: Unsupported value: "Retry": supported values: "Fail", "Ignore"',
            id="CFG-09: failurePolicy Retry is unsupported",
        ),
        pytest.param(
            "matchPolicy",
            "exact",
            'webhooks[0].matchPolicy: Unsupported value: "exact": supported values: "Equivalent", "Exact"',
            id="CFG-09: matchPolicy is case-sensitive",
        ),
        pytest.param(
            "reinvocationPolicy",
            "Always",
            'webhooks[0].reinvocationPolicy: Unsupported value: "Always": supported values: "IfNeeded", "Never"',
            id="CFG-09: reinvocationPolicy Always is unsupported",
        ),
        pytest.param(
            "failurePolicy",
            "",
            'webhooks[0].failurePolicy: Unsupported value: "": supported values: "Fail", "Ignore"',
            id="CFG-09: an empty failurePolicy is present, hence unsupported",
        ),
    ],
)
def test_cfg09_policies(field: str, value: str, expected: str) -> None:
    """CFG-09: failurePolicy, matchPolicy and reinvocationPolicy must be one of their values exactly."""
    assert errors_of(with_hook(**{field: value})) == [expected]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param("failurePolicy", "Ignore", id="CFG-09: failurePolicy Ignore is accepted"),
        pytest.param("matchPolicy", "Equivalent", id="CFG-09: matchPolicy Equivalent is accepted"),
        pytest.param("reinvocationPolicy", "IfNeeded", id="CFG-09: reinvocationPolicy IfNeeded is accepted"),
    ],
)
def test_cfg09_accepted(field: str, value: str) -> None:
    """CFG-09: the listed values load."""
    assert errors_of(with_hook(**{field: value})) == []


@pytest.mark.parametrize(
    ("api_version", "side_effects", "expected"),
    [
        pytest.param(
            V1,
            ...,
            ["webhooks[0].sideEffects: Required value: must specify one of None, NoneOnDryRun"],
            id="CFG-10: v1 requires sideEffects",
        ),
        pytest.param(
            V1,
            "Some",
            ['webhooks[0].sideEffects: Unsupported value: "Some": supported values: "None", "NoneOnDryRun"'],
            id="CFG-10: v1 refuses Some",
        ),
        pytest.param(
            V1,
            "Unknown",
            [
                'webhooks[0].sideEffects: Unsupported value: "Unknown": supported values: "None", "NoneOnDryRun"'
            ],
            id="CFG-10: v1 refuses Unknown",
        ),
        pytest.param(V1, "None", [], id="CFG-10: v1 accepts None"),
        pytest.param(V1, "NoneOnDryRun", [], id="CFG-10: v1 accepts NoneOnDryRun"),
        pytest.param(V1BETA1, "Some", [], id="CFG-10: v1beta1 accepts Some"),
        pytest.param(V1BETA1, "Unknown", [], id="CFG-10: v1beta1 accepts Unknown"),
        pytest.param(
            V1BETA1,
            "none",
            [
                'webhooks[0].sideEffects: Unsupported value: "none": '
                'supported values: "None", "NoneOnDryRun", "Some", "Unknown"'
            ],
            id="CFG-10: v1beta1 refuses anything else, listing all four",
        ),
    ],
)
def test_cfg10_side_effects(api_version: str, side_effects: Any, expected: list[str]) -> None:
    """CFG-10: sideEffects is required; v1 allows None/NoneOnDryRun, v1beta1 also Some/Unknown."""
    assert errors_of(config(hook(sideEffects=side_effects), api_version=api_version)) == expected


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        pytest.param(
            45,
            [
                "webhooks[0].timeoutSeconds: Invalid value: 45: the timeout value must be between 1 and 30 seconds"
            ],
            id="CFG-11: 45 seconds is refused",
        ),
        pytest.param(
            31,
            [
                "webhooks[0].timeoutSeconds: Invalid value: 31: the timeout value must be between 1 and 30 seconds"
            ],
            id="CFG-11: 31 seconds is refused",
        ),
        pytest.param(
            0,
            [
                "webhooks[0].timeoutSeconds: Invalid value: 0: the timeout value must be between 1 and 30 seconds"
            ],
            id="CFG-11: an explicit 0 is kept and refused",
        ),
        pytest.param(
            -5,
            [
                "webhooks[0].timeoutSeconds: Invalid value: -5: the timeout value must be between 1 and 30 seconds"
            ],
            id="CFG-11: a negative timeout is refused",
        ),
        pytest.param(1, [], id="CFG-11: 1 second is accepted"),
        pytest.param(30, [], id="CFG-11: 30 seconds is accepted"),
    ],
)
def test_cfg11_timeout(timeout: int, expected: list[str]) -> None:
    """CFG-11: timeoutSeconds must satisfy 1 ≤ t ≤ 30."""
    assert errors_of(with_hook(timeoutSeconds=timeout)) == expected


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        pytest.param(
            ...,
            ["webhooks[0].admissionReviewVersions: Required value: must specify one of v1, v1beta1"],
            id="CFG-12: v1 requires admissionReviewVersions",
        ),
        pytest.param(
            [],
            ["webhooks[0].admissionReviewVersions: Required value: must specify one of v1, v1beta1"],
            id="CFG-12: an empty list is refused in v1",
        ),
        pytest.param(
            ["v1", "v1"],
            ['webhooks[0].admissionReviewVersions[1]: Invalid value: "v1": duplicate version'],
            id="CFG-12: a duplicate version is refused",
        ),
        pytest.param(
            ["v2"],
            [
                'webhooks[0].admissionReviewVersions: Invalid value: []string{"v2"}: must include at least one of v1, v1beta1'
            ],
            id="CFG-12: at least one of v1, v1beta1 is required",
        ),
        pytest.param(
            ["V1", "v1"],
            [f'webhooks[0].admissionReviewVersions[0]: Invalid value: "V1": {DNS1035_LABEL}'],
            id="CFG-12: entries must be DNS-1035 labels",
        ),
        pytest.param(
            ["2beta", "v1beta1"],
            [f'webhooks[0].admissionReviewVersions[0]: Invalid value: "2beta": {DNS1035_LABEL}'],
            id="CFG-12: a DNS-1035 label starts with a letter",
        ),
        pytest.param(["v2", "v1"], [], id="CFG-12: extra unknown versions such as v2 are allowed"),
        pytest.param(["v1beta1"], [], id="CFG-12: v1beta1 alone is accepted"),
    ],
)
def test_cfg12_admission_review_versions(versions: Any, expected: list[str]) -> None:
    """CFG-12: non-empty, duplicate-free DNS-1035 labels including v1 or v1beta1."""
    assert errors_of(with_hook(admissionReviewVersions=versions)) == expected


@pytest.mark.parametrize(
    "client_config",
    [
        pytest.param(
            {"url": "https://a.example.com", "service": {"namespace": "ns", "name": "svc"}},
            id="CFG-13: url and service together are refused",
        ),
        pytest.param({}, id="CFG-13: neither url nor service is refused"),
        pytest.param({"caBundle": ""}, id="CFG-13: a caBundle alone is refused"),
        pytest.param(..., id="CFG-13: a missing clientConfig is refused"),
    ],
)
def test_cfg13_exactly_one_of_url_or_service(client_config: Any) -> None:
    """CFG-13: clientConfig must contain exactly one of url and service."""
    assert errors_of(with_hook(clientConfig=client_config)) == [
        "webhooks[0].clientConfig: Required value: exactly one of url or service is required"
    ]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        pytest.param(
            "ftp://backend.example.com/x",
            [
                f"webhooks[0].clientConfig.url: Invalid value: \"ftp\": 'https' is the only allowed URL scheme{URL_FORM}"
            ],
            id="CFG-14: only the https scheme is allowed",
        ),
        pytest.param(
            "backend.example.com/x",
            [
                f"webhooks[0].clientConfig.url: Invalid value: \"\": 'https' is the only allowed URL scheme{URL_FORM}",
                f'webhooks[0].clientConfig.url: Invalid value: "": host must be specified{URL_FORM}',
            ],
            id="CFG-14: a URL without scheme has no host either",
        ),
        pytest.param(
            "https:///validate",
            [f'webhooks[0].clientConfig.url: Invalid value: "": host must be specified{URL_FORM}'],
            id="CFG-14: the host must be non-empty",
        ),
        pytest.param(
            "https://admin:secret@backend.example.com/",
            [
                'webhooks[0].clientConfig.url: Invalid value: "admin:xxxxx": user information is not permitted in the URL'
            ],
            id="CFG-14: user information is refused",
        ),
        pytest.param(
            "https://backend.example.com/x#frag",
            ['webhooks[0].clientConfig.url: Invalid value: "frag": fragments are not permitted in the URL'],
            id="CFG-14: a fragment is refused",
        ),
        pytest.param(
            "https://backend.example.com/x?timeout=5",
            [
                'webhooks[0].clientConfig.url: Invalid value: "timeout=5": query parameters are not permitted in the URL'
            ],
            id="CFG-14: a query is refused",
        ),
        pytest.param(
            "https://backend.example.com:port/x",
            [
                "webhooks[0].clientConfig.url: Required value: url must be a valid URL: "
                f'parse "https://backend.example.com:port/x": invalid port ":port" after host{URL_FORM}'
            ],
            id="CFG-14: a URL that does not parse is refused",
        ),
        pytest.param(
            "https://admin:secret@backend.example.com:port/x",
            [
                "webhooks[0].clientConfig.url: Required value: url must be a valid URL: "
                f'parse "https://admin:xxxxx@backend.example.com:port/x": invalid port ":port" after host{URL_FORM}'
            ],
            id="CFG-14: a URL that does not parse is quoted without its password",
        ),
        pytest.param(
            "https://backend.example.com:8443/a/b", [], id="CFG-14: https with port and path is accepted"
        ),
        pytest.param("HTTPS://backend.example.com", [], id="CFG-14: the scheme is case-insensitive"),
        pytest.param("https://[2001:db8::1]:8443/", [], id="CFG-14: an IPv6 host is accepted"),
    ],
)
def test_cfg14_url(url: str, expected: list[str]) -> None:
    """CFG-14: a url must parse, be https, have a host, and carry no user info, fragment or query."""
    assert errors_of(with_url(url)) == expected


@pytest.mark.parametrize(
    ("url", "strict_https", "accepted"),
    [
        pytest.param(
            "http://localhost:8080/validate", False, True, id="CFG-15: http to localhost is accepted"
        ),
        pytest.param("http://LocalHost/validate", False, True, id="CFG-15: localhost in any case"),
        pytest.param("http://127.0.0.1:9443/", False, True, id="CFG-15: http to 127.0.0.1 is accepted"),
        pytest.param("http://127.200.3.4/", False, True, id="CFG-15: any address in 127.0.0.0/8"),
        pytest.param("http://[::1]:9443/", False, True, id="CFG-15: http to ::1 is accepted"),
        pytest.param(
            "http://backend.example.com/", False, False, id="CFG-15: http to another host is refused"
        ),
        pytest.param("http://10.0.0.1/", False, False, id="CFG-15: http to a private address is refused"),
        pytest.param("http://128.0.0.1/", False, False, id="CFG-15: 128.0.0.1 is not loopback"),
        pytest.param(
            "http://localhost.example.com/", False, False, id="CFG-15: a name merely starting localhost"
        ),
        pytest.param("http://[::2]/", False, False, id="CFG-15: only ::1 among IPv6 addresses"),
        pytest.param(
            "http://localhost:8080/", True, False, id="CFG-15: strict https refuses http to localhost"
        ),
        pytest.param("https://localhost:8443/", True, True, id="CFG-15: strict https still accepts https"),
    ],
)
def test_cfg15_http_for_loopback(url: str, strict_https: bool, accepted: bool) -> None:
    """CFG-15 [GW]: plain http is accepted for loopback hosts only, unless strict https is on."""
    expected = (
        []
        if accepted
        else [
            f"webhooks[0].clientConfig.url: Invalid value: \"http\": 'https' is the only allowed URL scheme{URL_FORM}"
        ]
    )
    assert errors_of(with_url(url), strict_https=strict_https) == expected


@pytest.mark.parametrize(
    ("service", "expected"),
    [
        pytest.param(
            {"name": ""},
            ["webhooks[0].clientConfig.service.name: Required value: service name is required"],
            id="CFG-16: the service name is required",
        ),
        pytest.param(
            {"namespace": ...},
            ["webhooks[0].clientConfig.service.namespace: Required value: service namespace is required"],
            id="CFG-16: the service namespace is required",
        ),
        pytest.param(
            {"port": 0},
            [
                "webhooks[0].clientConfig.service.port: Invalid value: 0: "
                "port is not valid: must be between 1 and 65535, inclusive"
            ],
            id="CFG-16: an explicit port 0 is kept and refused",
        ),
        pytest.param(
            {"port": 65536},
            [
                "webhooks[0].clientConfig.service.port: Invalid value: 65536: "
                "port is not valid: must be between 1 and 65535, inclusive"
            ],
            id="CFG-16: port 65536 is refused",
        ),
        pytest.param(
            {"path": "validate"},
            ["webhooks[0].clientConfig.service.path: Invalid value: \"validate\": must start with a '/'"],
            id="CFG-16: a path must start with a slash",
        ),
        pytest.param(
            {"path": "//"},
            ['webhooks[0].clientConfig.service.path: Invalid value: "//": segment[0] may not be empty'],
            id="CFG-16: // is refused with no further checks",
        ),
        pytest.param(
            {"path": "/a//b"},
            ['webhooks[0].clientConfig.service.path: Invalid value: "/a//b": segment[1] may not be empty'],
            id="CFG-16: an empty middle segment is refused",
        ),
        pytest.param(
            {"path": "/Validate"},
            [
                f'webhooks[0].clientConfig.service.path: Invalid value: "/Validate": segment[0]: {DNS1123_SUBDOMAIN}'
            ],
            id="CFG-16: each segment must be a DNS-1123 subdomain",
        ),
        pytest.param(
            {"path": "x/Y/z_"},
            [
                "webhooks[0].clientConfig.service.path: Invalid value: \"x/Y/z_\": must start with a '/'",
                'webhooks[0].clientConfig.service.path: Invalid value: "x/Y/z_": segment[0] may not be empty',
                f'webhooks[0].clientConfig.service.path: Invalid value: "x/Y/z_": segment[1]: {DNS1123_SUBDOMAIN}',
                f'webhooks[0].clientConfig.service.path: Invalid value: "x/Y/z_": segment[2]: {DNS1123_SUBDOMAIN}',
            ],
            id="CFG-16: without the leading slash the first character is still dropped and segments checked",
        ),
        pytest.param({"path": "/validate/"}, [], id="CFG-16: one trailing slash is allowed"),
        pytest.param({"path": "/"}, [], id="CFG-16: / is allowed"),
        pytest.param({"path": ""}, [], id="CFG-16: an empty path is allowed"),
        pytest.param({"path": "/v1.validate/pods"}, [], id="CFG-16: dotted segments are allowed"),
        pytest.param({"namespace": "Not_A_Name", "name": "ANY"}, [], id="CFG-16: names get no format check"),
    ],
)
def test_cfg16_service(service: dict[str, Any], expected: list[str]) -> None:
    """CFG-16: a service needs namespace and name, a port in 1..65535 and a well-formed path."""
    service = {"namespace": "ns", "name": "svc"} | service
    service = {k: v for k, v in service.items() if v is not ...}
    assert errors_of(with_hook(clientConfig={"service": service})) == expected


@pytest.mark.parametrize(
    ("rule_fields", "expected"),
    [
        pytest.param(
            {"operations": []},
            ["webhooks[0].rules[0].operations: Required value"],
            id="CFG-18: operations required",
        ),
        pytest.param(
            {"operations": ["*", "CREATE"]},
            [
                "webhooks[0].rules[0].operations: Invalid value: "
                '[]admissionregistration.OperationType{"*", "CREATE"}: if \'*\' is present, must not specify other operations'
            ],
            id="CFG-18: * must be the only operation",
        ),
        pytest.param(
            {"operations": ["CREATE", "create"]},
            [
                'webhooks[0].rules[0].operations[1]: Unsupported value: "create": '
                'supported values: "*", "CONNECT", "CREATE", "DELETE", "UPDATE"'
            ],
            id="CFG-18: operations are case-sensitive",
        ),
        pytest.param(
            {"operations": ["PATCH"]},
            [
                'webhooks[0].rules[0].operations[0]: Unsupported value: "PATCH": '
                'supported values: "*", "CONNECT", "CREATE", "DELETE", "UPDATE"'
            ],
            id="CFG-18: PATCH is not an operation",
        ),
        pytest.param(
            {"apiGroups": []},
            ["webhooks[0].rules[0].apiGroups: Required value"],
            id="CFG-18: apiGroups required",
        ),
        pytest.param(
            {"apiGroups": ["apps", "*"]},
            [
                'webhooks[0].rules[0].apiGroups: Invalid value: []string{"apps", "*"}: if \'*\' is present, must not specify other API groups'
            ],
            id="CFG-18: * must be the only API group",
        ),
        pytest.param(
            {"apiVersions": []},
            ["webhooks[0].rules[0].apiVersions: Required value"],
            id="CFG-18: apiVersions required",
        ),
        pytest.param(
            {"apiVersions": ["*", "v1"]},
            [
                'webhooks[0].rules[0].apiVersions: Invalid value: []string{"*", "v1"}: if \'*\' is present, must not specify other API versions'
            ],
            id="CFG-18: * must be the only API version",
        ),
        pytest.param(
            {"apiVersions": ["v1", ""]},
            ["webhooks[0].rules[0].apiVersions[1]: Required value"],
            id="CFG-18: apiVersions may not contain an empty string",
        ),
        pytest.param(
            {"resources": []},
            ["webhooks[0].rules[0].resources: Required value"],
            id="CFG-18: resources required",
        ),
        pytest.param(
            {"scope": "cluster"},
            [
                'webhooks[0].rules[0].scope: Unsupported value: "cluster": supported values: "*", "Cluster", "Namespaced"'
            ],
            id="CFG-18: scope must be Cluster, Namespaced or *",
        ),
        pytest.param({"apiGroups": ["", "apps"]}, [], id="CFG-18: apiGroups may contain the core group"),
        pytest.param(
            {"operations": ["*"], "apiGroups": ["*"], "apiVersions": ["*"]}, [], id="CFG-18: lone wildcards"
        ),
        pytest.param({"scope": "Namespaced"}, [], id="CFG-18: scope Namespaced is accepted"),
    ],
)
def test_cfg18_rules(rule_fields: dict[str, Any], expected: list[str]) -> None:
    """CFG-18: each rule needs operations, apiGroups, apiVersions, resources; * only on its own."""
    assert errors_of(with_rule(**rule_fields)) == expected


def test_cfg18_empty_rules_is_valid() -> None:
    """CFG-18: a webhook with an empty rules list is valid (and never matches)."""
    assert load(with_hook(rules=[])).mutating[0].rules == ()


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        pytest.param(
            [""],
            ["webhooks[0].rules[0].resources[0]: Required value"],
            id="CFG-19: an empty entry is refused",
        ),
        pytest.param(
            ["*/*", "pods"],
            [
                'webhooks[0].rules[0].resources: Invalid value: []string{"*/*", "pods"}: if \'*/*\' is present, must not specify other resources'
            ],
            id="CFG-19: */* must be the only entry",
        ),
        pytest.param(
            ["pods/*", "pods/status"],
            [
                "webhooks[0].rules[0].resources[1]: Invalid value: \"pods/status\": if 'pods/*' is present, must not specify pods/status"
            ],
            id="CFG-19/20: pods/* then pods/status is refused",
        ),
        pytest.param(
            ["pods/status", "pods/*"], [], id="CFG-20: pods/status then pods/* passes (order quirk)"
        ),
        pytest.param(
            ["*/scale", "deployments/scale"],
            [
                'webhooks[0].rules[0].resources[1]: Invalid value: "deployments/scale": '
                "if '*/scale' is present, must not specify deployments/scale"
            ],
            id="CFG-19/20: */scale then deployments/scale is refused",
        ),
        pytest.param(
            ["deployments/scale", "*/scale"], [], id="CFG-20: deployments/scale then */scale passes"
        ),
        pytest.param(
            ["*", "pods"],
            [
                'webhooks[0].rules[0].resources: Invalid value: []string{"*", "pods"}: '
                "if '*' is present, must not specify other resources without subresources"
            ],
            id="CFG-19/20: * then pods is refused",
        ),
        pytest.param(["pods", "*"], [], id="CFG-20: pods then * passes (only the last plain entry counts)"),
        pytest.param(
            ["pods", "*", "configmaps"],
            [
                'webhooks[0].rules[0].resources: Invalid value: []string{"pods", "*", "configmaps"}: '
                "if '*' is present, must not specify other resources without subresources"
            ],
            id="CFG-20: a plain entry after * is refused whatever came before",
        ),
        pytest.param(["*", "pods/status"], [], id="CFG-19: * with a subresource is accepted"),
        pytest.param(["*/*"], [], id="CFG-19: */* alone is accepted"),
        pytest.param(
            ["pods/*", "pods/log", "pods/exec"],
            [
                "webhooks[0].rules[0].resources[1]: Invalid value: \"pods/log\": if 'pods/*' is present, must not specify pods/log",
                "webhooks[0].rules[0].resources[2]: Invalid value: \"pods/exec\": if 'pods/*' is present, must not specify pods/exec",
            ],
            id="CFG-19: every overlapping entry is reported",
        ),
    ],
)
def test_cfg19_cfg20_resources(resources: list[str], expected: list[str]) -> None:
    """CFG-19/20: resources may not overlap through wildcards, checked in upstream's order-dependent way."""
    assert errors_of(with_rule(resources=resources)) == expected


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        pytest.param(
            {"matchLabels": {"app": "web server"}},
            [f'webhooks[0].objectSelector.matchLabels: Invalid value: "web server": {LABEL_VALUE}'],
            id="CFG-21: matchLabels values must be label values",
        ),
        pytest.param(
            {"matchLabels": {"-app": "web"}},
            [f'webhooks[0].objectSelector.matchLabels: Invalid value: "-app": {LABEL_NAME}'],
            id="CFG-21: matchLabels keys must be qualified names",
        ),
        pytest.param(
            {"matchLabels": {"Example.com/app": "web"}},
            [
                f'webhooks[0].objectSelector.matchLabels: Invalid value: "Example.com/app": prefix part {DNS1123_SUBDOMAIN}'
            ],
            id="CFG-21: a key prefix must be a DNS-1123 subdomain",
        ),
        pytest.param(
            {"matchLabels": {"app": "x" * 64}},
            [
                f'webhooks[0].objectSelector.matchLabels: Invalid value: "{"x" * 64}": must be no more than 63 bytes'
            ],
            id="CFG-21: label values have at most 63 characters",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "In"}]},
            [
                "webhooks[0].objectSelector.matchExpressions[0].values: Required value: must be specified when `operator` is 'In' or 'NotIn'"
            ],
            id="CFG-21: In needs values",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "NotIn", "values": []}]},
            [
                "webhooks[0].objectSelector.matchExpressions[0].values: Required value: must be specified when `operator` is 'In' or 'NotIn'"
            ],
            id="CFG-21: NotIn needs values",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "Exists", "values": ["a"]}]},
            [
                "webhooks[0].objectSelector.matchExpressions[0].values: Forbidden: may not be specified when `operator` is 'Exists' or 'DoesNotExist'"
            ],
            id="CFG-21: Exists takes no values",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "Equals", "values": ["a"]}]},
            [
                'webhooks[0].objectSelector.matchExpressions[0].operator: Invalid value: "Equals": not a valid selector operator'
            ],
            id="CFG-21: an unknown operator is refused",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "a/b/c", "operator": "Exists"}]},
            [
                'webhooks[0].objectSelector.matchExpressions[0].key: Invalid value: "a/b/c": a valid label key '
                "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation "
                "is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' "
                "(e.g. 'example.com/MyName')"
            ],
            id="CFG-21: an expression key must be a qualified name",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "env", "operator": "In", "values": ["prod", "not valid"]}]},
            [
                f'webhooks[0].objectSelector.matchExpressions[0].values[1]: Invalid value: "not valid": {LABEL_VALUE}'
            ],
            id="CFG-21: expression values must be label values",
        ),
        pytest.param(
            {
                "matchLabels": {"example.com/app": "web", "tier": ""},
                "matchExpressions": [
                    {"key": "env", "operator": "NotIn", "values": ["dev", "test"]},
                    {"key": "skip", "operator": "DoesNotExist"},
                ],
            },
            [],
            id="CFG-21: a valid selector loads",
        ),
    ],
)
def test_cfg21_selectors(selector: dict[str, Any], expected: list[str]) -> None:
    """CFG-21: label selectors must be valid (keys, values, operators)."""
    assert errors_of(with_hook(objectSelector=selector)) == expected


def test_cfg21_namespace_selector_path() -> None:
    """CFG-21: namespaceSelector problems carry their own path."""
    doc = with_hook(namespaceSelector={"matchExpressions": [{"key": "env", "operator": "In"}]})
    assert errors_of(doc) == [
        "webhooks[0].namespaceSelector.matchExpressions[0].values: Required value: "
        "must be specified when `operator` is 'In' or 'NotIn'"
    ]


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        pytest.param(
            [{"name": f"c{i}", "expression": "true"} for i in range(65)],
            "webhooks[0].matchConditions: Too many: 65: must have at most 64 items",
            id="CFG-22: at most 64 match conditions",
        ),
        pytest.param(
            [{"expression": "true"}],
            "webhooks[0].matchConditions[0].name: Required value",
            id="CFG-22: a condition name is required",
        ),
        pytest.param(
            [{"name": "not a name", "expression": "true"}],
            f'webhooks[0].matchConditions[0].name: Invalid value: "not a name": {LABEL_NAME}',
            id="CFG-22: condition names are qualified names",
        ),
        pytest.param(
            [{"name": "x", "expression": "true"}, {"name": "x", "expression": "false"}],
            'webhooks[0].matchConditions[1].name: Duplicate value: "x"',
            id="CFG-22: condition names are unique",
        ),
        pytest.param(
            [{"name": "x", "expression": "  \n"}],
            "webhooks[0].matchConditions[0].expression: Required value",
            id="CFG-22: a blank expression is refused",
        ),
        pytest.param(
            [{"name": "x"}],
            "webhooks[0].matchConditions[0].expression: Required value",
            id="CFG-22: a missing expression is refused",
        ),
    ],
)
def test_cfg22_match_condition_shape(conditions: list[dict[str, str]], expected: str) -> None:
    """CFG-22: count, names and non-blank expressions of matchConditions."""
    assert expected in errors_of(with_hook(matchConditions=conditions))


@pytest.mark.parametrize(
    ("expression", "accepted"),
    [
        pytest.param("object.metadata.name == 'x'", True, id="CFG-22: a boolean expression compiles"),
        pytest.param(
            "request.operation == 'CREATE' && oldObject == null", True, id="CFG-22: request and oldObject"
        ),
        pytest.param("namespaceObject == null", True, id="CFG-22: namespaceObject is declared"),
        pytest.param("object.metadata.name ==", False, id="CFG-22: a syntax error is refused"),
        pytest.param("params.x == 1", False, id="CFG-22: params is not declared for webhooks"),
    ],
)
def test_cfg22_expressions_compile(expression: str, accepted: bool) -> None:
    """CFG-22: expressions must compile in the webhook CEL environment; an error refuses the config."""
    errors = errors_of(with_hook(matchConditions=[{"name": "c", "expression": expression}]))
    if accepted:
        assert errors == []
    else:
        assert len(errors) == 1
        assert errors[0].startswith(
            f"webhooks[0].matchConditions[0].expression: Invalid value: {go_quote(expression)}: "
        )


def test_cfg22_non_boolean_is_refused() -> None:
    """CFG-22: an expression that compiles to a non-boolean type is refused."""
    errors = errors_of(with_hook(matchConditions=[{"name": "c", "expression": "'a string'"}]))
    assert len(errors) == 1
    assert errors[0].startswith("webhooks[0].matchConditions[0].expression: Invalid value: ")


def test_cfg22_without_match_conditions_no_cel_is_needed() -> None:
    """CFG-22: a webhook without matchConditions has none in the model."""
    assert load(with_hook()).mutating[0].match_conditions == ()
