"""BlockManager: which KV-cache blocks each sequence owns. Integers only, no torch.

The KV cache is `num_blocks` fixed-size blocks of `block_size` token slots. A sequence's block table
maps its token positions to blocks: position p lives in slot p % block_size of block_table[p // block_size].

- Free blocks sit in an LRU queue. A freed block that holds a full, hashed block of tokens keeps its
  hash until it is reused, so a later request with the same prefix can take it back (prefix caching).
- Blocks are reference counted: prefix hits and forked samples (n > 1) share blocks.
- A shared block is never written: the first write into one copies it (copy-on-write), and the
  (source, destination) pair is queued in `pending_copies` for the model runner to copy the KV.
- Running out is not an error: `allocate_slots` answers False and changes nothing.
"""
from __future__ import annotations

from collections import OrderedDict

from llmq.engine.sequence import Sequence

# Chain start for the first block's hash.
_ROOT_HASH = 0x6C6C6D71


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached_blocks: dict[int, int] = {}  # chained hash -> block id
        # Free blocks in eviction order: the front is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.pending_copies: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any sequence (cached-but-free blocks count as free)."""
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s full blocks.

        Never the whole sequence: the last token is always left to compute, since the step that
        computes it produces the logits to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        hits = []
        for block_hash in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- changes -------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after `seq`'s computed ones (plus the
        `cached_blocks` prefix hits, for a sequence being admitted). All or nothing: on False
        nothing changed."""
        num_computed = seq.num_computed_tokens + len(cached_blocks) * self.block_size
        have = len(seq.block_table) + len(cached_blocks)
        need_new = max(0, self.blocks_needed(num_computed + num_new_tokens) - have)
        first_written = num_computed // self.block_size
        needs_copy = (num_new_tokens > 0 and first_written < len(seq.block_table)
                      and self.ref_counts[seq.block_table[first_written]] > 1)
        reclaimed = sum(1 for b in cached_blocks if self.ref_counts[b] == 0) if cached_blocks else 0
        if need_new + needs_copy > self.num_free_blocks - reclaimed:
            return False

        for block in cached_blocks:
            self._take(block)
            seq.block_table.append(block)
        if needs_copy:
            shared = seq.block_table[first_written]
            copy = self._pop_free()
            self.ref_counts[shared] -= 1
            seq.block_table[first_written] = copy
            self.pending_copies.append((shared, copy))
        for _ in range(need_new):
            seq.block_table.append(self._pop_free())
        return True

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the blocks that are full once `num_computed_tokens` are computed, for prefix hits.
        A block holding a pending token (still on the device) waits: its hash needs that token.
        Each of a sequence's blocks is offered once (`seq.num_offered_blocks`), as it fills, so a step
        costs its new blocks, not the whole context; a block whose contents another block had published
        by then stays unpublished."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_offered_blocks:
            return
        self._extend_hashes(seq, num_full)
        for i in range(seq.num_offered_blocks, num_full):
            block, block_hash = seq.block_table[i], seq.block_hashes[i]
            if self.block_hash[block] is None and block_hash not in self.cached_blocks:
                self.block_hash[block] = block_hash
                self.cached_blocks[block_hash] = block
        seq.num_offered_blocks = num_full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 samples of one prompt)."""
        child.block_table = list(parent.block_table)
        child.num_offered_blocks = parent.num_offered_blocks
        for block in child.block_table:
            self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks. Hashed blocks stay findable until reused; tail blocks, the
        least likely to be shared, are queued for reuse before head blocks; unhashed ones first of all."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_offered_blocks = 0

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- internals -----------------------------------------------------------------------

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        size = self.block_size
        for i in range(len(seq.block_hashes), num_full_blocks):
            parent = seq.block_hashes[i - 1] if i else _ROOT_HASH
            seq.block_hashes.append(hash((parent, tuple(seq.token_ids[i * size:(i + 1) * size]))))

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        stale = self.block_hash[block]
        if stale is not None:  # evict: this block's old contents are about to be overwritten
            del self.cached_blocks[stale]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block
