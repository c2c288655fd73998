"""What a request returns: :class:`GenerationResult` (its JSON is ``to_dict()``) and, for a
streamed request, :class:`GenerationStream`."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import asdict, dataclass, field
from typing import AsyncIterator, Iterator

_END = object()
"""What the reading thread of :meth:`GenerationStream.__aiter__` queues after the last piece."""
READ_AHEAD = 4
"""Pieces the reading thread of ``async for`` hands on before its consumer takes them: one that
leaves stops decoding within about that many tokens, and a slow one holds the engine between
pieces, as a plain ``for`` does."""
LEAVE_POLL_S = 0.05
"""Seconds between the reading thread's looks at whether its consumer left, while it waits for
room to hand on a piece."""


@dataclass
class GenerationResult:
    """What one request produced and what it cost.

    Token counts are tokens; times are milliseconds; sizes are bytes. ``hit`` is the hit kind
    (:class:`~edgesync_engines.request.plan.HitKind`: ``exact``, ``partial`` or ``miss``).
    ``similarity`` is the cosine of the best donor the semantic lookup found (None when the
    lookup did not run or found none); ``lookup_ms`` the lookup's cost (encode + search + donor
    checks, None when it did not run); ``donor`` the hex key (the last fragment of its chain)
    of the nominated donor whose verified prefix was injected, or that reached as far as the
    prefix walk did, or that was served whole (None when no nominated donor matched that far).
    ``tokens_prefilled`` is what this request evaluated (``prompt_tokens - tokens_reused``,
    except in the approximate mode, where the donor's remaining tokens are evaluated instead).
    ``approximate`` is True when the answer came from a donor's KV whose tokens differ from the
    prompt's (``reuse="semantic"`` only). ``ram_tier_hits`` counts the fragments injected from
    the RAM tier instead of being read and decoded from the store (0 when ``ram_tier_bytes`` is
    0); ``bytes_read`` the compressed bytes read from the store for the rest. ``convertible``
    is True when the injected KV was written by another engine and converted
    (``allow_convertible`` only); ``source_engine`` names the engine whose KV was injected
    (None on a miss and for a donor served whole). ``uncached_reason`` is None unless
    a cache was asked for but the engine's KV cannot be cut (``EngineAdapter.cache_refusal``):
    then it says why, and the request was served uncached.

    With documents (``generate(documents=...)`` or ``retrieve=k``): ``documents`` lists the
    document IDs (64 hex digits) in prompt order, ``retrieval_scores`` the cosine of each when
    they were retrieved (None when the app passed them). In ``reuse="blend"`` (``approximate``
    True) ``blended_tokens`` counts document tokens whose stored KV was placed and kept as is,
    ``recomputed_tokens`` the document and separator tokens evaluated against the assembled
    prompt; ``tokens_reused`` is the exact prefix injected plus ``blended_tokens``.
    ``blend_refusal`` says why a blend was asked for but the request ran exact (None otherwise).
    ``documents_computed`` counts the prompt's documents whose KV this request computed and
    stored (in blend mode before the blend, otherwise after the answer).

    ``live_tokens`` counts the tokens of ``tokens_reused`` that the engine's live sequence
    already held (a previous request's prompt or idle-time work: nothing was injected).
    ``finish_reason`` is ``stop`` (an end-of-generation token or a stop string), ``length``
    (``max_tokens``) or ``cancelled`` (the caller stopped the stream); ``tokens`` are the
    tokens decoded either way. ``idle_wait_ms`` is how long the request waited for idle-time
    work to stop (None when none was running), ``idle_wait_tokens`` the tokens idle-time work
    evaluated meanwhile (at most one batch; 0 where the batch running stopped midway).
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

    def to_dict(self) -> dict:
        """The fields as a JSON-able dict (what the CLI prints)."""
        return asdict(self)


class StopDecoding(Exception):
    """Thrown into a request's generator (:meth:`GenerationStream.stop`): decode no more."""


class GenerationStream:
    """Iterator over the text pieces of a streamed generation; ``result`` is set at the end.

    The engine is locked from the first piece until the stream is exhausted or closed: a
    caller that stops early calls :meth:`close` (or uses ``with``), else other threads wait
    until the stream is garbage-collected. The thread that reads a stream first reads, stops
    and closes it to the end: the engine's lock is held across the pieces, and only the thread
    that took it can release it. Another thread's call raises RuntimeError (the stream goes on
    unharmed). Async code reads it with ``async for`` (:meth:`__aiter__`), which keeps to that
    rule with a reading thread of its own, so a thread pool never takes a piece; then
    :attr:`result`, :meth:`stop` and :meth:`close` from the loop's thread wait for that thread.
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
        """Wrap a request generator (``EdgeSync._run``: "" once the input is checked, then
        text pieces, then the :class:`GenerationResult`), running it up to its first yield now
        so that input errors raise here, not at iteration."""
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
        """End decoding now: the prompt is still stored, and :attr:`result` is set, its
        ``tokens`` those decoded so far and ``finish_reason`` ``cancelled`` (unless the
        generation had ended already). Returns the result (None if the request never reached
        the engine). Idempotent; releases the engine. For a stream an ``async for`` reads, the
        reading thread stops it, and this waits for that.

        Raises:
            RuntimeError: another thread reads the stream (see the class docstring).
        """
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
        """The pieces for ``async for`` (and for Starlette's ``StreamingResponse``, which takes
        an async iterable as it is): one thread of the stream's own reads it to the end and
        hands each piece to the event loop, so decoding never blocks the loop. Leaving the loop
        early (a ``break``, an error, a cancelled task, a client gone) stops decoding at the
        next token; :attr:`result`, :meth:`stop` and :meth:`close` wait for that.

        Raises:
            RuntimeError: the stream was read with ``next()`` and is not done, or another
                ``async for`` reads it already.
        """
        if self._reader is not None and self._reader.is_alive():
            raise RuntimeError("EdgeSync: another async for reads this stream already")
        if self._owner is not None and self._result is None:
            raise RuntimeError("EdgeSync: this stream was read with next(), and holds the engine for that thread: "
                               "read it to the end the same way, or close it")
        return _AsyncPieces(self)

    def _read_for(self, loop: asyncio.AbstractEventLoop, pieces: asyncio.Queue, room: threading.Semaphore) -> None:
        """The reading thread of :meth:`__aiter__`: every piece, then an error or the end, put on
        ``pieces`` from the loop's side (a piece once ``room`` has a place: :data:`READ_AHEAD`),
        until the consumer leaves; the stream is stopped here, on its own thread."""

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
    """The async iterator of :meth:`GenerationStream.__aiter__`. The stream keeps no reference
    to it, so a ``break`` frees it at once (CPython counts references) and it tells the reading
    thread to stop, before the event loop would get round to closing an async generator."""

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
