"""The communicator's bounded buffer cache (echonccl/cache.py) and workspace size classes."""
from __future__ import annotations

from mpi4py import MPI

import echonccl
from echonccl.cache import BufferCache
from echonccl.communicator import _size_class


def test_size_classes_round_up_by_at_most_a_quarter():
    prev = 0
    for n in list(range(1, 70_000, 37)) + [2 ** k + d for k in range(12, 40) for d in (-1, 0, 1)]:
        c = _size_class(n)
        assert c >= n and c >= 4096
        assert n <= 4096 or c < 1.25 * n + 1, (n, c)
        assert c >= prev or n < prev      # monotone
        prev = c
    assert len({_size_class(n) for n in range(100_000, 120_000)}) <= 2      # nearby sizes share


def test_lru_eviction_by_bytes_skips_pinned_and_kept_entries():
    retired = []
    c = BufferCache(100, lambda obj, token: retired.append((obj, token)))
    a, b, d = (c.put(k, k, 40) for k in "abd")
    a.token = "stream-a"
    c.get("a")                      # a is now the most recently used
    c.make_room(0)
    assert c.nbytes == 120 - 40 and retired == [("b", None)]
    d.pinned = True
    e = c.put("e", "e", 90)
    c.make_room(0, keep=(e,))
    assert retired == [("b", None), ("a", "stream-a")]      # d pinned, e in use
    assert c.nbytes == 130 and len(c) == 2                  # over the bound: what is left is pinned or in use
    c.unpin_all()
    c.make_room(0, keep=(e,))
    assert [r[0] for r in retired] == ["b", "a", "d"] and c.nbytes == 90


def test_the_default_bound_and_its_override(monkeypatch):
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu") as comm:
        assert comm.config.cache_bytes == 1 << 30
    monkeypatch.setenv("ECHONCCL_CACHE_BYTES", "12345")
    with echonccl.Communicator(MPI.COMM_SELF, engine="cpu", cache_bytes=1) as comm:
        assert comm.config.cache_bytes == 12345 and comm._cache.limit == 12345
