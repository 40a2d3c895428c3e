"""CDI names with the rules of the Go parser (`pkg/parser`), which every runtime vendors.

The SPEC prose is stricter (DNS-subdomain vendor, ≤63-character class) but runtimes enforce only
the parser's character rules, so these are the rules a name must pass to be resolvable.

Also the RFC 1123 DNS label and subdomain as Kubernetes applies them (`IsDNS1123Label`,
`IsDNS1123Subdomain`): CDI annotation keys use them, and the driver checks the Kubernetes names it
is given (node, driver, namespace, claim) with the same two functions, so there is one definition.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from cdi.errors import SpecError

DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL_RE = re.compile(_DNS_LABEL)
_DNS_SUBDOMAIN_RE = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")

_VENDOR_OR_CLASS = re.compile(r"[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?")
_DEVICE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")


def is_dns_label(value: str) -> bool:
    """Lower-case letters, digits and inner dashes, at most 63 characters (a namespace, a request)."""
    return len(value) <= DNS_LABEL_MAX and bool(_DNS_LABEL_RE.fullmatch(value))


def is_dns_subdomain(value: str, max_len: int = DNS_SUBDOMAIN_MAX) -> bool:
    """DNS labels joined by dots, at most `max_len` characters (an object name, a domain)."""
    return len(value) <= max_len and bool(_DNS_SUBDOMAIN_RE.fullmatch(value))


class QualifiedName(NamedTuple):
    vendor: str
    class_: str
    name: str

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{self.class_}"

    def __str__(self) -> str:
        return f"{self.vendor}/{self.class_}={self.name}"


def validate_vendor_name(vendor: str) -> None:
    """Letter first, letter or digit last, ``[A-Za-z0-9_.-]`` inside; a single letter is valid."""
    _check(_VENDOR_OR_CLASS, "vendor", vendor, "must start with a letter, end with a letter or digit")


def validate_class_name(class_: str) -> None:
    """Same rule as the vendor; a ``/`` (``nvidia.com/gpu/x``) lands here and fails."""
    _check(_VENDOR_OR_CLASS, "class", class_, "must start with a letter, end with a letter or digit")


def validate_device_name(name: str) -> None:
    """Letter or digit first and last, ``[A-Za-z0-9_.:-]`` inside (``:`` is allowed by the parser)."""
    _check(_DEVICE, "device name", name, "must start and end with a letter or digit")


def _check(pattern: re.Pattern[str], what: str, value: str, rule: str) -> None:
    if not value:
        raise SpecError("", f"invalid (empty) {what}")
    if not pattern.fullmatch(value):
        raise SpecError("", f"invalid {what} {value!r}: {rule}, with only letters, digits and {_inner(pattern)} inside")


def _inner(pattern: re.Pattern[str]) -> str:
    return "'_', '.', ':', '-'" if pattern is _DEVICE else "'_', '.', '-'"


def split_kind(kind: str) -> tuple[str, str]:
    """Cut a kind at its first ``/`` into (vendor, class), both non-empty; the class is not checked here."""
    vendor, sep, class_ = kind.partition("/")
    if not sep or not vendor or not class_:
        raise SpecError("", f"invalid kind {kind!r}: expected vendor/class")
    return vendor, class_


def validate_kind(kind: str) -> None:
    vendor, class_ = split_kind(kind)
    validate_vendor_name(vendor)
    validate_class_name(class_)


def qualified_name(vendor: str, class_: str, name: str) -> str:
    """The fully-qualified device ID a runtime resolves, ``vendor/class=name``; all parts validated."""
    validate_vendor_name(vendor)
    validate_class_name(class_)
    validate_device_name(name)
    return f"{vendor}/{class_}={name}"


def parse_qualified_name(device: str) -> QualifiedName:
    """Parse the way Go's ``ParseQualifiedName`` does: cut at the first ``=``, then the qualifier at the first ``/``.

    A string starting with ``/`` is a device path, never a CDI name.
    """
    if device.startswith("/"):
        raise SpecError("", f"{device!r} is a device path, not a qualified CDI device name")
    qualifier, sep, name = device.partition("=")
    if not sep or not qualifier or not name:
        raise SpecError("", f"unqualified device {device!r}: expected vendor/class=name")
    vendor, sep, class_ = qualifier.partition("/")
    if not sep:
        raise SpecError("", f"unqualified device {device!r}: missing '/' between vendor and class")
    if not class_:
        raise SpecError("", f"unqualified device {device!r}: missing class")
    validate_vendor_name(vendor)
    validate_class_name(class_)
    validate_device_name(name)
    return QualifiedName(vendor, class_, name)
