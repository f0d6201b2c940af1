"""The receiver's memory of the signed frames it accepted, so that none is accepted twice.

A sender numbers its frames 1, 2, 3... per incarnation (see ``pivot.bus.codec``).
``ReplayWindow`` remembers, per key, the newest counter accepted and which of the
``size`` counters just below it were accepted too (a bitmap, as IPsec's anti-replay
window): a counter is accepted once, in any order, unless it fell below the window.
``size=1`` accepts only counters newer than all before (pub/sub, which keeps order).
Memory is bounded: past ``keys`` keys the least recently heard one is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class ReplayWindow:
    def __init__(self, size: int, keys: int) -> None:
        if size < 1 or keys < 1:
            raise ValueError(f"a replay window needs size >= 1 and keys >= 1, not {size}, {keys}")
        self.size = size
        self.keys = keys
        self._mask = (1 << size) - 1
        # key -> [newest counter accepted, bitmap: bit i set = newest - i accepted]
        self._seen: OrderedDict[Hashable, list[int]] = OrderedDict()

    def admit(self, key: Hashable, counter: int) -> bool:
        """True the first time ``counter`` comes from ``key`` (it is remembered then);
        False for a counter accepted before or one below the window."""
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= self.keys:
                self._seen.popitem(last=False)
            self._seen[key] = [counter, 1]
            return True
        self._seen.move_to_end(key)
        newest, bits = seen
        if counter > newest:
            shift = counter - newest
            seen[0] = counter
            seen[1] = ((bits << shift) | 1) & self._mask if shift < self.size else 1
            return True
        offset = newest - counter
        if offset >= self.size or bits >> offset & 1:
            return False
        seen[1] = bits | 1 << offset
        return True

    def __len__(self) -> int:
        return len(self._seen)
