"""KVPool: KVFlash on the target -- a pooled sequence keeps a bounded set of KV blocks on the device.

Every full block a pooled sequence commits is copied to host memory (model/kv_pool/host_store.py),
and every complete 64-token chunk gets a key summary per layer (model/kv_pool/score.py). Once the
sequence holds more than the pool's blocks, it is re-chosen (model/kv_pool/choose.py) after a prompt
chunk and every `interval` committed tokens: the sink chunk, the tail and the chunks scoring best
against the last token's queries (captured by the step before) stay; the rest go back to the block
pool (entries `released`, host copies kept) and chosen chunks come back from host memory: during
decode on side streams while the old set keeps serving the steps launched meanwhile, the new set taking
over before the first step planned after the copies landed (`land`); after a prompt chunk at once. Attention
reads the resident blocks through a KVView (seq.kv_view; None while everything is resident), so
its output is exact over what is resident and ignores the rest: LOSSY once anything is evicted.
Host blocks for a sequence's whole possible length are reserved at admission, so a pooled sequence
never runs out of backing mid-way.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from ..config import KV_POOL_CHUNK
from ..errors import RequestError
from ..model.kv_pool.choose import Protection, choose_chunks
from ..model.kv_pool.host_store import HostKVStore, Loading
from ..model.kv_pool.score import ChunkSummaries, chunk_bounds
from ..model.kv_pool.view import KVView
from ..util import host_to_device

log = logging.getLogger("lucebox")

TAIL_TOKENS = 256  # the recent tail never evicted (at least a sliding window's span more on mixed models)


@dataclass
class PageIn:
    """A resident set chosen during decode whose new chunks are still coming from host memory: the old
    set serves the steps launched meanwhile, and it takes over once the copies have landed."""
    enter: list[int]  # logical blocks coming in
    blocks: list[int]  # their device blocks (taken from the pool, not yet in the table)
    evict: list[int]  # logical blocks leaving when it takes over
    tail_from: int
    loading: Loading


@dataclass
class Residency:
    """One pooled sequence's bookkeeping."""
    seq: object
    host: list[int]  # the host block of every logical block it may reach
    saved: int = 0  # its logical blocks [0, saved) are in host memory
    summaries: ChunkSummaries = field(default_factory=ChunkSummaries)
    since: int = 0  # tokens committed since its resident set was last chosen
    queries: list[torch.Tensor] | None = None  # the last captured, per scored layer [heads, head_dim]
    prefilling: bool = False  # its last commit was a prompt chunk with more to come
    pending: PageIn | None = None


@dataclass(frozen=True)
class KVFlashStats:
    """The pool's state for /metrics: counters count since the engine started."""
    pool_tokens: int  # resident KV tokens per pooled sequence
    sequences: int  # pooled sequences holding host blocks (admitted, not finished)
    host_blocks: int  # blocks of the host backing store
    host_blocks_used: int  # reserved by pooled sequences (each for its whole possible length)
    reselects: int  # resident sets chosen
    paged_in: int  # blocks copied back from host memory into the device
    evicted: int  # device blocks given back (their KV kept in host memory)


class KVPool:
    def __init__(self, cache, caches: list, score_caches: list, pool_tokens: int, interval: int,
                 host_bytes: int | None, max_model_len: int, windows: tuple[int, ...] = (), max_num_seqs: int = 1,
                 step_tokens: int = 0):
        """cache: the engine's CacheManager; caches: every PagedKVCache on the primary block table (the
        target's and a proposer's); score_caches: the target layers' K caches scored; host_bytes: host
        memory for the backing store (None: max_num_seqs whole contexts, at most half the available memory);
        step_tokens: the most tokens a step brings (the memory plan's room for a pooled sequence)."""
        self.cache, self.blocks = cache, cache.blocks
        bs = cache.block_size
        if KV_POOL_CHUNK % bs and bs % KV_POOL_CHUNK:
            raise RequestError(f"kv_pool_tokens needs a block size dividing {KV_POOL_CHUNK} (or a multiple of it), "
                               f"not {bs}")
        self.chunk_blocks = max(1, KV_POOL_CHUNK // bs)
        chunk_tokens = self.chunk_blocks * bs
        tail = max(TAIL_TOKENS, max(windows, default=0) + chunk_tokens)  # a window's keys all in the tail
        self.protection = Protection(sink_chunks=1, tail_chunks=-(-tail // chunk_tokens))
        self.budget_chunks = pool_tokens // chunk_tokens
        if self.budget_chunks < self.protection.min_chunks:
            raise RequestError(f"kv_pool_tokens={pool_tokens} is below this model's smallest pool, "
                               f"{self.protection.min_chunks * chunk_tokens} tokens (a sink chunk, a tail of "
                               f"{self.protection.tail_chunks * chunk_tokens} tokens and room to choose)")
        self.pool_tokens, self.interval, self.max_model_len = pool_tokens, interval, max_model_len
        # what the memory plan gives a pooled sequence: a page-in in flight fits in what decoding leaves of it
        self.planned_blocks = cache.blocks.blocks_for(device_tokens_per_sequence(pool_tokens, step_tokens, interval))
        self.score_caches = score_caches
        block_bytes = HostKVStore.bytes_per_block(caches)
        if host_bytes is None:
            host_bytes = default_host_bytes(block_bytes, cache.blocks.blocks_for(max_model_len) * max_num_seqs)
        host_blocks = host_bytes // block_bytes
        if host_blocks < cache.blocks.blocks_for(pool_tokens):
            raise RequestError(f"the KV pool's host memory ({host_bytes / 2**20:.1f} MiB) holds {host_blocks} blocks, "
                               f"less than one pool; raise kv_pool_host_memory")
        self.store = HostKVStore(caches, host_blocks)
        self.members: dict[int, Residency] = {}
        self._saves: list[tuple[int, int]] = []  # (device block, host block) to copy at the step's end
        self._reselect: list = []  # sequences to re-choose at the step's end
        self.reselects = self.paged_in = self.evicted = 0  # since start, for /metrics
        log.info("KVFlash: pooled sequences keep %d tokens of KV resident (chunks of %d; sink %d, tail %d tokens), "
                 "backed by %.1f GiB of host memory (%d tokens)", pool_tokens, chunk_tokens, chunk_tokens,
                 self.protection.tail_chunks * chunk_tokens, host_blocks * block_bytes / 2**30, host_blocks * bs)

    @property
    def host_capacity_tokens(self) -> int:
        return self.store.num_host_blocks * self.cache.block_size

    @property
    def budget_blocks(self) -> int:
        return self.budget_chunks * self.chunk_blocks

    def stats(self) -> KVFlashStats:
        """Read from the server thread without a lock: figures may lag a step."""
        store = self.store
        return KVFlashStats(self.pool_tokens, len(self.members), store.num_host_blocks,
                            store.num_host_blocks - store.num_free, self.reselects, self.paged_in, self.evicted)

    # ------------------------------------------------------------------ membership
    def host_blocks_for(self, seq) -> int:
        longest = self.max_model_len if seq.params.max_tokens is None else min(
            self.max_model_len, seq.num_tokens + seq.params.max_tokens)
        return self.blocks.blocks_for(longest)

    def can_enroll(self, seq) -> bool:
        return self.store.num_free >= self.host_blocks_for(seq)

    def enroll(self, seq) -> None:
        self.members[id(seq)] = Residency(seq, self.store.allocate(self.host_blocks_for(seq)))
        seq.kv_view = None

    def release(self, seq) -> None:
        """seq finished or was preempted (its device blocks are freed by the cache manager)."""
        member = self.members.pop(id(seq), None)
        if member is not None:
            if member.pending is not None:  # blocks being loaded go back once the copies are ordered first
                member.pending.loading.join()
                self.blocks.truncate(member.pending.blocks, 0)
            mine = set(member.host)
            self._saves = [(d, h) for d, h in self._saves if h not in mine]  # nothing left to keep
            self.store.free(member.host)
        seq.kv_view = None
        self._reselect = [s for s in self._reselect if s is not seq]

    def in_flight(self, seq) -> int:
        """Device blocks seq's page-in holds outside its table until it lands."""
        member = self.members.get(id(seq))
        return 0 if member is None or member.pending is None else len(member.pending.blocks)

    def is_member(self, seq) -> bool:
        return id(seq) in self.members

    # ------------------------------------------------------------------ per step
    def resident_blocks(self, seq) -> int:
        view = seq.kv_view
        table = len(seq.block_table)
        return table if view is None else len(view.selected) + table - view.tail_from

    def wants_queries(self, seq, new_tokens: int) -> bool:
        """Whether seq's resident set is chosen after a step bringing new_tokens (the step captures queries)."""
        member = self.members.get(id(seq))
        if member is None:
            return False
        grown = self.resident_blocks(seq) + self.blocks.blocks_for(seq.num_computed + new_tokens) - len(seq.block_table)
        return grown > self.budget_blocks and (member.since + new_tokens >= self.interval
                                                or seq.num_computed + new_tokens < seq.num_tokens)

    def committed(self, seq, n: int) -> None:
        """seq's next n positions were committed: queue its newly full blocks' host copies, summarise its
        newly complete chunks, and mark it for re-choosing when due."""
        member = self.members.get(id(seq))
        if member is None:
            return
        bs = self.cache.block_size
        full = seq.num_computed // bs
        self._saves += [(seq.block_table[i], member.host[i]) for i in range(member.saved, full)]
        member.saved = max(member.saved, full)
        chunks = seq.num_computed // (self.chunk_blocks * bs)
        if chunks > member.summaries.count:
            self._summarise(seq, member, member.summaries.count, chunks)
        member.since += n
        member.prefilling = prefilling = seq.num_computed < seq.num_tokens  # more of the prompt to come
        due = self.resident_blocks(seq) > self.budget_blocks and (member.since >= self.interval or prefilling)
        if due and seq not in self._reselect:
            self._reselect.append(seq)

    def _summarise(self, seq, member: Residency, first: int, end: int) -> None:
        """Summarise chunks first..end-1 in one pass a layer (one layer's float32 keys live at a time)."""
        bs, cb = self.cache.block_size, self.chunk_blocks
        blocks = [seq.block_table[i] for i in range(first * cb, end * cb)]
        device = self.score_caches[0].values.device
        slots = (host_to_device(blocks, device, torch.long)[:, None] * bs + torch.arange(bs, device=device)).flatten()
        bounds = [chunk_bounds(k.gather(slots.to(k.values.device), torch.float32)
                               .view(end - first, cb * bs, k.num_kv_heads, -1)).to(device) for k in self.score_caches]
        member.summaries.extend(bounds)

    def finish_step(self, queries: dict | None, rows: dict[int, int]) -> None:
        """After the step's commits: issue its host copies, then re-choose the due sequences' resident
        sets with the queries the step captured (rows: id(seq) -> its row in them)."""
        if self._saves:
            device_blocks, host_blocks = zip(*self._saves)
            self.store.save(list(device_blocks), list(host_blocks))
            self._saves = []
        due, self._reselect = self._reselect, []
        for seq in due:
            member = self.members.get(id(seq))
            if member is None:
                continue
            row = rows.get(id(seq))
            if queries is not None and row is not None:
                member.queries = [queries[id(k)][row].clone() for k in self.score_caches]  # graph buffers get reused
            self._choose(seq, member)

    def land(self) -> None:
        """Pooled sequences whose page-ins have landed switch to their new resident sets (called before
        a step is planned or launched ahead, so each step reads one set throughout)."""
        for member in self.members.values():
            if member.pending is not None and member.pending.loading.done():
                self._switch(member)

    def _choose(self, seq, member: Residency) -> None:
        if member.pending is not None:  # chosen again before the last choice landed: it takes over first
            self._switch(member)
        cb, table, released = self.chunk_blocks, seq.block_table, self.blocks.released
        num_chunks = -(-len(table) // cb)
        scores = member.summaries.scores(member.queries) if member.queries is not None else None
        chunks, tail_chunk = choose_chunks(num_chunks, self.budget_chunks, self.protection, scores)
        tail_from = tail_chunk * cb
        wanted = [b for c in chunks for b in range(c * cb, (c + 1) * cb)]
        keep = set(wanted)
        evict = [i for i in range(tail_from) if table[i] != released and i not in keep]
        enter = [i for i in wanted if table[i] == released]
        member.since = 0
        self.reselects += 1
        # Decoding, within the blocks the plan gives the sequence: the copies overlap the next steps, which
        # read the old set. A prompt chunk needs its room for the next chunk: the old set goes first.
        if (enter and not member.prefilling and self.blocks.num_free_blocks >= len(enter)
                and self.blocks.held(table) + len(enter) <= self.planned_blocks):
            taken = self.blocks.take(len(enter))
            loading = self.store.load([member.host[i] for i in enter], taken, wait=False)
            member.pending = PageIn(enter, taken, evict, tail_from, loading)
            return
        if evict:
            self.blocks.evict(table, evict)
            self.store.fence()  # their host copies are complete before the blocks are written again
        if enter:
            enter = enter[:self.blocks.num_free_blocks]  # never short in practice: it just gave blocks back
            taken = self.blocks.take(len(enter))
            self.store.load([member.host[i] for i in enter], taken)
            for i, block in zip(enter, taken):
                table[i] = block
        self._view(seq, tail_from, len(evict), len(enter))

    def _switch(self, member: Residency) -> None:
        """A page-in's resident set takes over: its blocks join the table, the leaving ones go back."""
        page, seq = member.pending, member.seq
        member.pending = None
        page.loading.join()
        table = seq.block_table
        for i, block in zip(page.enter, page.blocks):
            table[i] = block
        if page.evict:
            self.blocks.evict(table, page.evict)
            self.store.fence()
        self._view(seq, page.tail_from, len(page.evict), len(page.enter))

    def _view(self, seq, tail_from: int, evicted: int, entered: int) -> None:
        released = self.blocks.released
        selected = tuple(i for i in range(tail_from) if seq.block_table[i] != released)
        view = KVView(selected, tail_from, self.cache.block_size)
        seq.kv_view = None if len(selected) == tail_from else view
        self.evicted += evicted
        self.paged_in += entered


def host_memory_available() -> int:
    """Bytes of host memory available now (Linux: MemAvailable; elsewhere free pages), 0 when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_host_bytes(block_bytes: int, blocks: int) -> int:
    """`blocks` host blocks (whole contexts), at most half the host's available memory."""
    wanted = block_bytes * blocks
    available = host_memory_available()
    return min(wanted, available // 2) if available else wanted


def device_tokens_per_sequence(pool_tokens: int, step_tokens: int, interval: int) -> int:
    """Device KV a pooled sequence may hold at once: its pool, then what a prompt chunk or an interval adds."""
    return pool_tokens + max(step_tokens, interval) + KV_POOL_CHUNK
