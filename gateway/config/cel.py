"""CEL match conditions, load-time half (CFG-22): parse and check expressions once per configuration.

Contract used by the loader and by matching:
- ``compile_condition(name, expression) -> CompiledCondition`` never raises; a compile problem is in
  ``CompiledCondition.error`` (the loader turns it into a CFG-22 error, or a CFG-24 warning for
  cluster sources).
- evaluation lives in ``gateway.matching.conditions``; ``program`` is the parsed celpy AST.

cel-python (``celpy``) only parses; it has no type checker. So that configurations fail at load where
upstream's checker would refuse them, a small static pass here rejects undeclared identifiers and
functions (GW-12: a CEL library the engine lacks is a compile error), unknown ``request`` fields, and
expressions whose result type is known not to be ``bool`` (including ``dyn``, as upstream does:
``object`` and ``oldObject`` are ``dyn``). Where the type cannot be told, the expression is accepted and
a non-boolean result is an evaluation error instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Final, TypeAlias

import lark

Tree: TypeAlias = lark.Tree[lark.Token]

VARIABLES: Final = frozenset({"object", "oldObject", "request", "authorizer", "namespaceObject"})
"""The webhook CEL environment (CFG-22, MAT-25); no ``params``."""

_MACROS: Final = frozenset({"all", "exists", "exists_one", "map", "filter"})
_BOOL_FUNCTIONS: Final = frozenset({"has", "startsWith", "endsWith", "contains", "matches"})
_TYPE_NAMES: Final = {
    "bool": "bool",
    "bytes": "bytes",
    "double": "double",
    "int": "int",
    "uint": "uint",
    "string": "string",
    "list": "list(dyn)",
    "map": "map(dyn, dyn)",
    "null_type": "null_type",
    "type": "type",
    "duration": "google.protobuf.Duration",
    "timestamp": "google.protobuf.Timestamp",
    "dyn": "dyn",
}
_INT_FUNCTIONS: Final = frozenset(
    {
        "size",
        "getDate",
        "getDayOfMonth",
        "getDayOfWeek",
        "getDayOfYear",
        "getFullYear",
        "getHours",
        "getMilliseconds",
        "getMinutes",
        "getMonth",
        "getSeconds",
    }
)
_LITERAL_TYPES: Final = {
    "INT_LIT": "int",
    "UINT_LIT": "uint",
    "FLOAT_LIT": "double",
    "STRING_LIT": "string",
    "MLSTRING_LIT": "string",
    "BYTES_LIT": "bytes",
    "BOOL_LIT": "bool",
    "NULL_LIT": "null_type",
}

# upstream: apiserver/pkg/cel/library/authz.go (only so that such expressions compile; MAT-29)
_AUTHORIZER: Final = "kubernetes.authorization.Authorizer"
_PATH_CHECK: Final = "kubernetes.authorization.PathCheck"
_GROUP_CHECK: Final = "kubernetes.authorization.GroupCheck"
_RESOURCE_CHECK: Final = "kubernetes.authorization.ResourceCheck"
_DECISION: Final = "kubernetes.authorization.Decision"
_AUTHZ_METHODS: Final[Mapping[tuple[str, str], str]] = {
    (_AUTHORIZER, "path"): _PATH_CHECK,
    (_AUTHORIZER, "group"): _GROUP_CHECK,
    (_AUTHORIZER, "serviceAccount"): _AUTHORIZER,
    (_GROUP_CHECK, "resource"): _RESOURCE_CHECK,
    (_RESOURCE_CHECK, "subresource"): _RESOURCE_CHECK,
    (_RESOURCE_CHECK, "namespace"): _RESOURCE_CHECK,
    (_RESOURCE_CHECK, "name"): _RESOURCE_CHECK,
    (_RESOURCE_CHECK, "fieldSelector"): _RESOURCE_CHECK,
    (_RESOURCE_CHECK, "labelSelector"): _RESOURCE_CHECK,
    (_RESOURCE_CHECK, "check"): _DECISION,
    (_PATH_CHECK, "check"): _DECISION,
    (_DECISION, "allowed"): "bool",
    (_DECISION, "errored"): "bool",
    (_DECISION, "reason"): "string",
    (_DECISION, "error"): "string",
}
# upstream: admission/plugin/cel/compile.go BuildRequestType
_GVK: Final = "kubernetes.GroupVersionKind"
_GVR: Final = "kubernetes.GroupVersionResource"
_USER_INFO: Final = "kubernetes.UserInfo"
_REQUEST: Final = "kubernetes.AdmissionRequest"
_OBJECT_TYPES: Final[Mapping[str, Mapping[str, str]]] = {
    _GVK: {"group": "string", "version": "string", "kind": "string"},
    _GVR: {"group": "string", "version": "string", "resource": "string"},
    _USER_INFO: {
        "username": "string",
        "uid": "string",
        "groups": "list(string)",
        "extra": "map(string, list(string))",
    },
    _AUTHORIZER: {"requestResource": _RESOURCE_CHECK},
    _REQUEST: {
        "kind": _GVK,
        "resource": _GVR,
        "subResource": "string",
        "requestKind": _GVK,
        "requestResource": _GVR,
        "requestSubResource": "string",
        "name": "string",
        "namespace": "string",
        "operation": "string",
        "userInfo": _USER_INFO,
        "dryRun": "bool",
        "options": "dyn",
    },
}
_VARIABLE_TYPES: Final = {"object": "dyn", "oldObject": "dyn", "request": _REQUEST, "authorizer": _AUTHORIZER}

_UNKNOWN: Final = ""  # a type this pass cannot tell: accepted, checked at evaluation


@dataclass(frozen=True, slots=True)
class CompiledCondition:
    """One ``matchConditions[]`` entry: the parsed program, or why it does not compile."""

    name: str
    expression: str
    program: object | None = field(default=None, compare=False, repr=False)
    error: str | None = None
    uses_authorizer: bool = False
    variables: frozenset[str] = frozenset()  # the declared variables it names (decode only those)


class _CompileError(Exception):
    def __init__(self, message: str, token: lark.Token | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.token = token


@cache
def _environment() -> object:
    import celpy  # deferred: importing celpy builds its lark parser (~100 ms)

    return celpy.Environment()


def compile_condition(name: str, expression: str) -> CompiledCondition:
    """Compile one expression in the webhook CEL environment (CFG-22); never raises."""
    import celpy
    from celpy.celparser import CELParseError

    env = _environment()
    assert isinstance(env, celpy.Environment)
    if not expression.strip():
        return CompiledCondition(
            name=name, expression=expression, error="compilation failed: empty expression"
        )
    try:
        ast = env.compile(expression)
    except CELParseError as exc:
        where = f"{exc.line}:{exc.column}" if exc.line is not None else "1:1"
        snippet = (str(exc.args[0]) if exc.args else "").rstrip("\n").replace("\n", "\n | ")
        error = f"compilation failed: ERROR: <input>:{where}: Syntax error\n | {snippet}"
        return CompiledCondition(name=name, expression=expression, error=error)
    checker = _Checker()
    try:
        result_type = checker.type_of(ast, frozenset())
    except _CompileError as exc:
        return CompiledCondition(name=name, expression=expression, error=_located(exc, expression))
    if result_type not in ("bool", _UNKNOWN):
        return CompiledCondition(
            name=name, expression=expression, error=f"must evaluate to bool but got {result_type}"
        )
    return CompiledCondition(
        name=name,
        expression=expression,
        program=ast,
        uses_authorizer="authorizer" in checker.variables,
        variables=frozenset(checker.variables),
    )


def _located(exc: _CompileError, expression: str) -> str:
    # cel-go's issue format: "ERROR: <input>:line:col: message" followed by the line and a caret
    token = exc.token
    if token is None or token.line is None or token.column is None:
        return f"compilation failed: ERROR: <input>:1:1: {exc.message}"
    line_text = expression.splitlines()[token.line - 1] if expression else ""
    caret = " " * (token.column - 1) + "^"
    return (
        f"compilation failed: ERROR: <input>:{token.line}:{token.column}: {exc.message}\n"
        f" | {line_text}\n | {caret}"
    )


def _list_of(element: str) -> str:
    return f"list({element or 'dyn'})"


def _element_of(list_type: str) -> str:
    if list_type.startswith("list(") and list_type.endswith(")"):
        return list_type[5:-1]
    return "dyn" if list_type == "dyn" else _UNKNOWN


def _value_of(map_type: str) -> str:
    if map_type.startswith("map(") and map_type.endswith(")"):
        inner = map_type[4:-1]
        depth = 0
        for i, ch in enumerate(inner):
            depth += ch == "("
            depth -= ch == ")"
            if ch == "," and depth == 0:
                return inner[i + 1 :].strip()
    return "dyn" if map_type == "dyn" else _UNKNOWN


def _join(a: str, b: str) -> str:
    if a == b:
        return a
    if "dyn" in (a, b):
        return "dyn"
    return _UNKNOWN


class _Checker:
    """Infers result types over celpy's lark tree, as far as can be told without schemas."""

    def __init__(self) -> None:
        self.variables: set[str] = set()

    def type_of(self, node: Tree | lark.Token, scope: frozenset[str]) -> str:
        if isinstance(node, lark.Token):
            return _UNKNOWN
        kind = node.data
        children = node.children
        if kind in ("expr",):
            if len(children) == 3:
                self.type_of(children[0], scope)
                return _join(self.type_of(children[1], scope), self.type_of(children[2], scope))
            return self.type_of(children[0], scope)
        if kind in ("conditionalor", "conditionaland"):
            for child in children:
                self.type_of(child, scope)
            return "bool" if len(children) == 2 else self.type_of(children[0], scope)
        if kind == "relation":
            if len(children) == 2:
                op = children[0]
                assert isinstance(op, lark.Tree)
                self.type_of(op.children[0], scope)
                self.type_of(children[1], scope)
                return "bool"
            return self.type_of(children[0], scope)
        if kind in ("addition", "multiplication"):
            if len(children) == 2:
                op = children[0]
                assert isinstance(op, lark.Tree)
                return _join(self.type_of(op.children[0], scope), self.type_of(children[1], scope)) or "dyn"
            return self.type_of(children[0], scope)
        if kind == "unary":
            if len(children) == 2:
                op = children[0]
                operand = self.type_of(children[1], scope)
                assert isinstance(op, lark.Tree)
                return "bool" if op.data == "unary_not" else operand
            return self.type_of(children[0], scope)
        if kind in ("member", "primary", "paren_expr"):
            return self.type_of(children[0], scope)
        if kind == "literal":
            token = children[0]
            assert isinstance(token, lark.Token)
            return _LITERAL_TYPES.get(token.type, _UNKNOWN)
        if kind == "ident":
            return self._ident(children[0], scope)
        if kind == "member_dot":
            return self._member_dot(children, scope)
        if kind == "member_index":
            target = self.type_of(children[0], scope)
            index = children[1]
            self.type_of(index, scope)
            if target == "dyn":
                return "dyn"
            if target.startswith("list("):
                return _element_of(target)
            if target.startswith("map("):
                return _value_of(target)
            return _UNKNOWN
        if kind == "ident_arg":
            return self._call(None, children, scope)
        if kind == "member_dot_arg":
            return self._call(children[0], children[1:], scope)
        if kind == "list_lit":
            types = {self.type_of(c, scope) for c in self._exprs(children)}
            return _list_of(types.pop() if len(types) == 1 else "dyn")
        if kind == "map_lit":
            for child in self._exprs(children):
                self.type_of(child, scope)
            return "map(dyn, dyn)"
        if kind in ("dot_ident", "dot_ident_arg", "member_object"):
            first = next(iter(node.scan_values(lambda v: isinstance(v, lark.Token))), None)
            raise _CompileError(
                "message types and qualified names are not supported",
                first if isinstance(first, lark.Token) else None,
            )
        for child in children:
            self.type_of(child, scope)
        return _UNKNOWN

    @staticmethod
    def _exprs(children: list[Tree | lark.Token]) -> list[Tree | lark.Token]:
        out: list[Tree | lark.Token] = []
        for child in children:
            if isinstance(child, lark.Tree) and child.data in ("exprlist", "mapinits"):
                out.extend(child.children)
            elif child is not None:
                out.append(child)
        return out

    def _ident(self, token: Tree | lark.Token, scope: frozenset[str]) -> str:
        assert isinstance(token, lark.Token)
        name = str(token)
        if name in scope:
            return _UNKNOWN
        if name in VARIABLES:
            self.variables.add(name)
            return _VARIABLE_TYPES.get(name, _UNKNOWN)
        if name in _TYPE_NAMES:
            return "type"
        raise _CompileError(f"undeclared reference to '{name}' (in container '')", token)

    def _member_dot(self, children: list[Tree | lark.Token], scope: frozenset[str]) -> str:
        target = self.type_of(children[0], scope)
        field_token = children[1]
        assert isinstance(field_token, lark.Token)
        fields = _OBJECT_TYPES.get(target)
        if fields is not None:
            field_type = fields.get(str(field_token))
            if field_type is None:
                raise _CompileError(f"undefined field '{field_token}'", field_token)
            return field_type
        if target == "dyn":
            return "dyn"
        if target.startswith("map("):
            return _value_of(target)
        return _UNKNOWN

    def _call(
        self,
        target: Tree | lark.Token | None,
        rest: list[Tree | lark.Token],
        scope: frozenset[str],
    ) -> str:
        name_token = rest[0]
        assert isinstance(name_token, lark.Token)
        name = str(name_token)
        args = self._exprs(rest[1:])
        if target is not None and name in _MACROS:
            target_type = self.type_of(target, scope)
            if not args or not _is_simple_ident(args[0]):
                raise _CompileError(f"{name}() argument must be a simple name", name_token)
            inner = scope | {_simple_ident(args[0])}
            body = [self.type_of(arg, inner) for arg in args[1:]]
            if name in ("all", "exists", "exists_one"):
                return "bool"
            if name == "filter":
                return target_type if target_type.startswith("list(") else _list_of("dyn")
            return _list_of(body[-1] if body else "dyn")
        target_type = self.type_of(target, scope) if target is not None else _UNKNOWN
        for arg in args:
            self.type_of(arg, scope)
        authz_result = _AUTHZ_METHODS.get((target_type, name))
        if authz_result is not None:
            return authz_result
        if name in _BOOL_FUNCTIONS:
            return "bool"
        if name in _INT_FUNCTIONS:
            return "int"
        if name in _TYPE_NAMES:
            return "type" if name == "type" else _TYPE_NAMES[name]
        raise _CompileError(f"undeclared reference to '{name}' (in container '')", name_token)


def _is_simple_ident(node: Tree | lark.Token) -> bool:
    return _simple_ident(node) != ""


def _simple_ident(node: Tree | lark.Token) -> str:
    while isinstance(node, lark.Tree):
        if node.data == "ident":
            token = node.children[0]
            return str(token)
        if len(node.children) != 1:
            return ""
        node = node.children[0]
    return ""
