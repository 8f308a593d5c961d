"""The Snapshot: effective order (ORD-01/03/05), immutability, caBundles (CFG-17), load-time warnings."""

from __future__ import annotations

import base64
from typing import Any

import pytest
import trustme

from gateway.config.load import load_documents
from gateway.config.model import Snapshot
from tests.configs.builders import (
    MUTATING,
    V1BETA1,
    VALIDATING,
    config,
    errors_of,
    hook,
    load,
    problems_of,
    rule,
)


def identities(snapshot: Snapshot, kind: str = "mutating") -> list[str]:
    return [h.identity for h in snapshot.webhooks("validating" if kind == "validating" else "mutating")]


@pytest.mark.parametrize(
    ("configs", "expected"),
    [
        pytest.param(
            [("b", ["x.a.b", "y.a.b"]), ("a", ["z.a.b"])],
            ["a/z.a.b/0", "b/x.a.b/0", "b/y.a.b/0"],
            id="ORD-01: b=[x,y] and a=[z] give [z, x, y]",
        ),
        pytest.param(
            [("a0", ["p.a.b"]), ("a.b", ["q.a.b"]), ("a-b", ["r.a.b"])],
            ["a-b/r.a.b/0", "a.b/q.a.b/0", "a0/p.a.b/0"],
            id="ORD-01: names sort by bytes ('-' < '.' < '0')",
        ),
        pytest.param(
            [("team", ["c.a.b", "a.a.b", "b.a.b"])],
            ["team/c.a.b/0", "team/a.a.b/0", "team/b.a.b/0"],
            id="ORD-01: webhooks keep their array order",
        ),
        pytest.param(
            [("z", ["z.a.b"]), ("aa", ["y.a.b"]), ("a", ["x.a.b"])],
            ["a/x.a.b/0", "aa/y.a.b/0", "z/z.a.b/0"],
            id="ORD-01: a prefix sorts first, whatever the load order",
        ),
    ],
)
def test_ord01_effective_order(configs: list[tuple[str, list[str]]], expected: list[str]) -> None:
    """ORD-01: configurations sorted by metadata.name bytewise, each contributing its webhooks in order."""
    docs = [config(*(hook(n) for n in names), name=name) for name, names in configs]
    snapshot = load(*docs)
    assert identities(snapshot) == expected
    assert [h.index for h in snapshot.mutating] == list(range(len(expected)))


def test_ord01_one_list_per_kind() -> None:
    """ORD-01: validating and mutating backends form separate lists, each indexed from 0."""
    snapshot = load(
        config(hook("v1.a.b"), name="b", kind=VALIDATING),
        config(hook("m1.a.b"), hook("m2.a.b"), name="a", kind=MUTATING),
        config(hook("v2.a.b"), name="a", kind=VALIDATING),
    )
    assert [(h.identity, h.index) for h in snapshot.validating] == [("a/v2.a.b/0", 0), ("b/v1.a.b/0", 1)]
    assert [(h.identity, h.index) for h in snapshot.mutating] == [("a/m1.a.b/0", 0), ("a/m2.a.b/0", 1)]


def test_match_plans_are_compiled_with_the_snapshot() -> None:
    """ORD-01/04: every webhook's match plan is built with the Snapshot, in effective order."""
    snapshot = load(
        config(hook("v1.a.b"), name="b", kind=VALIDATING),
        config(hook("m1.a.b"), hook("m2.a.b"), name="a", kind=MUTATING),
    )
    for kind in ("validating", "mutating"):
        plans = snapshot.plans(kind)  # type: ignore[arg-type]
        assert [p.hook for p in plans.plans] == list(snapshot.webhooks(kind))  # type: ignore[arg-type]
    again = load(
        config(hook("v1.a.b"), name="b", kind=VALIDATING),
        config(hook("m1.a.b"), hook("m2.a.b"), name="a", kind=MUTATING),
    )
    assert again.plans("mutating") is not snapshot.plans("mutating")
    assert again.plans("mutating") == snapshot.plans("mutating")  # equal webhooks, equal plans


def test_ord01_configurations_mapping() -> None:
    """ORD-01: configurations maps (kind, name) to that configuration's webhooks in array order."""
    snapshot = load(config(hook("x.a.b"), hook("y.a.b"), name="b"), config(hook("z.a.b"), name="a"))
    assert {k: [h.name for h in v] for k, v in snapshot.configurations.items()} == {
        ("mutating", "a"): ["z.a.b"],
        ("mutating", "b"): ["x.a.b", "y.a.b"],
    }
    assert snapshot.configurations[("mutating", "b")] == snapshot.mutating[1:]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        pytest.param(
            ["a.b.c", "x.y.z", "a.b.c", "a.b.c"],
            ["cfg/a.b.c/0", "cfg/x.y.z/0", "cfg/a.b.c/1", "cfg/a.b.c/2"],
            id="ORD-03: k counts earlier webhooks with the same name",
        ),
        pytest.param(
            ["a.b.c", "x.y.z"], ["cfg/a.b.c/0", "cfg/x.y.z/0"], id="ORD-03: distinct names all have k=0"
        ),
    ],
)
def test_ord03_identity(names: list[str], expected: list[str]) -> None:
    """ORD-03: identity is <configuration>/<webhook>/<k>; v1beta1 duplicates are told apart by k."""
    snapshot = load(config(*(hook(n) for n in names), name="cfg", api_version=V1BETA1))
    assert identities(snapshot) == expected
    assert [h.name for h in snapshot.mutating] == names  # messages use the plain name


def test_ord05_mutating_index_counts_the_full_list() -> None:
    """ORD-05: a mutating backend's index is its position in the full effective list of its kind."""
    snapshot = load(config(hook("x.a.b"), name="b"), config(hook("y.a.b"), hook("z.a.b"), name="a"))
    assert {h.name: h.index for h in snapshot.mutating} == {"y.a.b": 0, "z.a.b": 1, "x.a.b": 2}


# --- immutability --------------------------------------------------------------------------------


def test_snapshot_is_immutable() -> None:
    """ORD-04/CFG-25: the Snapshot and everything in it is read-only, so a review sees one fixed list."""
    snapshot = load(
        config(hook(), name="a"),
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ns", "labels": {"a": "b"}}},
    )
    assert isinstance(snapshot.mutating, tuple)
    with pytest.raises(TypeError):
        snapshot.configurations[("mutating", "x")] = ()  # type: ignore[index]
    with pytest.raises(TypeError):
        snapshot.namespaces["ns"]["a"] = "c"  # type: ignore[index]
    with pytest.raises(AttributeError):
        snapshot.generation = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        snapshot.mutating[0].timeout_seconds = 3  # type: ignore[misc]


def test_snapshot_generation_and_repr() -> None:
    """The generation given to the loader is the snapshot's; its repr counts what it holds."""
    snapshot = load_documents([("x", config(hook(), name="a"))], generation=42)
    assert repr(snapshot) == "<Snapshot generation=42 validating=0 mutating=1 namespaces=0>"


# --- caBundle (CFG-17) ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ca_pem() -> bytes:
    return trustme.CA().cert_pem.bytes()


def with_bundle(bundle: str) -> dict[str, Any]:
    return config(hook(clientConfig={"url": "https://backend.example.com/", "caBundle": bundle}))


def test_cfg17_ca_bundle_is_decoded_pem(ca_pem: bytes) -> None:
    """CFG-17: caBundle is base64 on the wire and PEM bytes in the model."""
    snapshot = load(with_bundle(base64.b64encode(ca_pem).decode()))
    assert snapshot.mutating[0].client_config.ca_bundle == ca_pem
    assert snapshot.warnings == ()


def test_cfg17_ca_bundle_with_line_breaks(ca_pem: bytes) -> None:
    """CFG-17: line breaks inside the base64 text are ignored, as Go's decoder does."""
    encoded = base64.encodebytes(ca_pem).decode()  # wrapped every 76 characters
    assert "\n" in encoded.strip()
    assert load(with_bundle(encoded)).mutating[0].client_config.ca_bundle == ca_pem


def test_cfg17_absent_ca_bundle_means_system_roots() -> None:
    """CFG-17/TRN-06: no caBundle gives empty bytes (system roots)."""
    assert load(with_bundle("")).mutating[0].client_config.ca_bundle == b""


@pytest.mark.parametrize(
    "pem",
    [
        pytest.param(b"not a certificate", id="CFG-17 [GW]: a bundle with no PEM block warns"),
        pytest.param(
            b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            id="CFG-17 [GW]: a PEM block that is not a certificate warns",
        ),
        pytest.param(b"\xff\xfe binary", id="CFG-17 [GW]: binary data warns"),
    ],
)
def test_cfg17_unparseable_bundle_is_only_a_warning(pem: bytes) -> None:
    """CFG-17: a non-empty bundle without a parseable PEM certificate loads with a warning, bytes kept."""
    problems = problems_of(with_bundle(base64.b64encode(pem).decode()))
    assert [(p.path, p.severity) for p in problems] == [("webhooks[0].clientConfig.caBundle", "warning")]
    assert problems[0].message.startswith("no parseable PEM certificate (")
    assert problems[0].message.endswith("); calls to this webhook will fail")
    assert load(with_bundle(base64.b64encode(pem).decode())).mutating[0].client_config.ca_bundle == pem


def test_cfg17_not_base64_is_an_error() -> None:
    """CFG-17: a caBundle that is not base64 cannot be decoded at all, which is an error."""
    (error,) = errors_of(with_bundle("-----BEGIN CERTIFICATE-----"))
    assert error.startswith("webhooks[0].clientConfig.caBundle: Invalid value: must be base64-encoded: ")


# --- MAT-10 and GW-05 warnings -------------------------------------------------------------------

EQUIVALENT_WARNING = (
    "webhooks[0].matchPolicy: Equivalent is matched as Exact: the gateway cannot convert objects between "
    "versions, so requests for {resource} in {missed} will not reach this webhook (rules[{i}] matches it "
    "only in {matched}); list every group/version in the rule, or set matchPolicy: Exact"
)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(
            {"matchPolicy": "Equivalent", "rules": [rule(apiGroups=["autoscaling"], apiVersions=["v1"],
                                                         resources=["horizontalpodautoscalers"])]},
            [EQUIVALENT_WARNING.format(i=0, resource="horizontalpodautoscalers", missed="autoscaling/v2",
                                       matched="autoscaling/v1")],
            id="MAT-10: Equivalent on one version of a resource served in two warns",
        ),
        pytest.param(
            {
                "matchPolicy": ...,
                "rules": [rule(apiGroups=["*"], apiVersions=["*"]), rule(apiVersions=["*"], resources=["events"])],
            },
            [EQUIVALENT_WARNING.format(i=1, resource="events", missed="events.k8s.io/v1", matched="v1")],
            id="MAT-10: the v1 default Equivalent warns, naming the first rule that misses an equivalent",
        ),
        pytest.param(
            {"matchPolicy": "Equivalent", "rules": [rule(apiGroups=["apps"])]},
            [],
            id="MAT-10: a resource with no equivalent (core v1 pods, apps) does not warn",
        ),
        pytest.param(
            {"matchPolicy": "Equivalent", "rules": [rule(apiGroups=["autoscaling"], apiVersions=["*"],
                                                         resources=["horizontalpodautoscalers"])]},
            [],
            id="MAT-10: a rule covering every group/version of the resource does not warn",
        ),
        pytest.param(
            {"matchPolicy": "Equivalent", "rules": [rule(apiGroups=["*"], apiVersions=["*"])]},
            [],
            id="MAT-10: fully wildcarded groups and versions do not warn",
        ),
        pytest.param(
            {"matchPolicy": "Equivalent", "rules": []},
            [],
            id="MAT-10: a webhook without rules does not warn",
        ),
        pytest.param({"matchPolicy": "Exact", "rules": [rule(resources=["events"])]}, [], id="MAT-10: Exact never warns"),
    ],
)  # fmt: skip
def test_mat10_equivalent_warning(fields: dict[str, Any], expected: list[str]) -> None:
    """MAT-10: an Equivalent backend warns once, only where Exact matching changes what reaches it."""
    snapshot = load(config(hook(**fields)))
    assert [f"{w.path}: {w.message}" for w in snapshot.warnings] == expected
    assert all(w.severity == "warning" for w in snapshot.warnings)


def _crd(*versions: str, strategy: str = "None", plural: str = "widgets") -> dict[str, Any]:
    conversion: dict[str, Any] = {"strategy": strategy}
    if strategy == "Webhook":
        conversion["webhook"] = {
            "clientConfig": {"url": "https://convert.example.com/convert"},
            "conversionReviewVersions": ["v1"],
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"plural": plural, "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [{"name": v, "served": True, "storage": i == 0} for i, v in enumerate(versions)],
            "conversion": conversion,
        },
    }


WIDGETS_V1 = rule(apiGroups=["example.com"], apiVersions=["v1"], resources=["widgets"])


@pytest.mark.parametrize(
    ("crd", "crd_first", "expected"),
    [
        pytest.param(
            _crd("v1", "v2"), False,
            [EQUIVALENT_WARNING.format(i=0, resource="widgets", missed="example.com/v2", matched="example.com/v1")],
            id="MAT-10: a multi-version CRD of the configuration, loaded after the webhook, warns for its other version",
        ),
        pytest.param(
            _crd("v1", "v2", strategy="Webhook"), True,
            [EQUIVALENT_WARNING.format(i=0, resource="widgets", missed="example.com/v2", matched="example.com/v1")],
            id="MAT-10: a multi-version CRD with a conversion backend, loaded first, warns too",
        ),
        pytest.param(_crd("v1"), False, [], id="MAT-10: a single-version CRD has no equivalent and does not warn"),
        pytest.param(
            _crd("v1", "v2", plural="gadgets"), False, [],
            id="MAT-10: a multi-version CRD of another resource does not warn",
        ),
    ],
)  # fmt: skip
def test_mat10_equivalent_warning_knows_multi_version_crds(
    crd: dict[str, Any], crd_first: bool, expected: list[str]
) -> None:
    """MAT-10: resources served under several versions include the configuration's multi-version CRDs."""
    webhooks = config(hook(matchPolicy="Equivalent", rules=[WIDGETS_V1]))
    snapshot = load(crd, webhooks) if crd_first else load(webhooks, crd)
    assert [f"{w.path}: {w.message}" for w in snapshot.warnings] == expected


@pytest.mark.parametrize(
    ("timeouts", "warns"),
    [
        pytest.param([10, 10, 10], False, id="GW-05: 30 s in total fits"),
        pytest.param([10, 10, 11], True, id="GW-05: 31 s in total warns"),
        pytest.param([30, ...], True, id="GW-05: defaults count (30 + 10)"),
    ],
)
def test_gw05_mutating_chain_timeout_warning(timeouts: list[Any], warns: bool) -> None:
    """GW-05: a warning when the sum of mutating timeouts exceeds the gateway's 30 s."""
    hooks = [hook(f"h{i}.a.b", timeoutSeconds=t) for i, t in enumerate(timeouts)]
    snapshot = load(config(*hooks), config(hook(timeoutSeconds=30), name="v", kind=VALIDATING))
    total = sum(10 if t is ... else t for t in timeouts)
    names = ", ".join(f"h{i}.a.b" for i in range(len(timeouts)))
    expected = (
        [
            f"<documents>: the timeouts of the {len(timeouts)} mutating webhooks that one request can match add "
            f"up to {total}s, more than the 30s a caller can give the gateway: webhooks late in the chain may "
            f"time out (GW-05; {names})"
        ]
        if warns
        else []
    )
    assert [str(w) for w in snapshot.warnings] == expected


def _selector(*requirements: tuple[str, str, list[str]]) -> dict[str, Any]:
    return {
        "matchExpressions": [
            {"key": k, "operator": op, **({"values": v} if v else {})} for k, op, v in requirements
        ]
    }


@pytest.mark.parametrize(
    ("hooks", "warns"),
    [
        pytest.param(
            [
                hook("rev.namespace.sidecar-injector.istio.io", timeoutSeconds=10,
                     namespaceSelector=_selector(("istio.io/rev", "In", ["default"]), ("istio-injection", "DoesNotExist", []))),
                hook("rev.object.sidecar-injector.istio.io", timeoutSeconds=10,
                     namespaceSelector=_selector(("istio.io/rev", "DoesNotExist", []), ("istio-injection", "DoesNotExist", [])),
                     objectSelector=_selector(("istio.io/rev", "In", ["default"]))),
                hook("namespace.sidecar-injector.istio.io", timeoutSeconds=10,
                     namespaceSelector=_selector(("istio-injection", "In", ["enabled"]))),
                hook("object.sidecar-injector.istio.io", timeoutSeconds=10,
                     namespaceSelector=_selector(("istio-injection", "DoesNotExist", []), ("istio.io/rev", "DoesNotExist", [])),
                     objectSelector=_selector(("sidecar.istio.io/inject", "In", ["true"]), ("istio.io/rev", "DoesNotExist", []))),
            ],
            False,
            id="GW-05: mutually exclusive selectors (istio's four sidecar injectors, 40 s) do not add up",
        ),
        pytest.param(
            [hook("pods.a.b", timeoutSeconds=20), hook("deploy.a.b", timeoutSeconds=20,
                                                      rules=[rule(apiGroups=["apps"], resources=["deployments"])])],
            False,
            id="GW-05: webhooks with disjoint rules (pods, deployments) do not add up",
        ),
        pytest.param(
            [hook("create.a.b", timeoutSeconds=20), hook("update.a.b", timeoutSeconds=20, rules=[rule(operations=["UPDATE"])])],
            False,
            id="GW-05: webhooks with disjoint operations do not add up",
        ),
        pytest.param(
            [hook("on.a.b", timeoutSeconds=20, namespaceSelector=_selector(("env", "In", ["prod"]))),
             hook("also.a.b", timeoutSeconds=20, namespaceSelector=_selector(("team", "In", ["a"])))],
            True,
            id="GW-05: selectors on different keys can both match, so their timeouts add up",
        ),
        pytest.param(
            [hook("in.a.b", timeoutSeconds=20, objectSelector=_selector(("tier", "In", ["web"]))),
             hook("notin.a.b", timeoutSeconds=20, objectSelector=_selector(("tier", "NotIn", ["db"])))],
            True,
            id="GW-05: In [web] and NotIn [db] can both match, so their timeouts add up",
        ),
    ],
)  # fmt: skip
def test_gw05_only_webhooks_that_can_meet_add_up(hooks: list[dict[str, Any]], warns: bool) -> None:
    """GW-05: the warning counts only webhooks that one request can match together (true in CI gates)."""
    snapshot = load(config(*hooks))
    assert any("add up to" in str(w) for w in snapshot.warnings) is warns, [str(w) for w in snapshot.warnings]
