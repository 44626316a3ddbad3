"""Kubernetes' syntax for label keys and values and annotation keys, checked before any child of the job exists.

Why: a pod template's labels, annotations and nodeSelector reach the API server only inside the role's Pod, so a
label value with a space (`team: "not a label"` in the actor's template) used to be refused when the actor's pod
was created, after the job's Redis, trainer, inference and preprocessor pods already ran, and `rlkube validate`
accepted it. The API server's rules are few and fixed (docs/references.md §11); checking them at validation time
refuses the job naming the field, with nothing created.

Pure; the patterns are composed as the API server composes them.
"""

from __future__ import annotations

import re

_QNAME_CHAR = "[A-Za-z0-9]"
_QNAME_EXT_CHAR = "[-A-Za-z0-9_.]"
_QUALIFIED_NAME = re.compile(f"(?:{_QNAME_CHAR}{_QNAME_EXT_CHAR}*)?{_QNAME_CHAR}", re.ASCII)
_DNS1123_LABEL = "[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(?:\.{_DNS1123_LABEL})*", re.ASCII)
NAME_MAX = 63
"""Most characters of a qualified name's name part, and of a label value."""
PREFIX_MAX = 253
"""Most characters of a qualified name's prefix (a DNS subdomain)."""
ANNOTATIONS_MAX_BYTES = 256 * 1024
"""Most bytes of all annotation keys and values of one object together."""


def qualified_name_error(key: str) -> str | None:
    """Why `key` is not a label key (an optional DNS-subdomain prefix and '/', then a name), or None."""
    parts = key.split("/")
    if len(parts) > 2:
        return "a key is a name with an optional DNS subdomain prefix and one '/' (e.g. 'example.com/my-name')"
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            return "the prefix before '/' must not be empty"
        if len(prefix) > PREFIX_MAX:
            return f"the prefix before '/' must be at most {PREFIX_MAX} characters"
        if not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return ("the prefix before '/' must be a lowercase DNS subdomain (alphanumerics, '-' and '.', starting "
                    "and ending with an alphanumeric)")
    if not name:
        return "the name must not be empty"
    if len(name) > NAME_MAX:
        return f"the name must be at most {NAME_MAX} characters"
    if not _QUALIFIED_NAME.fullmatch(name):
        return "the name must be alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric"
    return None


def label_value_error(value: str) -> str | None:
    """Why `value` is not a label value (empty, or a qualified name's name part), or None."""
    if len(value) > NAME_MAX:
        return f"a label value must be at most {NAME_MAX} characters"
    if value and not _QUALIFIED_NAME.fullmatch(value):
        return ("a label value must be empty or alphanumerics, '-', '_' or '.', starting and ending with an "
                "alphanumeric")
    return None


def label_errors(labels: dict[str, str]) -> list[tuple[str, str]]:
    """(key, why) for each label whose key or value the API server would refuse, in key order."""
    errs = []
    for key in sorted(labels):
        why = qualified_name_error(key) or label_value_error(labels[key])
        if why:
            errs.append((key, why))
    return errs


def annotation_errors(annotations: dict[str, str]) -> list[tuple[str | None, str]]:
    """(key, why) for each annotation key the API server would refuse (it lowercases keys first), and (None, why)
    when the annotations together are too large."""
    errs: list[tuple[str | None, str]] = []
    for key in sorted(annotations):
        why = qualified_name_error(key.lower())
        if why:
            errs.append((key, why))
    size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        errs.append((None, f"keys and values together are {size} bytes; at most {ANNOTATIONS_MAX_BYTES}"))
    return errs
