"""The paged KV cache's blocks, as the scheduler hands them out.

Admission reserves every block a request can use (its prompt + max_new_tokens) at once, and its
end gives them back: a running sequence never waits for a block, nothing is preempted or
computed twice, and a request's tokens do not depend on what else runs. A request whose blocks
are not free waits, in order, in the queue; one that the whole cache could never hold is refused
when it is submitted (``check``).
"""

from __future__ import annotations


class BlockPool:
    """Blocks 1..num_blocks-1 of a paged cache (block 0 is its null block), ``block_size``
    positions each."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.capacity = num_blocks - 1
        self._free = list(range(num_blocks - 1, 0, -1))  # a stack: low blocks first

    def need(self, positions: int) -> int:
        return -(-positions // self.block_size)

    @property
    def free(self) -> int:
        return len(self._free)

    def check(self, prompt: int, new_tokens: int) -> None:
        """ValueError, with the numbers, for a request no state of the cache could hold."""
        n = self.need(prompt + new_tokens)
        if n > self.capacity:
            raise ValueError(
                f"prompt ({prompt} tokens) + max_new_tokens ({new_tokens}) needs {n} KV-cache blocks of "
                f"{self.block_size} positions, but this replica's cache holds {self.capacity} "
                f"({self.capacity * self.block_size} positions): shorten the prompt or max_new_tokens")

    def take(self, n: int) -> list[int] | None:
        """``n`` free blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
