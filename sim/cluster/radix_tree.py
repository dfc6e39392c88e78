"""SGLang router's approximate radix tree: the request texts it routed, per worker, over characters.

Follows sgl-project/sglang at commit 4d40eec, sgl-router/src/policies/tree.rs (`Tree`): one tree
shared by every worker (a "tenant"); each node holds a run of characters and, per tenant, when it
last touched the node; a tenant on a node is on every node above it. `insert` stamps the whole path
for its tenant, splitting a node where the text leaves it; `prefix_match` walks as far as the text
matches (a partial match into a node counts its shared characters) and picks a tenant of the node
it stopped in; `evict_by_size` removes tenants' least recently touched leaves until each tenant
holds at most a given number of characters (`evict_tenant_by_size`).

Where the source is arbitrary kvsim picks one rule: touch times are a counter the caller advances
(the source reads the wall clock in ms; the same order, without ties), and where the source takes
a DashMap's first key (`prefix_match`'s tenant, `get_smallest_tenant`'s tie), kvsim takes the lowest
worker index.
"""

from __future__ import annotations

import heapq


class Node:
    """A run of characters (`text`), its children by first character, and its tenants' touch times."""

    __slots__ = ("children", "parent", "tenants", "text")

    def __init__(self, text: str, parent: Node | None, tenants: dict[int, int] | None = None):
        self.text = text
        self.parent = parent
        self.children: dict[str, Node] = {}
        self.tenants: dict[int, int] = {} if tenants is None else tenants


def shared_prefix(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share (`shared_prefix_count`)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


class ApproxRadixTree:
    """The multi-tenant radix tree; `char_count[t]`: characters of the nodes tenant t is on."""

    def __init__(self) -> None:
        self.root = Node("", None)
        self.char_count: dict[int, int] = {}  # tenant_char_count

    def insert(self, text: str, tenant: int, now: int) -> None:
        """`Tree::insert`: stamp the root and every node along `text` for `tenant` at `now`, adding
        the unmatched rest as a new leaf and splitting a node the text leaves part-way."""
        node = self.root
        node.tenants[tenant] = now
        self.char_count.setdefault(tenant, 0)
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = Node(text[i:], node, {tenant: now})
                node.children[text[i]] = leaf
                self.char_count[tenant] += len(leaf.text)
                return
            shared = shared_prefix(child.text, text[i:])
            if shared < len(child.text):
                child = self._split(node, child, shared)
            if tenant not in child.tenants:
                self.char_count[tenant] += len(child.text)
            child.tenants[tenant] = now
            node, i = child, i + shared

    def _split(self, parent: Node, child: Node, at: int) -> Node:
        """[parent] -> [child] becomes [parent] -> [head] -> [child's rest]; the head keeps the
        child's tenants and their times."""
        head = Node(child.text[:at], parent, dict(child.tenants))
        parent.children[head.text[0]] = head
        child.text = child.text[at:]
        child.parent = head
        head.children[child.text[0]] = child
        return head

    def prefix_match(self, text: str, now: int) -> tuple[int, int | None]:
        """`Tree::prefix_match`: (characters of `text` matched, the tenant of the node the walk
        stopped in: its lowest index; None where it has none), stamping that tenant at `now` from
        the node up to the root."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            shared = shared_prefix(child.text, text[i:])
            node, i = child, i + shared
            if shared < len(child.text):
                break
        tenant = min(node.tenants) if node.tenants else None
        if tenant is not None:
            up: Node | None = node
            while up is not None:
                up.tenants[tenant] = now
                up = up.parent
        return i, tenant

    def smallest_tenant(self) -> int | None:
        """`get_smallest_tenant`: the tenant holding the fewest characters (lowest index on a tie)."""
        if not self.char_count:
            return None
        return min(self.char_count, key=lambda t: (self.char_count[t], t))

    @staticmethod
    def _leaf_of(node: Node, tenant: int) -> bool:
        """`leaf_of`: `tenant` is on `node` and on none of its children."""
        return tenant in node.tenants and not any(tenant in c.tenants for c in node.children.values())

    def evict_by_size(self, max_size: int) -> None:
        """`evict_tenant_by_size`: over every (leaf, tenant) in order of touch time, a tenant holding
        more than `max_size` characters leaves the leaf (a node left with no tenant and no child
        leaves the tree), and its parent joins the queue once it is the tenant's leaf."""
        heap: list[tuple[int, int, int, Node]] = []
        seq = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for tenant, stamp in node.tenants.items():
                if self._leaf_of(node, tenant):
                    heap.append((stamp, tenant, seq, node))
                    seq += 1
        heapq.heapify(heap)
        while heap:
            _, tenant, _, node = heapq.heappop(heap)
            if self.char_count.get(tenant, 0) <= max_size:
                continue
            if tenant in node.tenants:
                self.char_count[tenant] = max(self.char_count[tenant] - len(node.text), 0)
                del node.tenants[tenant]
            parent = node.parent
            if parent is not None and not node.children and not node.tenants and node.text:
                parent.children.pop(node.text[0], None)
            if parent is not None and self._leaf_of(parent, tenant):
                heapq.heappush(heap, (parent.tenants[tenant], tenant, seq, parent))
                seq += 1
