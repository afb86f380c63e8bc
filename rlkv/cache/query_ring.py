"""`QueryRing`: the last N observation queries of a layer's compressed heads, kept across decode steps.

A ring of exactly N slots: a decode step is one write, with no copy of the window and no spare
memory; the queries are put in order (oldest first) only when a compaction reads them. Policies that
observe queries (SnapKV, R-KV, RPC) read them through `CompressedStore.queries` (`ObservedQueries`, below).
"""

from __future__ import annotations

import torch


class QueryRing:
    """Ring of `limit` query slots [B, Hq, limit, D] (Hq = H_c * G query heads); `count` of them hold queries."""

    def __init__(self) -> None:
        self.ring: torch.Tensor | None = None
        self.next = 0  # the slot the next query goes to (the oldest, once full)
        self.count = 0

    def remember(self, queries: torch.Tensor, limit: int) -> None:
        """Keep the last `limit` of everything remembered so far, `queries` [B, Hq, Q, D] the newest (the
        attention's own layout: a decode step writes it as it is, no regrouping op)."""
        count = min(queries.shape[2], limit)
        new = queries if queries.shape[2] == count else queries.narrow(2, queries.shape[2] - count, count)
        ring = self.ring
        if ring is None or ring.shape[:2] != new.shape[:2] or ring.shape[2] != limit:
            ring = self.ring = new.new_empty((*new.shape[:2], limit, new.shape[3]))
            self.next = self.count = 0
        start = self.next
        first = min(count, limit - start)  # up to the ring's end, then from its front
        ring.narrow(2, start, first).copy_(new.narrow(2, 0, first) if first < count else new)
        if first < count:
            ring.narrow(2, 0, count - first).copy_(new.narrow(2, first, count - first))
        self.next = (start + count) % limit
        self.count = min(self.count + count, limit)

    def ordered(self, groups: int) -> torch.Tensor | None:
        """The remembered queries [B, H_c, G, count, D] (G = `groups`), oldest first (None: none yet)."""
        ring, count = self.ring, self.count
        if ring is None:
            return None
        if count < ring.shape[2]:  # not wrapped yet: slots 0..count-1 in order
            window = ring.narrow(2, 0, count)
        elif self.next == 0:
            window = ring
        else:
            window = torch.cat(
                [ring.narrow(2, self.next, count - self.next), ring.narrow(2, 0, self.next)], 2
            )
        return window.unflatten(1, (-1, groups))

    def oldest(self, logical_length: int) -> int | None:
        """The oldest remembered query's logical position, of `logical_length` columns seen (None: none)."""
        return None if self.ring is None else logical_length - self.count

    def positions(self, logical_length: int) -> torch.Tensor | None:
        """LongTensor[count]: their logical positions, the last `count` columns of `logical_length` seen
        (every forward's queries are remembered, so the window is contiguous)."""
        if self.ring is None:
            return None
        return torch.arange(logical_length - self.count, logical_length, device=self.ring.device)


class ObservedQueries:
    """The observation window of a `CompressedStore` (rlkv/cache/store.py): its `QueryRing`, or queries and
    positions a static cache's store view was given. The store sets `query_ring`, `_queries`,
    `_query_positions`, `view_oldest_query`, `num_groups` and `logical_length`."""

    query_ring: QueryRing
    _queries: torch.Tensor | None
    _query_positions: torch.Tensor | None
    view_oldest_query: int | None  # a static view's oldest query position, where the host knows it
    num_groups: int
    logical_length: int

    def remember_queries(self, queries: torch.Tensor, limit: int) -> None:
        """Keep the last `limit` queries [B, H_c * G, Q, D] across steps (`QueryRing`: one write per step)."""
        self.query_ring.remember(queries, limit)

    @property
    def queries(self) -> torch.Tensor | None:
        """The observation window [B, H_c, G, N, D], oldest first (None: none kept); put in order when read."""
        return self._queries if self._queries is not None else self.query_ring.ordered(self.num_groups)

    @queries.setter
    def queries(self, value: torch.Tensor | None) -> None:
        # a store view that a static cache fills (rlkv/cache/static/budget.py) holds them explicitly
        self._queries = value

    @property
    def query_positions(self) -> torch.Tensor | None:
        """LongTensor[N]: the logical positions of `queries`, the last N columns seen (the window is
        contiguous: every forward's queries are remembered); built when read, at a compaction."""
        given = self._query_positions
        return given if given is not None else self.query_ring.positions(self.logical_length)

    @query_positions.setter
    def query_positions(self, value: torch.Tensor | None) -> None:
        self._query_positions = value

    @property
    def oldest_query_position(self) -> int | None:
        """Host int: the logical position of the oldest remembered query (None: none, or a static view's
        whose slots the host does not know to be one run, `view_oldest_query`)."""
        if self._query_positions is None:
            return self.query_ring.oldest(self.logical_length)
        return self.view_oldest_query
