"""Configuration sources and documents (CFG-01, CFG-02, CFG-23, unknown fields, types, directories)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gateway.config.load import load_directory, load_documents, load_files
from gateway.errors import ConfigError, ConfigProblem
from tests.configs.builders import (
    MUTATING,
    V1,
    V1BETA1,
    VALIDATING,
    config,
    errors_of,
    hook,
    load,
    problems_of,
    rule,
)

CONFIGS = Path(__file__).parent / "configs"
SUPPORTED = (
    "expected a ValidatingWebhookConfiguration or MutatingWebhookConfiguration of "
    "admissionregistration.k8s.io/v1 or /v1beta1, a v1 Namespace, or a List of them"
)


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def yaml_config(name: str, hook_name: str = "a.b.c", kind: str = MUTATING) -> str:
    return json.dumps(config(hook(hook_name), name=name, kind=kind))  # JSON is YAML


def messages(exc: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [str(p) for p in exc.value.problems]


# --- CFG-01: what a source may hold --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "names"),
    [
        pytest.param(yaml_config("one"), ["one"], id="CFG-01: one object"),
        pytest.param(
            f"{yaml_config('one')}\n---\n{yaml_config('two')}\n",
            ["one", "two"],
            id="CFG-01: multi-document YAML",
        ),
        pytest.param(
            f"---\n---\n{yaml_config('one')}\n---\n# only a comment\n---\n",
            ["one"],
            id="CFG-01: empty documents skipped",
        ),
        pytest.param(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "List",
                    "items": [
                        config(hook(), name="one"),
                        {"apiVersion": "v1", "kind": "List", "items": [config(hook(), name="two")]},
                    ],
                }
            ),
            ["one", "two"],
            id="CFG-01: nested List objects are unwrapped",
        ),
        pytest.param(
            json.dumps(
                {
                    "apiVersion": V1,
                    "kind": "MutatingWebhookConfigurationList",
                    "metadata": {"resourceVersion": "9"},
                    "items": [{"metadata": {"name": "one"}, "webhooks": [hook()]}],
                }
            ),
            ["one"],
            id="CFG-01: a typed list's items inherit apiVersion and kind",
        ),
        pytest.param(
            json.dumps({"apiVersion": "v1", "kind": "List", "items": []}), [], id="CFG-01: an empty List"
        ),
    ],
)
def test_cfg01_documents(tmp_path: Path, text: str, names: list[str]) -> None:
    """CFG-01: single objects, multi-document streams and (nested) Lists all load."""
    write(tmp_path, "hooks.yaml", text)
    snapshot = load_directory(tmp_path)
    assert [h.configuration for h in snapshot.mutating] == names


def test_cfg01_json_file(tmp_path: Path) -> None:
    """CFG-01: a .json file holding one object loads."""
    write(tmp_path, "hooks.json", yaml_config("from-json"))
    assert [h.configuration for h in load_directory(tmp_path).mutating] == ["from-json"]


@pytest.mark.parametrize(
    ("api_version", "kind"),
    [
        pytest.param(V1, VALIDATING, id="CFG-01: v1 validating"),
        pytest.param(V1, MUTATING, id="CFG-01: v1 mutating"),
        pytest.param(V1BETA1, VALIDATING, id="CFG-01: v1beta1 validating"),
        pytest.param(V1BETA1, MUTATING, id="CFG-01: v1beta1 mutating"),
    ],
)
def test_cfg01_accepted_kinds(api_version: str, kind: str) -> None:
    """CFG-01: both kinds of both API versions are accepted."""
    snapshot = load(config(hook(), kind=kind, api_version=api_version))
    assert len(snapshot.validating if kind == VALIDATING else snapshot.mutating) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            f"{yaml_config('one')}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\n",
            f'bad.yaml: documents[1]: unsupported apiVersion "v1" and kind "ConfigMap": {SUPPORTED}',
            id="CFG-01: another kind names file and document index",
        ),
        pytest.param(
            "apiVersion: admissionregistration.k8s.io/v1alpha1\nkind: ValidatingWebhookConfiguration\n",
            "bad.yaml: documents[0]: unsupported apiVersion "
            f'"admissionregistration.k8s.io/v1alpha1" and kind "ValidatingWebhookConfiguration": {SUPPORTED}',
            id="CFG-01: another apiVersion is refused",
        ),
        pytest.param(
            "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\n",
            "bad.yaml: documents[0]: unsupported apiVersion "
            f'"admissionregistration.k8s.io/v1" and kind "ValidatingAdmissionPolicy": {SUPPORTED}',
            id="CFG-01: admission policies are not webhook configurations",
        ),
        pytest.param(
            "apiVersion: v1\nkind: List\nitems:\n- apiVersion: v1\n  kind: Secret\n",
            f'bad.yaml: documents[0].items[0]: unsupported apiVersion "v1" and kind "Secret": {SUPPORTED}',
            id="CFG-01: a bad List item is located inside the list",
        ),
        pytest.param(
            "metadata: {name: x}\n",
            f"bad.yaml: documents[0]: apiVersion and kind are required; {SUPPORTED}",
            id="CFG-01: a document without apiVersion and kind is refused",
        ),
        pytest.param(
            "- a\n- b\n",
            "bad.yaml: documents[0]: expected an object, not a list",
            id="CFG-01: a document that is not an object is refused",
        ),
        pytest.param(
            "apiVersion: v1\nkind: List\nitems: {}\n",
            "bad.yaml: documents[0].items: must be a list, not an object",
            id="CFG-01: List items must be a list",
        ),
        pytest.param(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n  labels:\n    - a\n   - b\n",
            "bad.yaml: invalid YAML at line 7, column 4: did not find expected key (while parsing a block mapping)",
            id="CFG-01: a YAML syntax error names file and line",
        ),
    ],
)
def test_cfg01_refused_documents(tmp_path: Path, text: str, expected: str) -> None:
    """CFG-01: anything else in a configuration source is a load error naming file and document."""
    write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as exc:
        load_files([tmp_path / "bad.yaml"])
    assert [str(p).replace(str(tmp_path) + os.sep, "") for p in exc.value.errors] == [expected]


def test_cfg01_json_syntax_error(tmp_path: Path) -> None:
    """CFG-01: a JSON syntax error names the file, line and column."""
    write(tmp_path, "bad.json", '{\n  "apiVersion": "v1",\n  "kind": \n}\n')
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path)
    assert messages(exc) == [f"{tmp_path / 'bad.json'}: invalid JSON at line 4, column 1: Expecting value"]


def test_cfg01_namespaces_give_file_mode_labels() -> None:
    """CFG-01/GW-01: v1 Namespace objects provide namespace labels; a namespace without labels has {}."""
    snapshot = load(
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a", "labels": {"env": "prod"}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "bare"}},
    )
    assert {n: dict(v) for n, v in snapshot.namespaces.items()} == {"team-a": {"env": "prod"}, "bare": {}}


@pytest.mark.parametrize(
    ("docs", "expected"),
    [
        pytest.param(
            [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}},
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}},
            ],
            [
                'ns1.yaml: Namespace "team-a" metadata.name: Duplicate value: "team-a": '
                "a Namespace of this name is already defined in ns0.yaml"
            ],
            id="CFG-01: a namespace defined twice is an error naming both places",
        ),
        pytest.param(
            [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "Team.A"}}],
            [
                'ns0.yaml: Namespace "Team.A" metadata.name: Invalid value: "Team.A": a lowercase RFC 1123 label '
                "must consist of lower case alphanumeric characters or '-', and must start and end with an "
                "alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
                "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
            ],
            id="CFG-01: a namespace name must be a DNS-1123 label",
        ),
        pytest.param(
            [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x", "labels": {"env": True}}}],
            [
                'ns0.yaml: Namespace "x" metadata.labels[env]: Invalid value: true: must be a string, not a boolean'
            ],
            id="CFG-01: namespace labels must be strings",
        ),
    ],
)
def test_cfg01_namespace_problems(docs: list[dict[str, Any]], expected: list[str]) -> None:
    """CFG-01: Namespace objects are validated, and each name is defined once."""
    with pytest.raises(ConfigError) as exc:
        load_documents((f"ns{i}.yaml", d) for i, d in enumerate(docs))
    assert messages(exc) == expected


# --- CFG-02: unique names per kind ---------------------------------------------------------------


def test_cfg02_duplicate_configuration_names_name_both_files(tmp_path: Path) -> None:
    """CFG-02: a second configuration of the same kind and name is an error naming both places."""
    write(tmp_path, "a.yaml", yaml_config("shared"))
    write(tmp_path, "b.yaml", f"{yaml_config('other')}\n---\n{yaml_config('shared', 'x.y.z')}\n")
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path)
    assert messages(exc) == [
        f'{tmp_path / "b.yaml"}: MutatingWebhookConfiguration "shared" metadata.name: Duplicate value: "shared": '
        f"a MutatingWebhookConfiguration of this name is already defined in {tmp_path / 'a.yaml'} (documents[0])"
    ]


def test_cfg02_same_name_in_both_kinds() -> None:
    """CFG-02: names are unique per kind; a validating and a mutating configuration may share one."""
    snapshot = load(
        config(hook(), name="shared", kind=VALIDATING), config(hook(), name="shared", kind=MUTATING)
    )
    assert [h.identity for h in snapshot.validating] == ["shared/a.b.c/0"]
    assert [h.identity for h in snapshot.mutating] == ["shared/a.b.c/0"]
    assert set(snapshot.configurations) == {("validating", "shared"), ("mutating", "shared")}


def test_cfg02_kinds_serve_their_own_list() -> None:
    """CFG-02: validating configurations feed only the validating list, mutating only the mutating one."""
    snapshot = load(config(hook("v.a.b"), name="v", kind=VALIDATING), config(hook("m.a.b"), name="m"))
    assert [(h.name, h.kind) for h in snapshot.validating] == [("v.a.b", "validating")]
    assert [(h.name, h.kind) for h in snapshot.mutating] == [("m.a.b", "mutating")]
    assert snapshot.webhooks("validating") == snapshot.validating


# --- unknown fields and wrong types --------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        pytest.param(
            config(hook(timeoutSecond=5)),
            ["webhooks[0].timeoutSecond: unknown field; did you mean timeoutSeconds?"],
            id="unknown fields: a typo in a webhook field warns with its path and the field it misspells",
        ),
        pytest.param(
            config(hook(clientConfig={"url": "https://a.example.com", "cabundle": ""})),
            ["webhooks[0].clientConfig.cabundle: unknown field; did you mean caBundle?"],
            id="unknown fields: field names are case-sensitive",
        ),
        pytest.param(
            config(
                hook(
                    rules=[
                        {
                            "operations": ["*"],
                            "apiGroups": ["*"],
                            "apiVersions": ["*"],
                            "resources": ["*"],
                            "resourceNames": ["x"],
                        }
                    ]
                )
            ),
            ["webhooks[0].rules[0].resourceNames: unknown field"],
            id="unknown fields: resourceNames belongs to admission policies, not webhooks",
        ),
        pytest.param(
            config(hook(), kind=VALIDATING) | {"webhooks": [hook(reinvocationPolicy="IfNeeded")]},
            ["webhooks[0].reinvocationPolicy: unknown field"],
            id="unknown fields: reinvocationPolicy is a mutating-only field",
        ),
        pytest.param(
            config(hook(objectSelector={"matchLabels": {"a": "b"}, "selector": {}})),
            ["webhooks[0].objectSelector.selector: unknown field"],
            id="unknown fields: selectors have a closed field set",
        ),
        pytest.param(
            config(hook()) | {"spec": {}, "metadata": {"name": "team-a", "nmae": "x"}},
            ["metadata.nmae: unknown field; did you mean name?", "spec: unknown field"],
            id="unknown fields: top-level and metadata fields are checked too",
        ),
        pytest.param(
            config(hook(namespaceSelector={"matchLabels": {"a": "b"}}, namespaceSelectr={"x": "y"})),
            ["webhooks[0].namespaceSelectr: unknown field; did you mean namespaceSelector?"],
            id="unknown fields: a near miss of a guarding field that is also given only warns",
        ),
    ],
)
def test_unknown_fields_warn(doc: dict[str, Any], expected: list[str]) -> None:
    """Unknown fields never pass silently: each is a warning naming its path; the config still loads."""
    snapshot = load(doc)
    assert [f"{w.path}: {w.message}" for w in snapshot.warnings] == expected
    assert all(w.severity == "warning" for w in snapshot.warnings)


def test_unknown_field_warning_text() -> None:
    """Unknown-field warnings read like every other problem: file, kind, name, path."""
    (warning,) = load(config(hook(timeoutSecond=5))).warnings
    assert str(warning) == (
        't.yaml: MutatingWebhookConfiguration "team-a" webhooks[0].timeoutSecond: unknown field; '
        "did you mean timeoutSeconds?"
    )


GUARDING_TYPOS = [
    pytest.param(
        {"namespaceSelectr": {"matchLabels": {"team": "a"}}},
        "webhooks[0].namespaceSelectr",
        "namespaceSelector",
        id="a misspelt namespaceSelector would match every namespace: refused",
    ),
    pytest.param(
        {"ObjectSelector": {"matchLabels": {"team": "a"}}},
        "webhooks[0].ObjectSelector",
        "objectSelector",
        id="a wrongly cased objectSelector would match every object: refused",
    ),
    pytest.param(
        {"failurPolicy": "Ignore"},
        "webhooks[0].failurPolicy",
        "failurePolicy",
        id="a misspelt failurePolicy would silently be the default: refused",
    ),
    pytest.param(
        {"matchConditons": [{"name": "x", "expression": "true"}]},
        "webhooks[0].matchConditons",
        "matchConditions",
        id="misspelt matchConditions would match everything the rules do: refused",
    ),
    pytest.param(
        {"objectSelector": {"matchLabel": {"a": "b"}}},
        "webhooks[0].objectSelector.matchLabel",
        "matchLabels",
        id="a misspelt matchLabels inside a selector empties it: refused",
    ),
    pytest.param(
        {
            "rules": [
                {
                    "operations": ["CREATE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                    "scoep": "Namespaced",
                }
            ]
        },
        "webhooks[0].rules[0].scoep",
        "scope",
        id="a misspelt rule field (scope) widens the rule: refused",
    ),
]


@pytest.mark.parametrize(("fields", "path", "meant"), GUARDING_TYPOS)
def test_a_typo_of_a_selector_rule_or_policy_field_is_an_error(
    fields: dict[str, Any], path: str, meant: str
) -> None:
    """An unknown field one edit away from a field that narrows a webhook or sets how it fails (and not
    also given) is an error naming the field it misspells; other unknown fields stay warnings."""
    with pytest.raises(ConfigError) as raised:
        load(config(hook(**fields)))
    (error,) = raised.value.errors
    assert error.path == path
    assert error.message.startswith(f"unknown field; did you mean {meant}? (refused:")


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        pytest.param(
            config(hook(timeoutSeconds="10")),
            ['webhooks[0].timeoutSeconds: Invalid value: "10": must be an integer, not a string'],
            id="types: a quoted timeout is refused, with no follow-on error",
        ),
        pytest.param(
            config(hook(timeoutSeconds=True)),
            ["webhooks[0].timeoutSeconds: Invalid value: true: must be an integer, not a boolean"],
            id="types: a boolean is not an integer",
        ),
        pytest.param(
            config(hook(timeoutSeconds=2.5)),
            ["webhooks[0].timeoutSeconds: Invalid value: 2.5: must be an integer, not a number"],
            id="types: a fraction is not an integer",
        ),
        pytest.param(
            config(hook(clientConfig={"service": {"namespace": "n", "name": "s", "port": 2**31}})),
            [
                "webhooks[0].clientConfig.service.port: Invalid value: 2147483648: must fit in a 32-bit integer"
            ],
            id="types: int32 fields refuse larger numbers",
        ),
        pytest.param(
            config(hook(sideEffects=["None"])),
            ["webhooks[0].sideEffects: Invalid value: must be a string, not a list"],
            id="types: a list where a string is expected, without a Required follow-on",
        ),
        pytest.param(
            config(hook(rules={"operations": ["*"]})),
            ["webhooks[0].rules: Invalid value: must be a list, not an object"],
            id="types: an object where a list is expected",
        ),
        pytest.param(
            config(hook(rules=[rule(operations=["CREATE", 7])])),
            ["webhooks[0].rules[0].operations[1]: Invalid value: 7: must be a string, not an integer"],
            id="types: a bad list element keeps later indexes in place",
        ),
        pytest.param(
            config(hook(clientConfig={"url": 443})),
            ["webhooks[0].clientConfig.url: Invalid value: 443: must be a string, not an integer"],
            id="types: a bad url type is not also reported as a missing url",
        ),
        pytest.param(
            config(hook(name=None)),
            ["webhooks[0].name: Required value"],
            id="types: null is the same as absent",
        ),
        pytest.param(
            config() | {"webhooks": ["a.b.c"]},
            ['webhooks[0]: Invalid value: "a.b.c": must be an object, not a string'],
            id="types: a webhook that is not an object",
        ),
        pytest.param(
            config() | {"webhooks": [None]},
            ["webhooks[0]: Invalid value: null: must be an object, not null"],
            id="types: a null webhook is refused",
        ),
        pytest.param(
            config() | {"metadata": "team-a"},
            [
                'metadata: Invalid value: "team-a": must be an object, not a string',
            ],
            id="types: metadata must be an object (and no Required follow-on)",
        ),
        pytest.param(
            config(hook(namespaceSelector={"matchLabels": {1: "a"}})),
            [
                "webhooks[0].namespaceSelector.matchLabels[1]: Invalid value: 1: must be a string key, not an integer"
            ],
            id="types: map keys must be strings",
        ),
    ],
)
def test_wrong_types_are_clear_errors(doc: dict[str, Any], expected: list[str]) -> None:
    """A wrongly typed value is one clear error at its path, never an exception or a cascade."""
    assert errors_of(doc) == expected


def rule(**fields: Any) -> dict[str, Any]:
    return {
        "operations": ["CREATE"],
        "apiGroups": [""],
        "apiVersions": ["v1"],
        "resources": ["pods"],
    } | fields


@pytest.mark.parametrize(
    "body",
    [
        pytest.param("just a string", id="types: a scalar document"),
        pytest.param({"apiVersion": 1, "kind": MUTATING}, id="types: a numeric apiVersion"),
        pytest.param(
            {"apiVersion": "v1", "kind": "List", "items": [None, 3, {"kind": []}]}, id="types: odd List items"
        ),
        pytest.param(config(hook()) | {"webhooks": {"a": 1}}, id="types: webhooks as an object"),
        pytest.param(config(hook(clientConfig={"url": "http://[::1"})), id="types: an unparsable IPv6 URL"),
        pytest.param(
            config(hook(clientConfig={"url": "https://a\x00.example.com"})), id="types: a control character"
        ),
    ],
)
def test_malformed_input_never_raises_anything_but_config_error(body: object) -> None:
    """Whatever the input, loading either succeeds or raises ConfigError with at least one error."""
    with pytest.raises(ConfigError) as exc:
        load_documents([("x", body)])
    assert exc.value.errors


# --- kubectl output ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("kubectl-get-mutating.yaml", id="a configuration as kubectl get -o yaml prints it"),
        pytest.param("kubectl-get-list.yaml", id="a List as kubectl get -o yaml prints it, with a Namespace"),
    ],
)
def test_kubectl_output_loads_without_warnings(name: str) -> None:
    """Server-populated fields (uid, resourceVersion, managedFields, last-applied, status …) warn about nothing."""
    snapshot = load_files([CONFIGS / name])
    assert snapshot.warnings == ()
    assert len(snapshot.validating) + len(snapshot.mutating) == 1


def test_kubectl_output_model() -> None:
    """The kubectl sample maps to the expected internal model (CFG-05)."""
    (webhook,) = load_files([CONFIGS / "kubectl-get-mutating.yaml"]).mutating
    assert webhook.identity == "sidecar-injector/inject.sidecar.example.com/0"
    assert webhook.client_config.service is not None
    assert (webhook.client_config.service.namespace, webhook.client_config.service.port) == (
        "injector-system",
        443,
    )
    assert webhook.client_config.ca_bundle.startswith(b"-----BEGIN CERTIFICATE-----")
    assert webhook.namespace_selector.matches({"injection": "enabled"})
    assert not webhook.namespace_selector.matches({})


# --- CFG-23: reporting ---------------------------------------------------------------------------


def test_cfg23_every_problem_of_every_source_is_listed(tmp_path: Path) -> None:
    """CFG-23: all problems are collected (never only the first), each with file, kind, name, path, message."""
    write(
        tmp_path,
        "team-a.yaml",
        json.dumps(
            config(
                hook("a.b.c"),
                hook("my-hook", timeoutSeconds=45),
                hook("x.y.z", failurePolicy="fail", rules=[rule(operations=["CREATE", "PATCH"])]),
                name="team-a",
            )
        ),
    )
    write(tmp_path, "team-b.yaml", json.dumps(config(hook(sideEffects=...), name="team-b", kind=VALIDATING)))
    write(tmp_path, "team-c.yaml", json.dumps(config(hook(typo=1), name="team-c")))
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path)
    a, b, c = (str(tmp_path / f"team-{x}.yaml") for x in "abc")
    assert messages(exc) == [
        f'{a}: MutatingWebhookConfiguration "team-a" webhooks[1].name: Invalid value: "my-hook": '
        "should be a domain with at least three segments separated by dots",
        f'{a}: MutatingWebhookConfiguration "team-a" webhooks[1].timeoutSeconds: Invalid value: 45: '
        "the timeout value must be between 1 and 30 seconds",
        f'{a}: MutatingWebhookConfiguration "team-a" webhooks[2].rules[0].operations[1]: Unsupported value: '
        '"PATCH": supported values: "*", "CONNECT", "CREATE", "DELETE", "UPDATE"',
        f'{a}: MutatingWebhookConfiguration "team-a" webhooks[2].failurePolicy: Unsupported value: "fail": '
        'supported values: "Fail", "Ignore"',
        f'{b}: ValidatingWebhookConfiguration "team-b" webhooks[0].sideEffects: Required value: '
        "must specify one of None, NoneOnDryRun",
        f'{c}: MutatingWebhookConfiguration "team-c" webhooks[0].typo: unknown field',
    ]
    assert [p.severity for p in exc.value.problems] == ["error"] * 5 + ["warning"]
    assert str(exc.value).count("\n") == 4  # the exception text lists the errors only


def test_cfg23_problem_fields() -> None:
    """CFG-23: a problem carries file, kind, name, path and message as separate fields."""
    (problem,) = problems_of(config(hook(timeoutSeconds=45), name="team-a"))
    assert problem == ConfigProblem(
        file="t.yaml",
        message="Invalid value: 45: the timeout value must be between 1 and 30 seconds",
        kind="MutatingWebhookConfiguration",
        name="team-a",
        path="webhooks[0].timeoutSeconds",
        severity="error",
    )


# --- directories ---------------------------------------------------------------------------------


def test_directory_reads_sorted_visible_config_files_only(tmp_path: Path) -> None:
    """Only *.yaml, *.yml and *.json files are read, in name order, skipping hidden files and subdirectories."""
    write(tmp_path, "b.yml", yaml_config("from-b"))
    write(tmp_path, "a.json", yaml_config("from-a"))
    write(tmp_path, "c.yaml", yaml_config("from-c"))
    write(tmp_path, ".hidden.yaml", "not: [valid")
    write(tmp_path, "README.md", "not: [valid")
    write(tmp_path, "notes.txt", "not: [valid")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "d.yaml", "not: [valid")
    (tmp_path / "dir.yaml").mkdir()
    snapshot = load_directory(tmp_path)
    assert [h.source for h in snapshot.mutating] == [str(tmp_path / n) for n in ("a.json", "b.yml", "c.yaml")]


def test_directory_problems_follow_file_name_order(tmp_path: Path) -> None:
    """Files are read in name order, so problems are reported in that order."""
    for name in ("z.yaml", "m.yaml", "a.yaml"):
        write(tmp_path, name, json.dumps(config(hook(timeoutSeconds=0), name=name[0])))
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path)
    assert [Path(p.file).name for p in exc.value.problems] == ["a.yaml", "m.yaml", "z.yaml"]


def test_configmap_mount_loads_each_file_once(tmp_path: Path) -> None:
    """A ConfigMap volume (..data symlink, timestamped dir, top-level symlinks) loads each file once."""
    stamp = tmp_path / "..2024_05_02_10_11_12.123456789"
    stamp.mkdir()
    write(stamp, "policy.yaml", yaml_config("policy", kind=VALIDATING))
    write(stamp, "sidecars.json", yaml_config("sidecars"))
    (tmp_path / "..data").symlink_to(stamp.name)
    for name in ("policy.yaml", "sidecars.json"):
        (tmp_path / name).symlink_to(Path("..data") / name)
    snapshot = load_directory(tmp_path)
    assert [h.identity for h in snapshot.validating] == ["policy/a.b.c/0"]
    assert [h.identity for h in snapshot.mutating] == ["sidecars/a.b.c/0"]
    assert snapshot.mutating[0].source == str(tmp_path / "sidecars.json")


def test_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    """A directory that cannot be read is a ConfigError naming it."""
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path / "nope")
    assert messages(exc) == [f"{tmp_path / 'nope'}: cannot read directory: No such file or directory"]


def test_empty_directory_is_an_empty_snapshot(tmp_path: Path) -> None:
    """An empty directory is a valid, empty configuration."""
    snapshot = load_directory(tmp_path, generation=7)
    assert (snapshot.validating, snapshot.mutating, dict(snapshot.namespaces), snapshot.generation) == (
        (),
        (),
        {},
        7,
    )


def test_not_utf8_file(tmp_path: Path) -> None:
    """A file that is not UTF-8 text is an error naming it."""
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path)
    assert messages(exc) == [f"{tmp_path / 'bin.yaml'}: not UTF-8 text: invalid start byte at byte 0"]


def test_sample_directory() -> None:
    """The sample configuration directory loads: order, defaults, namespaces, and no false GW-05 warning."""
    sample = CONFIGS / "sample"
    snapshot = load_directory(sample)
    assert [h.identity for h in snapshot.validating] == [
        "audit/audit.security.example.com/0",
        "policy/require-labels.policy.example.com/0",
        "policy/deny-exec.policy.example.com/0",
    ]
    assert [(h.identity, h.timeout_seconds, h.failure_policy) for h in snapshot.mutating] == [
        ("legacy/legacy.example.com.old/0", 30, "Ignore"),
        ("sidecars/inject.sidecars.example.com/0", 5, "Fail"),
        ("sidecars/defaults.local.example.com/0", 5, "Fail"),
    ]
    assert set(snapshot.namespaces) == {"team-a", "kube-system"}
    # GW-05: 30 + 5 + 5 s of mutating timeouts, but on pods, configmaps and jobs: no request meets two
    # of them, so nothing adds up (this warned before the overlap analysis: a false alarm).
    assert [str(w) for w in snapshot.warnings] == []


def test_self_referencing_yaml_is_an_error(tmp_path: Path) -> None:
    """A YAML alias that makes a List contain itself is reported, not looped on forever."""
    write(
        tmp_path,
        "loop.yaml",
        "apiVersion: v1\nkind: List\nitems: &a\n- apiVersion: v1\n  kind: List\n  items: *a\n",
    )
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path)
    assert messages(exc) == [
        f"{tmp_path / 'loop.yaml'}: documents[0]: the document nests too deeply (a self-referencing YAML alias?)"
    ]


def test_cfg25_one_bad_file_refuses_the_whole_set(tmp_path: Path) -> None:
    """CFG-25: loading is all or nothing: valid files beside an invalid one give no snapshot at all."""
    write(tmp_path, "a.yaml", yaml_config("good"))
    write(tmp_path, "b.yaml", json.dumps(config(hook(timeoutSeconds=99), name="bad")))
    with pytest.raises(ConfigError) as exc:
        load_directory(tmp_path)
    assert [p.name for p in exc.value.errors] == ["bad"]
