"""Every distinct block of every rendering of the log, once: hashes are parent-chained, so a request is a leaf of a
tree of blocks and memory grows with distinct blocks, not with the log."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from kvprefix.cache import cdiv
from kvprefix.sim.trace import TraceRequest


class BlockTree:
    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}
        self.parent: list[int] = []  # a list: replays index it most
        self.first_request = array("q")  # the request (variant-local index) that first had the block
        self._seen_by = array("Q")  # bit v: variant v has the block

    def __len__(self) -> int:
        return len(self.parent)

    def add(self, hashes: Sequence[Hashable], variant_bit: int, request: int) -> tuple[int, int]:
        """(leaf node or -1, number of blocks new to that variant)."""
        node, new = -1, 0
        ids, parent, seen = self._ids, self.parent, self._seen_by
        for h in hashes:
            child = ids.get(h)
            if child is None:
                child = ids[h] = len(parent)
                parent.append(node)
                self.first_request.append(request)
                seen.append(0)
            if not seen[child] & variant_bit:
                seen[child] |= variant_bit
                new += 1
            node = child
        return node, new

    def mark(self, leaf: int, variant_bit: int) -> int:
        """Marks a chain already in the tree as the variant's; the number of its blocks new to the variant."""
        new = 0
        parent, seen = self.parent, self._seen_by
        while leaf >= 0 and not seen[leaf] & variant_bit:
            seen[leaf] |= variant_bit
            new += 1
            leaf = parent[leaf]
        return new

    def chain(self, leaf: int) -> list[int]:
        out = []
        parent = self.parent
        while leaf >= 0:
            out.append(leaf)
            leaf = parent[leaf]
        out.reverse()
        return out


class Variant:
    """One rendering of the whole log (as it is, or with one fix applied): per request, its chain's leaf and its
    prompt length, in log order."""

    def __init__(self, name: str, block_size: int, tree: BlockTree, bit: int):
        self.name = name
        self.block_size = block_size
        self.tree = tree
        self.bit = bit
        self.leaves = array("q")
        self.tokens = array("q")
        self.distinct_blocks = 0
        self.max_blocks = 0

    def add(self, hashes: Sequence[Hashable], num_tokens: int) -> None:
        leaf, new = self.tree.add(hashes, self.bit, len(self.leaves))
        self.leaves.append(leaf)
        self.tokens.append(num_tokens)
        self.distinct_blocks += new
        self.max_blocks = max(self.max_blocks, cdiv(num_tokens, self.block_size))

    def copy(self, other: Variant, i: int) -> None:
        """Request ``i`` exactly as in ``other`` (a fix that left it unchanged)."""
        leaf, n = other.leaves[i], other.tokens[i]
        self.distinct_blocks += self.tree.mark(leaf, self.bit)
        self.leaves.append(leaf)
        self.tokens.append(n)
        self.max_blocks = max(self.max_blocks, cdiv(n, self.block_size))

    def __len__(self) -> int:
        return len(self.leaves)


class Variants(dict[str, Variant]):
    """The renderings of one log by name, sharing one tree of blocks."""

    def __init__(self, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.tree = BlockTree()

    def get_or_add(self, name: str, block_size: int | None = None) -> Variant:
        if name not in self:
            self[name] = Variant(name, block_size or self.block_size, self.tree, 1 << len(self))
        return self[name]


class TraceView(Sequence):
    """A variant's requests (a subset, in replay order) as the planner's ``TraceRequest``s, built when the replay
    reaches them so no full list of hashes is ever held."""

    def __init__(self, variant: Variant, order: Sequence[int]):
        self.variant = variant
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, k):
        if isinstance(k, slice):
            raise TypeError("TraceView does not slice")
        v = self.variant
        i = self.order[k]
        n = v.tokens[i]
        return TraceRequest(timestamp=0.0, input_length=n, output_length=0, block_hashes=v.tree.chain(v.leaves[i]),
                            num_blocks=cdiv(n, v.block_size))
