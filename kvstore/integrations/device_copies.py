"""Every copy between host memory and a paged KV cache on a device that the connectors make
(this repository's engine, `engine/connector.py`, and vLLM's worker, `vllm_worker.py`), in a
stated order. On a GPU the order is what makes such copies right or wrong, so it is written
down here once, and tested on the CPU through a simulated device (`SimStreams`).

The rules:

- A **load** (host staging rows -> paged cache) runs on a copy stream of its own and an event
  is recorded after it (`load`). The connector reports the load finished (so the engine
  schedules the request) only once that event has completed: it asks with `Event.query` on the
  step loop, never a device-wide synchronize there. The step loop waits on one load's event
  only when it is idle with nothing else to do (the engine's `poll(timeout_s)`, the vLLM
  worker's idle `finished`): the copy is already in flight, so waiting on it costs nothing
  the engine could have used, and a spin of empty steps would only steal the loader threads'
  time.
- A **save** (paged cache -> host staging) reads the cache only after the forward pass that
  wrote it: `save` records an event on the forward (current) stream and the copy stream waits
  on it before the copy. The blocks a save reads must not be overwritten by a later forward
  pass before its copy completed: the forward stream waits on the save's event (a wait
  enqueued on the device, which does not block the host). The other choice, keeping the
  blocks from their next owner until the copy is done, would need the engine's block manager
  and vLLM's scheduler to hold freed blocks back, which neither can be told to do; a save's
  copy runs at PCIe speed, so the next forward pass starts late by at most that long, where
  the synchronous gather this replaces blocked the host for the same time.
- A **staging buffer** is re-used or freed only after the copy that reads or fills it
  completed: load staging comes from a small pool (`take`) that hands a buffer out again only
  once the event of the copy that last read it has completed; save staging belongs to the
  link's writer until it has put the rows, and whoever reads those rows (the writer, and loads
  that find them still queued, `StoreLink._from_pending`) first calls the save's `ready`,
  which waits for its event, off the step loop.

The device is reached through `Streams`, with three implementations: `CudaStreams` (torch CUDA
streams and events, non-blocking copies from pinned memory; tensors a copy uses stay
referenced until its event completed, and device temporaries are made on the copy stream, so
the caching allocator never hands their memory to other work while the copy runs),
`ImmediateStreams` (the CPU: every operation runs at once and every event is complete, so the
CPU path costs what it did before this module), and `SimStreams` (for tests: a CPU device
that defers every enqueued operation until it is told to run, respects waits between its
streams, and logs the order it ran them in; an ordering mistake then shows on the CPU as old
bytes in the cache, or wrong bytes in a buffer).
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

__all__ = ["DONE", "CudaStreams", "DeviceCopies", "Event", "ImmediateStreams", "SimDevice",
           "SimStreams", "Streams", "copies_for", "device_ids"]

POOLED_BUFFERS = 4
"""Load staging buffers the pool keeps when they are idle: one per loader thread
(`link.LOADERS`), since that many loads fill staging at once; more would only hold pinned
host memory that no load is using."""


class Event(Protocol):
    """A point in a stream's work: complete once everything enqueued before it has run."""

    def query(self) -> bool:
        """Whether the event has completed; never waits."""
        ...

    def synchronize(self) -> None:
        """Wait until the event has completed (for loader and writer threads, and for an idle
        step loop)."""
        ...


class _Done:
    """An event that has already completed: what the immediate streams return."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


DONE: Event = _Done()
"""The completed event."""


class Streams(Protocol):
    """A device's forward stream (whatever stream the engine's forward pass runs on: the
    current one) and a copy stream of the connector's own."""

    def forward_event(self) -> Event:
        """Record an event on the forward stream now: it completes once the work enqueued
        there so far (the forward pass) has run."""
        ...

    def on_copy(self, op: Callable[[], object], *, after: Event | None = None,
                keep: Sequence[torch.Tensor] = (), name: str = "copy") -> Event:
        """Enqueue op on the copy stream, after `after` completed, and return an event
        recorded after it. keep: tensors op reads or writes that were made outside it; they
        must stay valid until the returned event completed. name: what op is, for logs."""
        ...

    def forward_waits(self, event: Event) -> None:
        """Work enqueued on the forward stream from now on runs only after event completed."""
        ...


class ImmediateStreams:
    """The CPU: every operation runs when it is enqueued, every event is complete."""

    def forward_event(self) -> Event:
        return DONE

    def on_copy(self, op: Callable[[], object], *, after: Event | None = None,
                keep: Sequence[torch.Tensor] = (), name: str = "copy") -> Event:
        op()
        return DONE

    def forward_waits(self, event: Event) -> None:
        return None


class _CudaEvent:
    """A torch.cuda.Event and the tensors its copy uses, held until it completed."""

    def __init__(self, event: torch.cuda.Event, keep: Sequence[torch.Tensor]) -> None:
        self.event = event
        self._keep: list[torch.Tensor] | None = list(keep)

    def query(self) -> bool:
        done = bool(self.event.query())  # type: ignore[no-untyped-call]
        if done:
            self._keep = None
        return done

    def synchronize(self) -> None:
        self.event.synchronize()  # this one event, never the whole device
        self._keep = None


class CudaStreams:
    """torch CUDA streams: the forward stream is the current stream of the thread that calls
    (the engine's step loop), the copy stream one made here."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def forward_event(self) -> Event:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return _CudaEvent(event, ())

    def on_copy(self, op: Callable[[], object], *, after: Event | None = None,
                keep: Sequence[torch.Tensor] = (), name: str = "copy") -> Event:
        with torch.cuda.stream(self.copy):
            if isinstance(after, _CudaEvent):
                self.copy.wait_event(after.event)
            # Tensors made outside this stream (the cache, say) that the copy uses: the
            # caching allocator must not give their memory to other work before the copy
            # ran. Device tensors are marked as used here; host tensors (pinned staging)
            # are held by the event below until it completed.
            for tensor in keep:
                if tensor.is_cuda:
                    tensor.record_stream(self.copy)
            op()
            # blocking: a thread that waits on it (the link's writer, a loader, an idle step
            # loop) sleeps instead of spinning a core the step loop's thread may need.
            event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            event.record(self.copy)
        return _CudaEvent(event, keep)

    def forward_waits(self, event: Event) -> None:
        if isinstance(event, _CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.event)


# -- the simulated device -----------------------------------------------------------------

class SimEvent:
    """An event of the simulated device: complete once the device ran its record."""

    def __init__(self, device: SimDevice, name: str) -> None:
        self.device = device
        self.name = name
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        """Run the device until this event completed, as a real device keeps running while
        the host waits; raises if nothing left can complete it (a wait that never ends)."""
        self.device.run(until=self)


@dataclass
class _Op:
    kind: str  # "run", "wait" or "record"
    name: str
    fn: Callable[[], object] | None = None
    event: SimEvent | None = None


@dataclass
class SimDevice:
    """A CPU stand-in for a GPU with two streams, "forward" and "copy". Enqueued operations
    run only when the device is run (`run`, `step`, or a host waiting on an event), in stream
    order, a "wait" holding its stream until its event completed. Which stream goes first
    when both could run is `prefer`: real hardware may run them in any order the waits allow,
    so a test picks the order that would expose the mistake it looks for. `log` names every
    operation run, in order ("copy:load", "forward:step", ...)."""

    prefer: str = "copy"
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prefer not in ("copy", "forward"):
            raise ValueError(f"prefer must be 'copy' or 'forward', got {self.prefer!r}")
        self._queues: dict[str, deque[_Op]] = {"forward": deque(), "copy": deque()}
        self._lock = threading.RLock()
        self.enqueued: dict[str, int] = {"forward": 0, "copy": 0}
        """Operations of kind "run" enqueued on each stream so far."""

    def enqueue(self, stream: str, op: _Op) -> None:
        with self._lock:
            self._queues[stream].append(op)
            if op.kind == "run":
                self.enqueued[stream] += 1

    def forward(self, fn: Callable[[], object], name: str = "step") -> None:
        """Enqueue work of the forward pass (a test's stand-in for a model's kernels)."""
        self.enqueue("forward", _Op("run", name, fn))

    @contextmanager
    def held(self) -> Iterator[None]:
        """Nothing runs on the device while this is held (by the thread holding it): a test
        enqueues several operations as one, with no thread waiting on an event between."""
        with self._lock:
            yield

    def pending(self) -> int:
        """Operations enqueued and not run yet."""
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def step(self) -> bool:
        """Run the next operation that can run (of the preferred stream first); False when
        none can."""
        with self._lock:
            order = (self.prefer, "forward" if self.prefer == "copy" else "copy")
            for stream in order:
                queue = self._queues[stream]
                if not queue:
                    continue
                op = queue[0]
                if op.kind == "wait" and op.event is not None and not op.event.done:
                    continue
                queue.popleft()
                if op.kind == "run" and op.fn is not None:
                    op.fn()
                    self.log.append(f"{stream}:{op.name}")
                elif op.kind == "record" and op.event is not None:
                    op.event.done = True
                return True
            return False

    def run(self, until: SimEvent | None = None) -> None:
        """Run until nothing more can run, or until `until` completed."""
        with self._lock:
            while until is None or not until.done:
                if not self.step():
                    break
            if until is not None and not until.done:
                raise RuntimeError(f"simulated device: event {until.name} can never complete "
                                   f"({self.pending()} operations stuck behind waits)")


class SimStreams:
    """`Streams` over a SimDevice: nothing runs until the device is run."""

    def __init__(self, device: SimDevice | None = None) -> None:
        self.device = device or SimDevice()
        self._count = 0

    def _event(self, stream: str) -> SimEvent:
        self._count += 1
        event = SimEvent(self.device, f"{stream}#{self._count}")
        self.device.enqueue(stream, _Op("record", event.name, event=event))
        return event

    def forward_event(self) -> Event:
        return self._event("forward")

    def on_copy(self, op: Callable[[], object], *, after: Event | None = None,
                keep: Sequence[torch.Tensor] = (), name: str = "copy") -> Event:
        if isinstance(after, SimEvent):
            self.device.enqueue("copy", _Op("wait", "wait", event=after))
        self.device.enqueue("copy", _Op("run", name, op))
        return self._event("copy")

    def forward_waits(self, event: Event) -> None:
        if isinstance(event, SimEvent):
            self.device.enqueue("forward", _Op("wait", "wait", event=event))


# -- the copies -----------------------------------------------------------------------------

def _capacity(rows: int) -> int:
    """Rows of a pooled buffer for a request of `rows`: the next power of two, so loads of
    nearby sizes share buffers."""
    return 1 << max(0, rows - 1).bit_length()


class DeviceCopies:
    """The connectors' copies between host staging and a paged cache, in the order stated in
    the module docstring, over `streams`.

    - `take(rows, row_shape, dtype)`: load staging (pinned when `pin`), from the pool;
    - `load(staging, place)`: `place()` (which reads staging into the cache) on the copy
      stream; staging goes back to the pool with the load's event; returns the event;
    - `staging(rows, row_shape, dtype)`: save staging of the caller's own (not pooled: the
      link's writer holds it until it has put the rows);
    - `save(fill, staging)`: `fill()` (which copies cache blocks into staging) on the copy
      stream after the forward pass enqueued so far, the forward stream then waiting on it;
      returns the save's event, whose `synchronize` is the `ready` the link calls before it
      reads the rows.
    """

    def __init__(self, streams: Streams, *, pin: bool = False) -> None:
        self.streams = streams
        self.pin = pin
        self._lock = threading.Lock()
        self._pool: list[tuple[torch.Tensor, Event]] = []

    def staging(self, rows: int, row_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((rows, *row_shape), dtype=dtype, pin_memory=self.pin)

    def take(self, rows: int, row_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A load staging buffer of `rows` rows whose previous copy (if any) has completed."""
        capacity = _capacity(rows)
        with self._lock:
            for i, (buffer, event) in enumerate(self._pool):
                if (buffer.shape[0] == capacity and tuple(buffer.shape[1:]) == tuple(row_shape)
                        and buffer.dtype == dtype and self._reusable(event)):
                    del self._pool[i]
                    return buffer[:rows]
        return self.staging(capacity, row_shape, dtype)[:rows]

    def _reusable(self, event: Event) -> bool:
        """Whether a pooled buffer may be handed out again: its last copy has completed."""
        return event.query()

    def give_back(self, staging: torch.Tensor, event: Event) -> None:
        """staging (from `take`) is free once event completed; the pool keeps it until then
        and hands it out only after."""
        buffer = staging if staging._base is None else staging._base
        with self._lock:
            self._pool.append((buffer, event))
            if len(self._pool) > POOLED_BUFFERS:
                # Drop the oldest buffer that is done with; one still under a copy stays
                # referenced here (never freed under its copy) until a later call.
                for i, (_, old) in enumerate(self._pool):
                    if old.query():
                        del self._pool[i]
                        break

    def load(self, staging: torch.Tensor, place: Callable[[], object],
             keep: Sequence[torch.Tensor] = ()) -> Event:
        """Run place() (staging rows -> the cache) on the copy stream; staging returns to the
        pool with the load's event, which the caller reports finished only once complete.
        keep: other tensors place() reads (blocks read in place), held until then too."""
        event = self.streams.on_copy(place, keep=(staging, *keep), name="load")
        self.give_back(staging, event)
        return event

    def save(self, fill: Callable[[], object], staging: torch.Tensor) -> Event:
        """Run fill() (the cache's blocks -> staging) on the copy stream after the forward
        pass enqueued so far; the forward stream waits on the returned event before it next
        runs, so the blocks are not overwritten under the copy."""
        after = self.streams.forward_event()
        event = self.streams.on_copy(fill, after=after, keep=(staging,), name="save")
        self.streams.forward_waits(event)
        return event


def host_tensors(sources: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """uint8 tensors over a load's sources, no copy (staging rows, or blocks' pages in L2
    read in place, `StoreLink.read_in_place`): what `rows_from` copies from, to be kept
    (`DeviceCopies.load`'s keep) until its copies completed. Read-only sources are only
    read: torch's warning about them is not raised."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [torch.from_numpy(source) for source in sources]


def rows_from(host: Sequence[torch.Tensor], row_bytes: int, device: torch.device) -> torch.Tensor:
    """A load's rows on device, each copied by itself from its host tensor; run on the copy
    stream, where from pinned memory each copy is a DMA that does not wait for the host."""
    rows = torch.empty((len(host), row_bytes), dtype=torch.uint8, device=device)
    for row, source in zip(rows, host, strict=True):
        row.copy_(source, non_blocking=True)
    return rows


def device_ids(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as int64 on the cache's device. On a GPU they go through pinned memory: a
    copy from pageable memory may wait for the stream's earlier work (on the copy stream, the
    forward pass a save waits for), and saves are enqueued from the step loop."""
    ids = torch.tensor(list(block_ids), dtype=torch.int64, pin_memory=device.type == "cuda")
    return ids.to(device, non_blocking=True)


def copies_for(device: torch.device) -> DeviceCopies:
    """The copies for a cache on `device`: CUDA streams on a CUDA device, else immediate."""
    if device.type == "cuda":
        return DeviceCopies(CudaStreams(device), pin=True)
    return DeviceCopies(ImmediateStreams())
