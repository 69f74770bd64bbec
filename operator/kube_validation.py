"""What the Kubernetes API server refuses in the fields a RolloutPool hands to its children, as pure checks.

The CRD schema and CEL cannot express all of it (quantities compared across
keys, names checked against the rules of a kind they will become), and an
object the API server refuses half-way through a reconcile leaves the pool
half applied. So the operator checks before the first write, with the rules
of ``k8s.io/apimachinery`` validation (``IsDNS1035Label``, ``IsDNS1123Subdomain``,
``IsQualifiedName``, ``IsValidLabelValue``, resource quantities) and of
``ValidateResourceRequirements``, ``ValidateTolerations``, ``ValidateEnv``.
Every function returns the problem as a sentence, or None.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation

DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A Service name (and any DNS-1035 label): starts with a letter."""
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""Deployment, ConfigMap, Secret, PodDisruptionBudget names; service accounts, priority classes."""
LABEL_MAX = 63
SUBDOMAIN_MAX = 253
QUALIFIED_NAME = r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
ENV_VAR_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
"""The strict rule (every API server version); 1.30+ may relax it behind a feature gate."""
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"
"""A ConfigMap or Secret key (``secretKeyRef.key``)."""
QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""A resource.Quantity string (the pattern Kubernetes' own generated CRDs carry)."""
TOTAL_ANNOTATION_BYTES = 256 * 1024
"""``TotalAnnotationSizeLimitB``: keys plus values of one object's annotations."""
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PREFIX = "hugepages-"

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}
_QUANTITY_RE = re.compile(QUANTITY)


def dns1035_label(value: str) -> str | None:
    if len(value) > LABEL_MAX:
        return f"must be no more than {LABEL_MAX} characters"
    if not re.match(DNS1035_LABEL, value):
        return ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
                "start with an alphabetic character, and end with an alphanumeric character")
    return None


def dns1123_label(value: str) -> str | None:
    if len(value) > LABEL_MAX:
        return f"must be no more than {LABEL_MAX} characters"
    if not re.match(DNS1123_LABEL, value):
        return ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
                "and must start and end with an alphanumeric character")
    return None


def dns1123_subdomain(value: str) -> str | None:
    if len(value) > SUBDOMAIN_MAX:
        return f"must be no more than {SUBDOMAIN_MAX} characters"
    if not re.match(DNS1123_SUBDOMAIN, value):
        return ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                "'-' or '.', and must start and end with an alphanumeric character")
    return None


def qualified_name(value: str) -> str | None:
    """A label or annotation key: ``[prefix/]name``, prefix a DNS subdomain, name at most 63."""
    prefix, _, name = value.rpartition("/")
    if "/" in value and not prefix:
        return "prefix part must be non-empty"
    if prefix and (problem := dns1123_subdomain(prefix)):
        return f"prefix part {problem}"
    if not name:
        return "name part must be non-empty"
    if len(name) > LABEL_MAX:
        return f"name part must be no more than {LABEL_MAX} characters"
    if not re.match(QUALIFIED_NAME, name):
        return ("name part must consist of alphanumeric characters, '-', '_' or '.', "
                "and must start and end with an alphanumeric character")
    return None


def label_value(value: str) -> str | None:
    if len(value) > LABEL_MAX:
        return f"must be no more than {LABEL_MAX} characters"
    if not re.match(LABEL_VALUE, value):
        return ("a valid label value must be empty or consist of alphanumeric characters, '-', '_' or '.', "
                "and must start and end with an alphanumeric character")
    return None


def parse_quantity(value: int | float | str) -> Decimal:
    """A resource quantity as a number (``"2Gi"`` -> 2147483648); ValueError when not a quantity."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, int | float):
        return Decimal(str(value))
    text = value.strip() if isinstance(value, str) else ""
    if not text or text != value or not _QUANTITY_RE.match(text):
        raise ValueError(f"{value!r} is not a quantity (e.g. 500m, 2, 16Gi, 1e3)")
    for suffix, factor in _BINARY.items():
        if text.endswith(suffix):
            return Decimal(text[: -len(suffix)]) * factor
    match = re.match(r"^(.*?)([eE][-+]?[0-9.]+)$", text)
    if match and not text[-1:].isalpha():
        try:
            return Decimal(match.group(1)) * Decimal(10) ** Decimal(match.group(2)[1:])
        except InvalidOperation:
            raise ValueError(f"{value!r} is not a quantity") from None
    suffix = text[-1] if text[-1].isalpha() else ""
    return Decimal(text[: len(text) - len(suffix)]) * _DECIMAL[suffix]


def _is_extended(resource: str) -> bool:
    """Extended resources (``nvidia.com/gpu``) cannot be overcommitted: integer, request == limit."""
    if resource.startswith(HUGEPAGES_PREFIX):
        return False
    return "/" in resource and not resource.split("/", 1)[0].endswith("kubernetes.io")


def resource_name(resource: str) -> str | None:
    if resource in STANDARD_RESOURCES or resource.startswith(HUGEPAGES_PREFIX):
        return None
    if "/" not in resource:
        return (f"{resource!r} is not a standard resource ({', '.join(STANDARD_RESOURCES)}, hugepages-<size>) "
                "and not fully qualified (e.g. nvidia.com/gpu)")
    return qualified_name(resource)


def resource_requirements(
    limits: Mapping[str, int | float | str], requests: Mapping[str, int | float | str]
) -> list[tuple[str, str]]:
    """Problems as (``limits.<name>`` or ``requests.<name>``, sentence), as the API server words them."""
    problems: list[tuple[str, str]] = []
    parsed: dict[str, dict[str, Decimal]] = {"limits": {}, "requests": {}}
    for kind, values in (("limits", limits), ("requests", requests)):
        for name, raw in values.items():
            where = f"{kind}.{name}"
            if problem := resource_name(name):
                problems.append((where, problem))
                continue
            try:
                quantity = parse_quantity(raw)
            except ValueError as exc:
                problems.append((where, str(exc)))
                continue
            if quantity < 0:
                problems.append((where, "must be greater than or equal to 0"))
            elif _is_extended(name) and quantity != quantity.to_integral_value():
                problems.append((where, "must be a whole number (extended resources are not divisible)"))
            else:
                parsed[kind][name] = quantity
    for name, request in parsed["requests"].items():
        limit = parsed["limits"].get(name)
        if limit is None:
            if _is_extended(name) or name.startswith(HUGEPAGES_PREFIX):
                problems.append((f"requests.{name}", "a request needs an equal limit (this resource cannot be "
                                 "overcommitted)"))
            continue
        if request > limit:
            problems.append((f"requests.{name}", f"must be less than or equal to the {name} limit of "
                             f"{limits[name]}"))
        elif _is_extended(name) and request != limit:
            problems.append((f"requests.{name}", f"must equal its limit {limits[name]} (extended resources "
                             "cannot be overcommitted)"))
    return problems


def annotations_size(annotations: Mapping[str, str]) -> int:
    return sum(len(k) + len(v) for k, v in annotations.items())
