"""How one all-reduce cuts a tensor into per-rank slices and wire buffers."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from . import codec as wire


@dataclass(frozen=True)
class Layout:
    """The slicing of ``count`` elements over ``nranks`` ranks, and its wire format.

    ``codec`` (`codec.CODECS`) may name a pair (``"int4-h32/int7-h32"``): the layout's own slices
    are then the contributions' (``codec`` holds that part, ``sum_codec`` the other) and `sums` is
    the layout of the owners' sums; otherwise both are ``codec``. Rank ``s`` owns elements
    ``bounds(s)``; every slice has ``slice_elems`` elements once zero-padded (a multiple of
    `codec.SLICE_QUANTUM`), and ``slice_bytes`` bytes on the wire. A *wire buffer* of ``n``
    slices is ``n * slice_bytes`` contiguous bytes, slice ``i`` at ``wire_slot(i)``.
    ``quantum`` (a multiple of 512) is what slices are rounded up to; the pipelined schedule
    uses it to cut each rank's slice into equal chunks.
    """

    count: int
    nranks: int
    codec: str = "int4"
    quantum: int = wire.SLICE_QUANTUM
    sum_codec: str = field(init=False, default="")

    def __post_init__(self):
        if self.count < 0 or self.nranks < 1 or self.quantum <= 0 or self.quantum % wire.SLICE_QUANTUM:
            raise ValueError(f"bad layout: count={self.count} nranks={self.nranks} quantum={self.quantum}")
        contributions, sums = wire.parts(self.codec)
        object.__setattr__(self, "codec", contributions)
        object.__setattr__(self, "sum_codec", sums)

    @property
    def name(self) -> str:
        """The codec's name (`codec.CODECS`): ``codec``, or the pair."""
        return wire.joined(self.codec, self.sum_codec)

    @property
    def group(self) -> int:
        """Elements per scale (`codec.group_size`)."""
        return wire.group_size(self.codec)

    @cached_property
    def sums(self) -> "Layout":
        """The layout of the owners' sums: this one, or the same slicing in ``sum_codec``."""
        if self.sum_codec == self.codec:
            return self
        return Layout(self.count, self.nranks, self.sum_codec, self.quantum)

    @cached_property
    def slice_elems(self) -> int:
        q = self.quantum
        per_rank = -(-self.count // self.nranks)
        return max(q, -(-per_rank // q) * q)

    @cached_property
    def slice_bytes(self) -> int:
        return wire.slice_bytes(self.slice_elems, self.group, self.codec)

    @property
    def padded(self) -> int:
        return self.slice_elems * self.nranks

    def bounds(self, s: int) -> tuple[int, int]:
        """Element range ``[lo, hi)`` of slice ``s`` inside the unpadded tensor (may be empty)."""
        lo = min(s * self.slice_elems, self.count)
        return lo, min(lo + self.slice_elems, self.count)

    def extent(self, s: int) -> int:
        """Elements of slice ``s`` an all-reduce must work on: its valid ones (`bounds`) rounded up to a
        multiple of `codec.SLICE_QUANTUM`, at most ``slice_elems``. Every group lies inside one such
        block, so the blocks past it hold zeros: the reference makes zero codes of them and leaves
        their residuals as a new state holds them (`codec.clear_residuals`), which is why the fused
        whole-slice kernels and every fused owner may skip them."""
        lo, hi = self.bounds(s)
        q = wire.SLICE_QUANTUM
        return min(self.slice_elems, -(-(hi - lo) // q) * q)

    def wire_slot(self, s: int) -> slice:
        return slice(s * self.slice_bytes, (s + 1) * self.slice_bytes)

    @property
    def wire_bytes_per_rank(self) -> int:
        """Bytes each rank sends in one two-shot or ring all-reduce: P-1 slices of contributions
        and P-1 of sums."""
        return (self.nranks - 1) * (self.slice_bytes + self.sums.slice_bytes)
