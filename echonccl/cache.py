"""The communicator's buffer cache: workspaces and default feedback states, bounded by bytes.

A least-recently-used map from a key to an entry (the object, its bytes, whether it is
pinned). `make_room` evicts the least recently used unpinned entries, except those a call
is using, until the new bytes fit under ``limit``; an entry larger than the limit is still
kept while it is the one in use (the limit bounds what is kept for *other* sizes).

Pinned entries (used while a CUDA graph was being captured: the graph holds their
pointers) are never evicted until `unpin_all` or `clear`.

Evicted objects go to ``retire(obj, token)``: the engine keeps them alive until the work
already queued on the stream that last used them (``token``) has run (GPU), or drops them
at once (CPU: every call has completed when it returns).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable


class Entry:
    """One cached object; ``live`` until it is evicted or the cache cleared."""

    __slots__ = ("key", "obj", "nbytes", "pinned", "token", "live")

    def __init__(self, key, obj, nbytes: int):
        self.key, self.obj, self.nbytes, self.pinned, self.token, self.live = key, obj, nbytes, False, None, True


class BufferCache:
    def __init__(self, limit: int, retire: Callable[[Any, Any], None]):
        self.limit = limit
        self._retire = retire
        self._entries: OrderedDict = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key) -> Entry | None:
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
        return e

    def put(self, key, obj, nbytes: int) -> Entry:
        assert key not in self._entries
        e = self._entries[key] = Entry(key, obj, nbytes)
        self.nbytes += nbytes
        return e

    def touch(self, e: Entry) -> None:
        """Mark live entry ``e`` most recently used (as `get` of its key does)."""
        self._entries.move_to_end(e.key)

    def resize(self, e: Entry, nbytes: int) -> None:
        self.nbytes += nbytes - e.nbytes
        e.nbytes = nbytes

    def make_room(self, nbytes: int, keep=()) -> None:
        """Evict least recently used entries (not pinned, not in ``keep``) until ``nbytes``
        more fit under the limit, or nothing more can go."""
        if self.nbytes + nbytes <= self.limit:
            return
        for key in list(self._entries):
            e = self._entries[key]
            if e.pinned or any(e is k for k in keep):
                continue
            del self._entries[key]
            e.live = False
            self.nbytes -= e.nbytes
            self.evictions += 1
            self._retire(e.obj, e.token)
            if self.nbytes + nbytes <= self.limit:
                return

    def unpin_all(self) -> None:
        for e in self._entries.values():
            e.pinned = False

    def pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.pinned)

    def values(self):
        return [e.obj for e in self._entries.values()]

    def clear(self) -> None:
        for e in self._entries.values():
            e.live = False
        self._entries.clear()
        self.nbytes = 0
