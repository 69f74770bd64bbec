"""A compressed radix tree shared by many engines, as the vLLM Router's ``cache_aware`` keeps.

Algorithm. Edges hold runs of symbols (token ids in a tuple, or the characters
of a ``str``); a node's children are keyed by the first symbol of their edge.
Each node records, per engine, the last time that engine's prompt passed
through it. Inserting a prompt for an engine stamps every node on its path
(splitting an edge where the prompt diverges or ends inside it), so an engine
holding a node also holds all of that node's ancestors. That invariant lets
``match`` read every engine's matched length off the one path the prompt
takes: the cost is the prompt's length plus the engines on that path, never
the size of the tree. Runs are compared as slices, in C; an insert of the
prompt object a ``match`` just walked (a policy decides, then learns) reuses
that walk while the tree is unchanged.

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

_CHUNK = 4096
"""Most symbols compared in one slice when looking for where two runs diverge (speed only:
one C comparison for a typical edge, and slices small enough to stay off mmap'd memory)."""

_LINEAR = 16
"""Below this many symbols the divergence is found one symbol at a time (speed only)."""


def common_prefix(a: Sequence[Hashable], a_start: int, b: Sequence[Hashable]) -> int:
    """Length of the common prefix of ``a[a_start:]`` and ``b``, comparing slices in C.

    Chunks of up to ``_CHUNK`` symbols that are equal are skipped whole (a whole edge, as a
    rule: ``b[0:len(b)]`` is ``b`` itself, not a copy); the chunk where the runs differ is
    bisected on the equality of its halves. Python does O(log n) steps per divergence.
    """
    limit = max(0, min(len(a) - a_start, len(b)))
    n = 0
    while n < limit:
        end = n + _CHUNK
        if end > limit:
            end = limit
        if a[a_start + n : a_start + end] != b[n:end]:
            # The first difference lies in [n, end).
            while end - n > _LINEAR:
                mid = (n + end) >> 1
                if a[a_start + n : a_start + mid] == b[n:mid]:
                    n = mid
                else:
                    end = mid
            while a[a_start + n] == b[n]:
                n += 1
            return n
        n = end
    return limit


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
        # The path of the last ``match``, kept until the tree next changes: a policy matches a
        # prompt and then inserts that same prompt for the engine it chose, and the insert
        # walks the very same path (a cache only: answers never depend on it).
        self._walked: tuple[S, list[tuple[_Node[S], int]]] | None = None

    # ---- reading --------------------------------------------------------

    def _path(self, seq: S) -> list[tuple[_Node[S], int]]:
        """The nodes ``seq`` runs into, each with the depth reached at its end (or inside it, last)."""
        path: list[tuple[_Node[S], int]] = []
        node = self._root
        depth = 0
        end = len(seq)
        while depth < end:
            child = node.children.get(seq[depth])
            if child is None:
                break
            edge = child.edge
            shared = common_prefix(seq, depth, edge)
            depth += shared
            path.append((child, depth))
            if shared < len(edge):
                break
            node = child
        return path

    def match(self, seq: S) -> dict[str, int]:
        """Matched prefix length of ``seq`` per engine (engines matching nothing are absent).

        Ordered deepest first; engines that match equally long appear in the
        order they joined the node where their match ends (the vLLM Router
        routes a cache hit to the earliest of them).
        """
        path = self._path(seq)
        self._walked = (seq, path)
        out: dict[str, int] = {}
        for child, reached in reversed(path):
            access = child.access
            # Holders of a node hold its ancestors, so a node with no more holders than
            # found so far adds none.
            if len(access) > len(out):
                for engine in access:
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
        walked, self._walked = self._walked, None
        path = walked[1] if walked is not None and walked[0] is seq else self._path(seq)
        size = self._size
        size.setdefault(engine_id, 0)
        node = self._root
        depth = 0
        for child, reached in path:
            if reached - depth < len(child.edge):
                child = self._split(child, reached - depth)
            if engine_id not in child.access:
                size[engine_id] += len(child.edge)
            child.access[engine_id] = now
            depth = reached
            node = child
        if depth < len(seq):
            leaf: _Node[S] = _Node(seq[depth:], node)
            node.children[seq[depth]] = leaf
            self._stamp(leaf, engine_id, now)

    def evict(self, max_size: int) -> int:
        """Trim every engine to ``max_size`` by dropping its LRU leaves; returns symbols freed."""
        over = {e for e, n in self._size.items() if n > max_size}
        self._walked = None
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
        self._walked = None
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
