"""``misat render -f pool.yaml``: the Kubernetes objects the operator makes of a RolloutPool, offline.

For review and CI (a GitOps repository's check before a merge): every RolloutPool in the given
files (``-f -``: standard input, e.g. ``kustomize build overlays/prod | misat render -f - --check``;
documents of other kinds are passed over) is validated as the operator validates it, with the same
messages naming the manifest's camelCase paths, and rendered by the operator's own renderer
(``misat_operator.render``); nothing talks to a cluster. An invalid pool is what the operator would
mark ``Stalled`` (``InvalidSpec``): here it is exit code 1 and the reason on stderr, and the other
pools are still rendered.

What the cluster fills in is marked, not invented: the owner references carry a placeholder uid,
and the admin-token Secret, which the operator creates with a random token, is left out (a comment
names it). The API server's own checks (the CRD schema and its CEL rules, quota, admission
webhooks) are not run: ``kubectl apply --dry-run=server`` does those.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from misat_operator.render import PoolRef, render

from .localpool import PoolError, pool_of, yaml_error

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
"""The owner references' uid (the API server assigns the pool's)."""
PLACEHOLDER_TOKEN = "not-rendered"
"""What the renderer gets for the admin token: it lands only in the Secret, which is not printed."""
DEFAULT_NAMESPACE = "default"
"""Where a manifest without ``metadata.namespace`` goes, as with ``kubectl apply``."""


class ReviewDumper(yaml.SafeDumper):
    """Multi-line strings (the router's config, HAProxy's) as literal blocks, readable in a review
    (and in the renderer's golden files, tests/operator/golden/)."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


ReviewDumper.add_representer(str, _str)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="misat render", description=__doc__.split("\n\n")[0])
    ap.add_argument("-f", "--filename", action="append", required=True,
                    help="a file of manifests, '-' for standard input (repeatable); every RolloutPool in it")
    ap.add_argument("-n", "--namespace", default=None,
                    help=f"namespace of a manifest without one (default: {DEFAULT_NAMESPACE})")
    ap.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml",
                    help="a YAML stream (with a comment per manifest) or a JSON List (default: yaml)")
    ap.add_argument("--cluster-domain", default="cluster.local",
                    help="DNS suffix of Service names (default: cluster.local)")
    ap.add_argument("--check", action="store_true", help="validate and render, print only one line per pool")
    return ap


def pools(source: str) -> Iterator[tuple[str, dict[str, Any]] | PoolError]:
    """(where, document) of every RolloutPool in ``source``, or the PoolError that stops it."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        yield PoolError(f"cannot read {source}: {exc.strerror or exc}")
        return
    name = "<stdin>" if source == "-" else source
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        yield PoolError(yaml_error(name, exc))
        return
    found = 0
    for i, doc in enumerate(docs):
        if isinstance(doc, dict) and doc.get("kind") == "RolloutPool":
            found += 1
            yield (name if len(docs) == 1 else f"{name} (document {i + 1})", doc)
    if not found:
        yield PoolError(f"{name}: no RolloutPool in it")


def render_pool(
    where: str, doc: dict[str, Any], namespace: str | None, cluster_domain: str
) -> tuple[PoolRef, list[dict[str, Any]]]:
    """The pool's identity and its objects but the Secret; PoolError with the operator's reason."""
    name, spec = pool_of(doc, where)  # a metadata that is not a mapping has no name: refused there
    meta = doc["metadata"]
    # The API server sets metadata.generation; a manifest rendered before applying is generation 1.
    generation = meta.get("generation")
    ref = PoolRef(name, str(meta.get("namespace") or namespace or DEFAULT_NAMESPACE), PLACEHOLDER_UID,
                  generation if isinstance(generation, int) and generation > 0 else 1)
    try:
        desired = render(spec, ref, PLACEHOLDER_TOKEN, cluster_domain)
    except ValueError as exc:
        raise PoolError(f"{where}: invalid RolloutPool {name!r}: {exc}") from None
    return ref, [o for o in desired.objects() if o is not desired.secret]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    failed = False
    documents: list[str] = []
    items: list[dict[str, Any]] = []
    for source in args.filename:
        for found in pools(source):
            try:
                if isinstance(found, PoolError):
                    raise found
                where, doc = found
                ref, objects = render_pool(where, doc, args.namespace, args.cluster_domain)
            except PoolError as exc:
                print(f"misat render: {exc}", file=sys.stderr)
                failed = True
                continue
            if args.check:
                print(f"{where}: RolloutPool {ref.namespace}/{ref.name} is valid ({len(objects)} objects)")
            elif args.output == "json":
                items.extend(objects)
            else:
                note = (f"# RolloutPool {ref.namespace}/{ref.name} ({where}). Not shown: the Secret "
                        f"{ref.names.admin_secret}, which the operator creates with a random admin token.\n")
                documents.append(note + "".join("---\n" + yaml.dump(o, Dumper=ReviewDumper, sort_keys=False)
                                                for o in objects))
    if items:
        documents.append(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2) + "\n")
    if documents:
        sys.stdout.write("\n".join(documents))
    return 1 if failed else 0
