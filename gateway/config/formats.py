"""String formats of the Kubernetes API (apimachinery ``util/validation``), with upstream's texts.

Each ``is_*`` function returns the list of problems (empty when the value is fine), exactly as
upstream's ``IsDNS1123Subdomain`` & co. do, so callers can build field errors from them.
"""

from __future__ import annotations

import re

_DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN_FMT = _DNS1123_LABEL_FMT + "(\\." + _DNS1123_LABEL_FMT + ")*"
_DNS1035_LABEL_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_KEY_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE_FMT = "(" + _LABEL_KEY_FMT + ")?"

_DNS1123_LABEL = re.compile(_DNS1123_LABEL_FMT)
_DNS1123_SUBDOMAIN = re.compile(_DNS1123_SUBDOMAIN_FMT)
_DNS1035_LABEL = re.compile(_DNS1035_LABEL_FMT)
_LABEL_KEY = re.compile(_LABEL_KEY_FMT)
_LABEL_VALUE = re.compile(_LABEL_VALUE_FMT)

_DNS1123_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character"
)
_DNS1123_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character"
)
_DNS1035_LABEL_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
    "start with an alphabetic character, and end with an alphanumeric character"
)
_LABEL_KEY_MSG = (
    "must consist of alphanumeric characters, '-', '_' or '.', "
    "and must start and end with an alphanumeric character"
)
_LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
    "and must start and end with an alphanumeric character"
)


def regex_error(message: str, fmt: str, *examples: str) -> str:
    """upstream: util/validation RegexError (its odd spacing included)."""
    if not examples:
        return f"{message} (regex used for validation is '{fmt}')"
    message += " (e.g. "
    for i, example in enumerate(examples):
        if i > 0:
            message += " or "
        message += f"'{example}', "
    return message + f"regex used for validation is '{fmt}')"


def _max_len_characters(length: int) -> str:
    return f"must be no more than {length} characters"


def _max_len_bytes(length: int) -> str:
    # upstream: api/validate/content MaxLenError (label keys and values moved there and say "bytes")
    return f"must be no more than {length} bytes"


def _byte_len(value: str) -> int:
    return len(value.encode())


def is_dns1123_label(value: str) -> list[str]:
    """DNS-1123 label: ≤63 characters, ``[a-z0-9]([-a-z0-9]*[a-z0-9])?``."""
    errors = []
    if _byte_len(value) > 63:
        errors.append(_max_len_characters(63))
    if not _DNS1123_LABEL.fullmatch(value):
        if _DNS1123_SUBDOMAIN.fullmatch(value):
            errors.append("must not contain dots")
        else:
            errors.append(regex_error(_DNS1123_LABEL_MSG, _DNS1123_LABEL_FMT, "my-name", "123-abc"))
    return errors


def is_dns1123_subdomain(value: str) -> list[str]:
    """DNS-1123 subdomain: ≤253 characters, dot-separated DNS-1123 labels."""
    errors = []
    if _byte_len(value) > 253:
        errors.append(_max_len_characters(253))
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        errors.append(regex_error(_DNS1123_SUBDOMAIN_MSG, _DNS1123_SUBDOMAIN_FMT, "example.com"))
    return errors


def is_dns1035_label(value: str) -> list[str]:
    """DNS-1035 label: ≤63 characters, starting with a letter."""
    errors = []
    if _byte_len(value) > 63:
        errors.append(_max_len_characters(63))
    if not _DNS1035_LABEL.fullmatch(value):
        errors.append(regex_error(_DNS1035_LABEL_MSG, _DNS1035_LABEL_FMT, "my-name", "abc-123"))
    return errors


def is_qualified_name(value: str) -> list[str]:
    """A qualified name (label key): optional DNS-1123-subdomain prefix and ``/``, then a name."""
    errors: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            errors.extend("prefix part " + m for m in is_dns1123_subdomain(prefix))
    else:
        return [
            "a valid label key "
            + regex_error(_LABEL_KEY_MSG, _LABEL_KEY_FMT, "MyName", "my.name", "123-abc")
            + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"
        ]
    if not name:
        errors.append("name part must be non-empty")
    elif _byte_len(name) > 63:
        errors.append("name part " + _max_len_bytes(63))
    if not _LABEL_KEY.fullmatch(name):
        errors.append(
            "name part " + regex_error(_LABEL_KEY_MSG, _LABEL_KEY_FMT, "MyName", "my.name", "123-abc")
        )
    return errors


def is_label_value(value: str) -> list[str]:
    """A label value: empty, or ≤63 characters of ``[A-Za-z0-9._-]`` starting and ending alphanumeric."""
    errors = []
    if _byte_len(value) > 63:
        errors.append(_max_len_bytes(63))
    if not _LABEL_VALUE.fullmatch(value):
        errors.append(regex_error(_LABEL_VALUE_MSG, _LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errors
