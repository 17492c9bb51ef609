"""The visited-state table every process of one search shares, and its counters.

An anonymous shared mapping made before the first ``fork()``: an open-addressing table
of 64-bit state digests (0 marks an empty slot) behind a few 64-bit counters. The search
is sequential (a parent waits for each child before forking the next), so exactly one
process touches the table at a time and no lock is needed.
"""

from __future__ import annotations

import mmap

COUNTERS = (
    "states",
    "transitions",
    "complete_paths",
    "compared_paths",
    "max_depth",
    "unfinished",
    "cut",
    "wedged_paths",
    "errors",
)


class TableFull(RuntimeError):
    """The table is too full to stay fast; make it larger (``slots``)."""


class VisitedTable:
    def __init__(self, slots: int = 1 << 21) -> None:
        assert slots & (slots - 1) == 0, "slots must be a power of two"
        self.slots = slots
        self._header = len(COUNTERS)
        self._memory = mmap.mmap(-1, 8 * (self._header + slots))
        self._words = memoryview(self._memory).cast("Q")

    def insert(self, digest: int) -> bool:
        """Add ``digest`` (nonzero); False if it was there already."""
        words, header, mask = self._words, self._header, self.slots - 1
        index = digest & mask
        for _ in range(self.slots):
            held = words[header + index]
            if held == digest:
                return False
            if held == 0:
                words[header + index] = digest
                self.add("states")
                if self.get("states") * 10 > self.slots * 7:
                    raise TableFull(f"{self.slots} slots")
                return True
            index = (index + 1) & mask
        raise TableFull(f"{self.slots} slots")

    def add(self, counter: str, amount: int = 1) -> None:
        self._words[COUNTERS.index(counter)] += amount

    def raise_to(self, counter: str, value: int) -> None:
        index = COUNTERS.index(counter)
        if value > self._words[index]:
            self._words[index] = value

    def get(self, counter: str) -> int:
        return int(self._words[COUNTERS.index(counter)])

    def counters(self) -> dict[str, int]:
        return {name: self.get(name) for name in COUNTERS}

    def close(self) -> None:
        self._words.release()
        self._memory.close()
