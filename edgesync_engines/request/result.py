"""What a request returns: :class:`GenerationResult` (its JSON is ``to_dict()``) and, for a
streamed request, :class:`GenerationStream`."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterator

from edgesync_engines.request.plan import hit_kind

if TYPE_CHECKING:
    from edgesync_engines.request.execute import Injection
    from edgesync_engines.request.plan import ReusePlan

log = logging.getLogger(__name__)

_END = object()
"""What the reading thread of :meth:`GenerationStream.__aiter__` queues after the last piece."""
READ_AHEAD = 4
"""Pieces the reading thread of ``async for`` hands on ahead of its consumer."""
LEAVE_POLL_S = 0.05
"""Seconds between the reading thread's looks at whether its consumer left."""


@dataclass
class GenerationResult:
    """What one request produced and what it cost: counts in tokens, times in ms, sizes in bytes.

    Attributes:
        hit: ``exact``, ``partial`` or ``miss`` (:class:`~edgesync_engines.request.plan.HitKind`).
        similarity, lookup_ms, donor: the semantic lookup's best cosine, its cost (encode, search,
            donor checks) and the hex key of the donor used (None: no lookup, or no donor).
        tokens_prefilled: tokens this request evaluated (in the approximate mode, the donor's).
        approximate: the KV injected is not the prompt's own (a donor, or a blend).
        ram_tier_hits, bytes_read: fragments injected from the RAM tier; compressed bytes read
            from the store for the rest.
        convertible, source_engine: KV written by another engine was converted; the engine whose
            KV was injected (None on a miss and for a donor served whole).
        uncached_reason: why the engine's KV cannot be cached (served uncached), else None.
        documents, retrieval_scores: document IDs (64 hex digits) in prompt order, and their
            retrieval cosines (None when given).
        blended_tokens, recomputed_tokens: ``blend``: document tokens whose stored KV was kept,
            and tokens evaluated against the assembled prompt.
        blend_refusal: why a blend asked for ran exact, else None.
        documents_computed: the prompt's documents whose KV this request computed and stored.
        live_tokens: tokens of ``tokens_reused`` the engine's live sequence already held.
        finish_reason: ``stop`` (end-of-generation token or stop string), ``length`` or
            ``cancelled``; ``tokens`` are those decoded either way.
        idle_wait_ms, idle_wait_tokens: the wait for idle-time work to stop (None: none ran),
            and the tokens it evaluated meanwhile.
        slot: the engine's sequence that answered (0 without ``config.slots``).
    """

    text: str
    tokens: list[int]
    hit: str
    similarity: float | None
    prompt_tokens: int
    tokens_reused: int
    tokens_prefilled: int
    ttft_ms: float
    total_ms: float
    bytes_read: int
    fragments_written: int = 0
    approximate: bool = False
    lookup_ms: float | None = None
    donor: str | None = None
    ram_tier_hits: int = 0
    convertible: bool = False
    source_engine: str | None = None
    uncached_reason: str | None = None
    blended_tokens: int = 0
    recomputed_tokens: int = 0
    documents: list[str] = field(default_factory=list)
    retrieval_scores: list[float] | None = None
    blend_refusal: str | None = None
    documents_computed: int = 0
    live_tokens: int = 0
    finish_reason: str = "stop"
    idle_wait_ms: float | None = None
    idle_wait_tokens: int = 0
    slot: int = 0

    @classmethod
    def of(cls, tokens: list[int], out: list[int], text: str, plan: "ReusePlan", injected: "Injection",
           written: int, ttft_ms: float, total_ms: float, uncached_reason: str | None) -> "GenerationResult":
        """The result of a request of prompt ``tokens`` answered with ``out`` (``text``), from
        its plan and what was injected (and its log line)."""
        n, reused = len(tokens), injected.reused
        hit = hit_kind(reused, n, injected.approximate)
        log.info("request: %d prompt tokens, hit %s%s, reused %d, similarity %s, ttft %.1f ms", n, hit,
                 " (approximate)" if injected.approximate else " (convertible)" if injected.convertible else "",
                 reused, "-" if plan.similarity is None else f"{plan.similarity:.3f}", ttft_ms)
        return cls(
            text=text, tokens=out, hit=hit, similarity=plan.similarity, prompt_tokens=n, tokens_reused=reused,
            tokens_prefilled=len(injected.tokens) - reused, ttft_ms=ttft_ms, total_ms=total_ms,
            bytes_read=injected.bytes_read, fragments_written=written, approximate=injected.approximate,
            lookup_ms=None if plan.lookup_ms is None else plan.lookup_ms + injected.donor_ms,
            donor=injected.donor, ram_tier_hits=injected.ram_tier_hits, convertible=injected.convertible,
            source_engine=injected.source_engine, uncached_reason=uncached_reason,
            live_tokens=injected.reused if injected.live else 0,
        )

    def to_dict(self) -> dict:
        """The fields as a JSON-able dict (what the CLI prints)."""
        return asdict(self)


class StopDecoding(Exception):
    """Thrown into a request's generator (:meth:`GenerationStream.stop`): decode no more."""


class GenerationStream:
    """Iterator over the text pieces of a streamed generation; ``result`` is set at the end.

    The engine is locked from the first piece until the stream is exhausted or closed (stop
    early with :meth:`close` or ``with``). The thread that reads a stream first must read, stop
    and close it (the lock is that thread's); another thread's call raises RuntimeError. Async
    code reads it with ``async for`` (:meth:`__aiter__`), on a reading thread of its own.
    """

    def __init__(self, events: Iterator[str]) -> None:
        self._source = events
        self._events = events
        self._result: GenerationResult | None = None
        self._owner: int | None = None  # the thread that reads the stream (and holds the engine)
        self._reader: threading.Thread | None = None  # the reading thread of ``async for``
        self._leave = threading.Event()  # set when the async reader's consumer is gone

    def _check_owner(self) -> None:
        """Make the calling thread the stream's, or raise RuntimeError if another thread is
        (while the stream runs: a finished one holds nothing)."""
        me = threading.get_ident()
        if self._result is None and self._owner not in (None, me):
            raise RuntimeError("EdgeSync: this stream is being read by another thread, which holds the engine "
                               "until it ends: read, stop and close a stream on one thread")
        self._owner = me

    @classmethod
    def start(cls, events: Iterator) -> "GenerationStream":
        """Wrap a request generator (``EdgeSync._run``), running it to its first yield now so
        that input errors raise here, not at iteration."""
        stream = cls(events)
        first = next(events, None)
        if first is None or isinstance(first, GenerationResult):
            stream._result = first
            stream._events = iter(())
            return stream

        def chained() -> Iterator[str]:
            piece = first
            while True:
                if isinstance(piece, GenerationResult):
                    stream._result = piece
                    return
                if piece:
                    yield piece
                piece = next(events)

        stream._events = chained()
        return stream

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> str:
        self._check_owner()
        return next(self._events)

    @property
    def result(self) -> GenerationResult | None:
        """The request's result once the stream ended (None while it runs). After an ``async
        for`` left early, it waits for the reading thread to stop the stream (one token at
        most, once the engine is the stream's)."""
        reader = self._reader
        if reader is not None and self._leave.is_set() and reader is not threading.current_thread():
            reader.join()
        return self._result

    def stop(self) -> GenerationResult | None:
        """End decoding now (idempotent; releases the engine): the prompt is still stored, and
        :attr:`result` (returned; None if the request never reached the engine) holds the
        tokens decoded so far, ``finish_reason`` ``cancelled``. A stream an ``async for`` reads
        is stopped by its reading thread, which this waits for.

        Raises RuntimeError when another thread reads the stream."""
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            self._leave.set()
            reader.join()
            return self._result
        self._check_owner()
        if self._result is None:
            try:
                last = self._source.throw(StopDecoding())
                while not isinstance(last, GenerationResult):  # pieces already decoded
                    last = next(self._source)
                self._result = last
            except (StopDecoding, StopIteration, ValueError):
                pass  # the request ended before it reached the engine (or is running: ValueError)
        self._close_generators()
        return self._result

    def close(self) -> None:
        """Stop generating and release the engine (idempotent): :meth:`stop`, whose result is
        kept in :attr:`result`."""
        self.stop()

    def __aiter__(self) -> AsyncIterator[str]:
        """The pieces for ``async for`` (and Starlette's ``StreamingResponse``): a thread of the
        stream's own reads it and hands each piece to the event loop. Leaving early (``break``,
        an error, a cancelled task) stops decoding at the next token; :attr:`result`,
        :meth:`stop` and :meth:`close` wait for that.

        Raises RuntimeError when ``next()`` read the stream and it is not done, or another
        ``async for`` reads it already."""
        if self._reader is not None and self._reader.is_alive():
            raise RuntimeError("EdgeSync: another async for reads this stream already")
        if self._owner is not None and self._result is None:
            raise RuntimeError("EdgeSync: this stream was read with next(), and holds the engine for that thread: "
                               "read it to the end the same way, or close it")
        return _AsyncPieces(self)

    def _read_for(self, loop: asyncio.AbstractEventLoop, pieces: asyncio.Queue, room: threading.Semaphore) -> None:
        """The reading thread of :meth:`__aiter__`: pieces onto ``pieces`` (at most :data:`READ_AHEAD` ahead)."""

        def wait_for_room() -> bool:
            while not room.acquire(timeout=LEAVE_POLL_S):
                if self._leave.is_set():
                    return False
            return not self._leave.is_set()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody reads any more
                self._leave.set()

        try:
            for piece in self:
                if not wait_for_room():  # the consumer left
                    break
                put(piece)
        except BaseException as exc:  # the reader's error is the async caller's
            put(exc)
        finally:
            try:
                self.stop()
            except RuntimeError:  # next() on another thread took the stream first (its error is put above)
                pass
            put(_END)

    def _close_generators(self) -> None:
        for gen in (self._events, self._source):
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> "GenerationStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _AsyncPieces:
    """The async iterator of :meth:`GenerationStream.__aiter__`; unreferenced by the stream, so
    a ``break`` frees it at once and it stops the reading thread."""

    def __init__(self, stream: GenerationStream) -> None:
        self._stream = stream
        self._pieces: asyncio.Queue | None = None
        self._room = threading.Semaphore(READ_AHEAD)

    def __aiter__(self) -> "_AsyncPieces":
        return self

    async def __anext__(self) -> str:
        stream = self._stream
        if self._pieces is None:
            if stream._reader is not None and stream._reader.is_alive():
                raise RuntimeError("EdgeSync: another async for reads this stream already")
            self._pieces = asyncio.Queue()
            stream._reader = threading.Thread(target=stream._read_for,
                                              args=(asyncio.get_running_loop(), self._pieces, self._room),
                                              name="edgesync-stream", daemon=True)
            stream._reader.start()
        try:
            item = await self._pieces.get()
        except BaseException:  # cancelled: the consumer is gone
            stream._leave.set()
            raise
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        self._room.release()
        return item

    async def aclose(self) -> None:
        self._leave()

    def __del__(self) -> None:
        self._leave()

    def _leave(self) -> None:
        if self._pieces is not None:  # this one started the reading thread
            self._stream._leave.set()
