"""Loading configuration sources into one validated, immutable Snapshot (CFG-01..25, ORD-01..05).

Pipeline: sources (a directory, files, or already-parsed cluster objects) → documents (multi-document
YAML and nested ``List`` objects unwrapped, CFG-01) → per document: structural decode (``schema``:
unknown fields warn, wrong types fail) → per-version defaults (``defaults``) → validation
(``validation``) → the model and its order (``build``). Every problem of every source is collected
(CFG-23); any error refuses the whole set with ``ConfigError`` so a reload is all or nothing (CFG-25).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal

import msgspec
import yaml

from gateway.config import build, crd, defaults, model, schema, trust, types
from gateway.config.backend_policy import parse_backend_policy, policy_for
from gateway.config.fielderrors import FieldError, child, go_quote, index
from gateway.config.migration import own_registration_errors, parked_warnings
from gateway.config.validation import validate_configuration, validate_namespace
from gateway.errors import ConfigError, ConfigProblem

EXTENSIONS: Final = (".yaml", ".yml", ".json")

_CONFIG_KINDS: Final[dict[str, model.WebhookKind]] = {
    "ValidatingWebhookConfiguration": "validating",
    "MutatingWebhookConfiguration": "mutating",
}
_CONFIG_TYPES: Final[dict[str, type[types.WebhookConfiguration]]] = {
    "ValidatingWebhookConfiguration": types.ValidatingWebhookConfiguration,
    "MutatingWebhookConfiguration": types.MutatingWebhookConfiguration,
}
# Typed lists (as the API serves them) whose items may omit apiVersion and kind.
_TYPED_LISTS: Final = {
    (defaults.V1, "ValidatingWebhookConfigurationList"),
    (defaults.V1, "MutatingWebhookConfigurationList"),
    (defaults.V1BETA1, "ValidatingWebhookConfigurationList"),
    (defaults.V1BETA1, "MutatingWebhookConfigurationList"),
    ("v1", "NamespaceList"),
    (crd.V1, "CustomResourceDefinitionList"),
    (crd.V1BETA1, "CustomResourceDefinitionList"),
}
_LIST_FIELDS: Final = frozenset({"apiVersion", "kind", "metadata", "items"})
_SUPPORTED: Final = (
    "expected a ValidatingWebhookConfiguration or MutatingWebhookConfiguration of "
    "admissionregistration.k8s.io/v1 or /v1beta1, a v1 Namespace, or a List of them"
)


UNKNOWN_FIELD: Final = "unknown field"


def unknown_field_message(found: schema.UnknownField) -> str:
    """``unknown field``, with the likely intended field, and why a guarding typo is refused."""
    if not found.suggestion:
        return UNKNOWN_FIELD
    message = f"{UNKNOWN_FIELD}; did you mean {found.suggestion}?"
    if found.guarding:
        message += (
            f" (refused: without {found.suggestion} the webhook would match more, or fail differently, "
            "than written)"
        )
    return message


def _safe_loader() -> type[yaml.SafeLoader]:
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True, slots=True)
class _Document:
    source: str  # file name or cluster object label, for messages
    location: str  # "documents[1]", "documents[0].items[3]" … ("" for a single parsed object)
    body: object


@dataclass(slots=True)
class _Loader:
    """Accumulates documents' outcomes; one per load."""

    lax: bool
    strict_https: bool
    registration: bool = False  # the gateway's own registration, not backends: its marks are expected
    problems: list[ConfigProblem] = field(default_factory=list)
    accepted: list[build.Accepted] = field(default_factory=list)
    namespaces: dict[str, dict[str, str]] = field(default_factory=dict)
    first_seen: dict[tuple[str, str], str] = field(default_factory=dict)
    conversions: dict[str, model.ConversionEntry] = field(default_factory=dict)
    # MAT-10 warnings wait for the whole load: a CRD served under several versions may come later
    equivalent_checks: list[tuple[_Document, str, str, types.WebhookConfiguration]] = field(
        default_factory=list
    )
    served: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    # --- reporting ---

    def problem(
        self,
        doc: _Document,
        message: str,
        *,
        kind: str = "",
        name: str = "",
        path: str = "",
        severity: Literal["error", "warning"] = "error",
        code: str = "",
    ) -> None:
        if not kind:
            path = ".".join(p for p in (doc.location, path) if p)
        self.problems.append(ConfigProblem(doc.source, message, kind, name, path, severity, code))

    def field_problems(
        self,
        doc: _Document,
        kind: str,
        name: str,
        errors: Iterable[FieldError],
        *,
        severity: Literal["error", "warning"] = "error",
    ) -> int:
        """Report field errors; ratcheted ones become warnings for lax sources (CFG-24).

        Returns how many were reported as errors.
        """
        count = 0
        for e in errors:
            level: Literal["error", "warning"] = "warning" if (self.lax and e.ratchet) else severity
            count += level == "error"
            self.problem(doc, e.body, kind=kind, name=name, path=e.path, severity=level, code=e.code)
        return count

    def unknown_fields(
        self, doc: _Document, kind: str, name: str, unknown: Iterable[schema.UnknownField]
    ) -> int:
        """Report unknown fields: a warning each (configurations exported from a newer apiserver still
        load), an error when it misspells a selector, rule or policy field; returns the errors."""
        errors = 0
        for found in unknown:
            message = unknown_field_message(found)
            severity: Literal["error", "warning"] = "error" if found.guarding else "warning"
            errors += found.guarding
            self.problem(doc, message, kind=kind, name=name, path=found.path, severity=severity)
        return errors

    def place(self, doc: _Document) -> str:
        return f"{doc.source} ({doc.location})" if doc.location else doc.source

    def register(self, doc: _Document, kind: str, name: str) -> bool:
        """CFG-02 (and namespaces): one object per kind and name; a second is an error naming both."""
        if not name:
            return True
        first = self.first_seen.get((kind, name))
        if first is None:
            self.first_seen[(kind, name)] = self.place(doc)
            return True
        self.problem(
            doc,
            f"Duplicate value: {go_quote(name)}: a {kind} of this name is already defined in {first}",
            kind=kind,
            name=name,
            path="metadata.name",
        )
        return False

    # --- documents ---

    def add(self, doc: _Document) -> None:
        """Load one top-level document; self-referencing YAML (``&a [*a]``) cannot loop forever."""
        try:
            self.document(doc)
        except RecursionError:
            self.problem(doc, "the document nests too deeply (a self-referencing YAML alias?)")

    def document(self, doc: _Document) -> None:
        body = doc.body
        if body is None:
            return  # an empty YAML document
        if not isinstance(body, dict):
            self.problem(doc, f"expected an object, not {schema.json_type(body)}")
            return
        api_version, kind = body.get("apiVersion"), body.get("kind")
        if not isinstance(api_version, str) or not isinstance(kind, str) or not api_version or not kind:
            self.problem(doc, f"apiVersion and kind are required; {_SUPPORTED}")
        elif kind == "List" or (api_version, kind) in _TYPED_LISTS:
            self.list_document(doc, body, api_version, kind)
        elif api_version in (defaults.V1, defaults.V1BETA1) and kind in _CONFIG_KINDS:
            self.configuration(doc, body, kind)
        elif (api_version, kind) == ("v1", "Namespace"):
            self.namespace(doc, body)
        elif api_version in (crd.V1, crd.V1BETA1) and kind == crd.KIND:
            self.custom_resource_definition(doc, body)
        else:
            self.problem(
                doc, f"unsupported apiVersion {go_quote(api_version)} and kind {go_quote(kind)}: {_SUPPORTED}"
            )

    def list_document(self, doc: _Document, body: dict[object, object], api_version: str, kind: str) -> None:
        for k in body:
            if k not in _LIST_FIELDS:
                self.problem(doc, "unknown field", path=str(k), severity="warning")
        items = body.get("items")
        if items is None:
            return
        if not isinstance(items, list):
            self.problem(doc, f"must be a list, not {schema.json_type(items)}", path="items")
            return
        item_kind = kind.removesuffix("List") if kind != "List" else None
        for i, item in enumerate(items):
            typed = item
            if item_kind is not None and isinstance(item, dict):
                typed = {"apiVersion": api_version, "kind": item_kind, **item}
            self.document(_Document(doc.source, index(child(doc.location, "items"), i), typed))

    def configuration(self, doc: _Document, body: dict[object, object], kind_name: str) -> None:
        kind = _CONFIG_KINDS[kind_name]
        decoded = schema.decode(body, _CONFIG_TYPES[kind_name])
        config = decoded.value
        name = (config.metadata.name if config.metadata else None) or ""
        self.field_problems(doc, kind_name, name, decoded.errors)
        failed_fields = self.unknown_fields(doc, kind_name, name, decoded.unknown)
        config = defaults.default_configuration(config)
        findings = validate_configuration(config, strict_https=self.strict_https)
        errors = [e for e in findings.errors if not schema.suppressed(e.path, decoded.bad_paths)]
        failed = self.field_problems(doc, kind_name, name, errors) + len(decoded.errors) + failed_fields
        self.field_problems(doc, kind_name, name, findings.warnings, severity="warning")
        bundles = []
        for i, hook in enumerate(config.webhooks or ()):
            path = child(child(index("webhooks", i), "clientConfig"), "caBundle")
            ca = hook.client_config.ca_bundle if hook.client_config else None
            pem, error, warning = build.decode_ca_bundle(ca, path)
            failed += self.field_problems(doc, kind_name, name, [error] if error else [])
            self.field_problems(doc, kind_name, name, [warning] if warning else [], severity="warning")
            bundles.append(pem)
        meta = config.metadata or types.ObjectMeta()
        policy = parse_backend_policy(meta.annotations, [h.name or "" for h in config.webhooks or ()])
        failed += self.field_problems(doc, kind_name, name, policy.errors)
        self.field_problems(doc, kind_name, name, policy.warnings, severity="warning")
        if not self.registration:
            failed += self.field_problems(doc, kind_name, name, own_registration_errors(config))
        self.field_problems(doc, kind_name, name, parked_warnings(config), severity="warning")
        for i, hook in enumerate(config.webhooks or ()):
            cc = hook.client_config
            warnings = trust.ca_warnings(
                path=child(index("webhooks", i), "clientConfig"),
                has_service=cc is not None and cc.service is not None,
                ca_bundle=bundles[i],
                ca_from=policy_for(policy.annotation, hook.name or "").ca_from,
                kind=kind_name,
                config_name=name,
                annotations=meta.annotations,
            )
            self.field_problems(doc, kind_name, name, warnings, severity="warning")
        unique = self.register(doc, kind_name, name)
        if failed or not unique:
            return
        self.equivalent_checks.append((doc, kind_name, name, config))
        self.accepted.append(
            build.Accepted(
                kind, name, doc.source, config, tuple(findings.conditions), tuple(bundles), policy.annotation
            )
        )

    def namespace(self, doc: _Document, body: dict[object, object]) -> None:
        decoded = schema.decode(body, types.Namespace)
        meta = decoded.value.metadata or types.ObjectMeta()
        name = meta.name or ""
        self.field_problems(doc, "Namespace", name, decoded.errors)
        failed_fields = self.unknown_fields(doc, "Namespace", name, decoded.unknown)
        findings = validate_namespace(decoded.value)
        errors = [e for e in findings.errors if not schema.suppressed(e.path, decoded.bad_paths)]
        failed = self.field_problems(doc, "Namespace", name, errors) + len(decoded.errors) + failed_fields
        self.field_problems(doc, "Namespace", name, findings.warnings, severity="warning")
        if self.register(doc, "Namespace", name) and not failed:
            self.namespaces[name] = dict(meta.labels or {})

    def custom_resource_definition(self, doc: _Document, body: dict[object, object]) -> None:
        """CNV-02/03: a CRD whose conversion strategy is Webhook adds one conversion entry."""
        loaded = crd.load_crd(body, strict_https=self.strict_https, source=doc.source)
        for path in loaded.unknown_fields:
            self.problem(doc, "unknown field", kind=crd.KIND, name=loaded.name, path=path, severity="warning")
        failed = self.field_problems(doc, crd.KIND, loaded.name, loaded.errors)
        self.field_problems(doc, crd.KIND, loaded.name, loaded.warnings, severity="warning")
        if self.register(doc, crd.KIND, loaded.name) and not failed:
            if loaded.entry is not None:
                self.conversions[loaded.name] = loaded.entry
            if loaded.served is not None:
                plural, served = loaded.served
                known = self.served.get(plural, ())
                self.served[plural] = known + tuple(gv for gv in served if gv not in known)

    def snapshot(self, *, origin: str, generation: int) -> model.Snapshot:
        multi_version = {plural: gvs for plural, gvs in self.served.items() if len(gvs) > 1}
        for doc, kind_name, name, config in self.equivalent_checks:
            warnings = build.equivalent_warnings(config, extra=multi_version)
            self.field_problems(doc, kind_name, name, warnings, severity="warning")
        self.equivalent_checks.clear()
        if any(p.severity == "error" for p in self.problems):
            raise ConfigError(self.problems)
        snapshot = build.build_snapshot(
            self.accepted,
            self.namespaces,
            warnings=self.problems,
            origin=origin,
            generation=generation,
        )
        if not self.conversions:
            return snapshot
        return msgspec.structs.replace(snapshot, conversions=MappingProxyType(dict(self.conversions)))


# --- sources -------------------------------------------------------------------------------------


def _yaml_error(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        what = f"{exc.problem} ({exc.context})" if exc.context else exc.problem
        return f"invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {what}"
    return f"invalid YAML: {exc}"


def _read_file(path: Path, label: str) -> tuple[list[_Document], ConfigProblem | None]:
    """One file's documents, or the problem that stopped reading it."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as exc:
        return [], ConfigProblem(label, f"cannot read file: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        return [], ConfigProblem(label, f"not UTF-8 text: {exc.reason} at byte {exc.start}")
    return _parse_text(text, label, is_json=path.suffix == ".json")


def _parse_text(text: str, label: str, *, is_json: bool) -> tuple[list[_Document], ConfigProblem | None]:
    if is_json:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            return [], ConfigProblem(
                label, f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            )
        return [_Document(label, "documents[0]", body)], None
    try:
        bodies = list(yaml.load_all(text, Loader=_safe_loader()))
    except yaml.YAMLError as exc:
        return [], ConfigProblem(label, _yaml_error(exc))
    return [_Document(label, index("documents", i), b) for i, b in enumerate(bodies)], None


def _directory_files(directory: Path) -> list[Path]:
    """The configuration files of a directory: sorted, non-recursive.

    Hidden entries are skipped, which also skips the ``..data`` and ``..<timestamp>`` entries of a
    Kubernetes ConfigMap volume; its top-level symlinks (``name -> ..data/name``) are followed, so
    each file is read once.
    """
    files = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(".") or not entry.name.endswith(EXTENSIONS):
                continue
            if entry.is_file():  # follows symlinks
                files.append(Path(entry.path))
    return sorted(files, key=lambda p: p.name)


def load_files(
    paths: Iterable[str | os.PathLike[str]], *, strict_https: bool = False, generation: int = 0
) -> model.Snapshot:
    """Load the given YAML/JSON files, in the order given; raise ``ConfigError`` on any error."""
    files = [Path(p) for p in paths]
    loader = _Loader(lax=False, strict_https=strict_https)
    for path in files:
        docs, problem = _read_file(path, str(path))
        if problem is not None:
            loader.problems.append(problem)
        for doc in docs:
            loader.add(doc)
    origin = str(files[0].parent) if files else "<no files>"
    return loader.snapshot(origin=origin, generation=generation)


def load_paths(
    paths: Iterable[str], *, stdin_text: str | None = None, strict_https: bool = False, generation: int = 0
) -> model.Snapshot:
    """``check``'s inputs, in the order given: directories (their configuration files, as
    ``load_directory`` reads them), single files of any name, and ``-`` (``stdin_text``, YAML or JSON)."""
    loader = _Loader(lax=False, strict_https=strict_https)
    paths = list(paths)
    for given in paths:
        if given == "-":
            text = stdin_text or ""
            docs, problem = _parse_text(text, "<stdin>", is_json=text.lstrip().startswith(("{", "[")))
        elif os.path.isdir(given):
            try:
                files = _directory_files(Path(given))
            except OSError as exc:
                loader.problems.append(ConfigProblem(given, f"cannot read directory: {exc.strerror or exc}"))
                continue
            for file in files:
                docs, problem = _read_file(file, os.path.join(given, file.name))
                if problem is not None:
                    loader.problems.append(problem)
                for doc in docs:
                    loader.add(doc)
            continue
        else:
            docs, problem = _read_file(Path(given), given)
        if problem is not None:
            loader.problems.append(problem)
        for doc in docs:
            loader.add(doc)
    return loader.snapshot(origin=", ".join(paths) or "<nothing>", generation=generation)


def load_directory(
    path: str | os.PathLike[str], *, strict_https: bool = False, generation: int = 0
) -> model.Snapshot:
    """Load every ``*.yaml``, ``*.yml`` and ``*.json`` file of a directory (CFG-01).

    Files are read in name order, non-recursively, skipping hidden entries (ConfigMap mounts load
    each file once). Raises ``ConfigError`` listing every problem when anything is invalid.
    """
    directory = Path(path)
    try:
        files = _directory_files(directory)
    except OSError as exc:
        raise ConfigError(
            [ConfigProblem(str(path), f"cannot read directory: {exc.strerror or exc}")]
        ) from exc
    loader = _Loader(lax=False, strict_https=strict_https)
    for file in files:
        docs, problem = _read_file(file, os.path.join(path, file.name))
        if problem is not None:
            loader.problems.append(problem)
        for doc in docs:
            loader.add(doc)
    return loader.snapshot(origin=str(path), generation=generation)


def load_documents(
    docs: Iterable[tuple[str, object]],
    *,
    lax: bool = False,
    strict_https: bool = False,
    generation: int = 0,
    registration: bool = False,
) -> model.Snapshot:
    """Load already-parsed objects, each ``(source label, object)``.

    ``lax=True`` is for objects read from a live cluster (CFG-24): the apiserver's update ratchets
    are reported as warnings instead of errors. ``registration=True`` loads the gateway's own
    registration (to match reviews against it as the apiserver does), which as backends is refused.
    """
    loader = _Loader(lax=lax, strict_https=strict_https, registration=registration)
    for label, body in docs:
        loader.add(_Document(label, "", body))
    return loader.snapshot(origin="<documents>", generation=generation)


# --- the gateway's configuration, as every command reads it --------------------------------------


def empty_config_problem(source: str) -> ConfigProblem:
    """A configuration without webhooks would allow every review: refused unless asked for (B8)."""
    return ConfigProblem(
        source,
        "no webhook configurations: refusing a configuration that would allow every review "
        "(pass --allow-empty-config if that is intended)",
    )


def is_empty(snapshot: model.Snapshot) -> bool:
    return not (snapshot.validating or snapshot.mutating or snapshot.conversions)


def load_config(
    paths: str | Iterable[str],
    *,
    strict_https: bool = False,
    allow_empty: bool = False,
    stdin_text: str | None = None,
    generation: int = 0,
) -> model.Snapshot:
    """The gateway's configuration, validated once for every command: ``serve`` at start-up and at
    every reload, ``check``, ``explain`` and ``audit`` call this, so they accept and refuse the same
    inputs with the same messages.

    ``paths``: a directory (its ``*.yaml``/``*.yml``/``*.json`` files, as ``load_directory`` reads
    them), a single file of any name, or several of them (``-`` is ``stdin_text``). A configuration
    without any webhook or conversion is refused unless ``allow_empty``: it would allow every review.
    Raises ``ConfigError`` naming file, object and field of every problem.
    """
    given = [paths] if isinstance(paths, str) else list(paths)
    missing = [p for p in given if p != "-" and not os.path.exists(p)]
    if missing:
        what = "no such file or directory (expected a directory or file of webhook configurations)"
        raise ConfigError([ConfigProblem(p, what) for p in missing])
    snapshot = load_paths(given, stdin_text=stdin_text, strict_https=strict_https, generation=generation)
    if not allow_empty and is_empty(snapshot):
        raise ConfigError([*snapshot.warnings, empty_config_problem(", ".join(given))])
    return snapshot
