"""A compressed radix tree shared by many engines, as the vLLM Router's ``cache_aware`` keeps.

Algorithm. Edges hold runs of symbols (token ids in a tuple, or the characters
of a ``str``); a node's children are keyed by the first symbol of their edge.
Each node records, per engine, the last time that engine's prompt passed
through it. Inserting a prompt for an engine stamps every node on its path
(splitting an edge where the prompt diverges or ends inside it), so an engine
holding a node also holds all of that node's ancestors. That invariant lets
``match`` read every engine's matched length off the one path the prompt
takes: the cost is the prompt's length plus the engines on that path, never
the size of the tree.

Size. An engine's size is the total length of the edges it holds (tokens for
token-id trees, characters for text trees), which is what the vLLM Router's
``max_tree_size`` bounds. ``evict(max_size)`` removes, for each engine above
the bound, that engine's least-recently-used leaves (nodes it holds with no
child it holds) until it fits; a node that no engine holds is dropped. Ties in
access time break by the order the sweep met the leaves, which is stable.

Differences from the vLLM Router's ``tree.rs`` (which this re-implements, not
copies): time is the caller's ``now``, not a global counter; insert stamps the
whole path with ``now`` (the current Rust source stamps only the last node and
gives newly joined interior nodes time 0); a match never touches access times
(the Rust match refreshes them), so matching stays pure. Holders of a node
keep the order they joined it, which is the order the router's cached
``last_tenant`` picks from.

Knobs: none; the bound is passed to ``evict``.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

S = TypeVar("S", tuple[int, ...], str)

_CHUNK = 64
"""Symbols compared per slice when looking for where two runs diverge (speed only)."""


def _common_prefix(a: Sequence[Hashable], a_start: int, b: Sequence[Hashable]) -> int:
    """Length of the common prefix of ``a[a_start:]`` and ``b``, comparing slices in C."""
    limit = min(len(a) - a_start, len(b))
    n = 0
    while n + _CHUNK <= limit and a[a_start + n : a_start + n + _CHUNK] == b[n : n + _CHUNK]:
        n += _CHUNK
    while n < limit and a[a_start + n] == b[n]:
        n += 1
    return n


class _Node(Generic[S]):
    __slots__ = ("access", "children", "edge", "parent")

    def __init__(self, edge: S, parent: _Node[S] | None) -> None:
        self.edge: S = edge
        self.parent: _Node[S] | None = parent
        self.children: dict[Hashable, _Node[S]] = {}
        # engine id -> last access time; insertion order is the order engines joined.
        self.access: dict[str, float] = {}


class RadixTree(Generic[S]):
    """Prefixes per engine; ``match`` is pure, the rest mutate."""

    def __init__(self, empty: S) -> None:
        self._empty: S = empty
        self._root: _Node[S] = _Node(empty, None)
        self._size: dict[str, int] = {}

    # ---- reading --------------------------------------------------------

    def match(self, seq: S) -> dict[str, int]:
        """Matched prefix length of ``seq`` per engine (engines matching nothing are absent).

        Ordered deepest first; engines that match equally long appear in the
        order they joined the node where their match ends (the vLLM Router
        routes a cache hit to the earliest of them).
        """
        path: list[tuple[_Node[S], int]] = []
        node = self._root
        depth = 0
        while depth < len(seq):
            child = node.children.get(seq[depth])
            if child is None:
                break
            shared = _common_prefix(seq, depth, child.edge)
            depth += shared
            path.append((child, depth))
            if shared < len(child.edge):
                break
            node = child
        out: dict[str, int] = {}
        for child, reached in reversed(path):
            for engine in child.access:
                if engine not in out:
                    out[engine] = reached
        return out

    def size(self, engine_id: str) -> int:
        """Symbols (tokens or characters) this engine holds in the tree."""
        return self._size.get(engine_id, 0)

    def sizes(self) -> dict[str, int]:
        return dict(self._size)

    def engines(self) -> list[str]:
        return sorted(self._size)

    def node_count(self) -> int:
        return sum(1 for _ in self._walk()) - 1

    # ---- learning -------------------------------------------------------

    def insert(self, seq: S, engine_id: str, now: float) -> None:
        """Record that ``engine_id`` now holds ``seq``; stamps its whole path with ``now``."""
        self._size.setdefault(engine_id, 0)
        node = self._root
        depth = 0
        while depth < len(seq):
            child = node.children.get(seq[depth])
            if child is None:
                leaf: _Node[S] = _Node(seq[depth:], node)
                node.children[seq[depth]] = leaf
                self._stamp(leaf, engine_id, now)
                return
            shared = _common_prefix(seq, depth, child.edge)
            if shared < len(child.edge):
                child = self._split(child, shared)
            self._stamp(child, engine_id, now)
            depth += shared
            node = child

    def evict(self, max_size: int) -> int:
        """Trim every engine to ``max_size`` by dropping its LRU leaves; returns symbols freed."""
        over = {e for e, n in self._size.items() if n > max_size}
        if not over:
            return 0
        heaps: dict[str, list[tuple[float, int, _Node[S]]]] = {e: [] for e in over}
        seq = 0
        for node in self._walk():
            if node is self._root:
                continue
            for engine in over.intersection(node.access):
                if self._is_leaf_of(node, engine):
                    heaps[engine].append((node.access[engine], seq, node))
                    seq += 1
        freed = 0
        for engine in sorted(over):
            heap = heaps[engine]
            heapq.heapify(heap)
            while heap and self._size[engine] > max_size:
                _, _, node = heapq.heappop(heap)
                parent = node.parent
                freed += self._drop(node, engine)
                if (
                    parent is not None
                    and parent is not self._root
                    and engine in parent.access
                    and self._is_leaf_of(parent, engine)
                ):
                    heapq.heappush(heap, (parent.access[engine], seq, parent))
                    seq += 1
        return freed

    def remove_engine(self, engine_id: str) -> None:
        """Forget everything ``engine_id`` held (it left the pool)."""
        if self._size.pop(engine_id, None) is None:
            return
        for node in list(self._walk()):
            node.access.pop(engine_id, None)
        for node in reversed(list(self._walk())):
            if node is not self._root and not node.access and not node.children:
                self._detach(node)

    # ---- internals ------------------------------------------------------

    def _stamp(self, node: _Node[S], engine_id: str, now: float) -> None:
        if engine_id not in node.access:
            self._size[engine_id] += len(node.edge)
        node.access[engine_id] = now

    def _split(self, child: _Node[S], at: int) -> _Node[S]:
        """Cut ``child``'s edge after ``at`` symbols; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper: _Node[S] = _Node(child.edge[:at], parent)
        upper.access = dict(child.access)
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[at:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    @staticmethod
    def _is_leaf_of(node: _Node[S], engine_id: str) -> bool:
        return not any(engine_id in c.access for c in node.children.values())

    def _drop(self, node: _Node[S], engine_id: str) -> int:
        del node.access[engine_id]
        n = len(node.edge)
        self._size[engine_id] -= n
        if not node.access and not node.children:
            self._detach(node)
        return n

    @staticmethod
    def _detach(node: _Node[S]) -> None:
        parent = node.parent
        if parent is not None and parent.children.get(node.edge[0]) is node:
            del parent.children[node.edge[0]]
        node.parent = None

    def _walk(self) -> Iterator[_Node[S]]:
        """Every node, parents before children, in a stable order."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(list(node.children.values())))


def token_tree() -> RadixTree[tuple[int, ...]]:
    """A tree over token ids; sizes count tokens."""
    return RadixTree(())


def text_tree() -> RadixTree[str]:
    """A tree over the characters of text prompts; sizes count characters."""
    return RadixTree("")
