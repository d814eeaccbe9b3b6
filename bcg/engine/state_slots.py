"""StateSlotPool: the recurrent state slots of a hybrid model's running sequences.

A sequence takes a slot when it is first scheduled and keeps it, across its prompt's chunks
and its decodes, until it finishes, is aborted or is preempted (then it recomputes from its
tokens into whatever slot it gets next, starting from zero).
"""

from __future__ import annotations


class StateSlotPool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 <= slot < self.num_slots and slot not in self._free
        self._free.append(slot)
