"""The source worker's background saver: a finished request's KV goes to the store off the engine's step path.

    wait_for_save (step path)  ->  submit(job): counted against the queue's byte limit, or dropped at once
    copier thread              ->  job.snapshot(): the request's KV copied out of the paged cache (on a GPU, on a
                                   side stream into pinned host memory); then its blocks are released
    writer thread              ->  job.write(*copy): packed and written to the store

A request's blocks stay held (vLLM delays their free) until the copier has read them: then `take_released` reports
the request, and get_finished hands it to vLLM. A job that does not fit the queue is dropped (counted as
`dropped`; its blocks are released at once, and a later handoff of that prefix re-prefills). Nothing here raises
into the engine: a job that fails is counted and logged; a thread that dies releases every held request and every
later job is dropped. close() drains the queues for a bounded time, then abandons what is left, with a log line."""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from vllm.logger import init_logger

logger = init_logger("vllm.crosskv")

# engine_id -> the source worker in this process that saves every KV head of its engine (an engine of one worker, in
# the scheduler's process): the scheduler side hands it each finished request at once, so a save needs no further
# step of the engine (an offline LLM.generate's last batch, an engine that idles).
LOCAL_SAVERS: dict = {}


def local_saver(engine_id: Optional[str]):
    return LOCAL_SAVERS.get(engine_id) if engine_id else None


# The outcomes of a save, as the metrics count them.
STORED, SHARED, DROPPED, FAILED, ABANDONED = "stored", "shared", "dropped", "failed", "abandoned"


@dataclass
class SaveJob:
    req_id: str
    nbytes: int  # host bytes its copy takes until written
    snapshot: Callable[[], tuple]  # -> the copy out of the paged cache, as write's arguments
    write: Callable[..., tuple]  # (*copy) -> (chunks written, chunks already stored)
    queued_at: float = field(default_factory=time.perf_counter)


class Saver:
    def __init__(self, limit_bytes: int, name: str = "crosskv-saver"):
        self.limit_bytes = limit_bytes
        self._cv = threading.Condition()
        self._to_copy: collections.deque = collections.deque()
        self._to_write: collections.deque = collections.deque()
        self._bytes = 0  # of jobs queued, being copied, or waiting to be written
        self._busy = 0  # jobs a thread holds right now
        self._released: set[str] = set()
        self._counts: collections.Counter = collections.Counter()
        self._seconds: list[float] = []  # submit to written, per job
        self.peak_bytes = 0
        self.dead: Optional[str] = None
        self._closing = False
        self._threads = [threading.Thread(target=self._loop, args=(stage,), name=f"{name}-{stage}", daemon=True)
                         for stage in ("copy", "write")]
        for t in self._threads:
            t.start()

    # ---------------------------------------------------------------------------------------- the step path
    def submit(self, job: SaveJob) -> bool:
        """Queues the job, or drops it (False): the queue's bytes would pass the limit, the saver is closing, or a
        thread of it died. A dropped job's request is released at once."""
        with self._cv:
            why = ("the saver stopped: " + self.dead if self.dead else "the saver is shutting down" if self._closing
                   else None if self._bytes + job.nbytes <= self.limit_bytes else
                   f"the save queue holds {self._bytes} of {self.limit_bytes} bytes; this save needs {job.nbytes}")
            if why:
                self._counts[DROPPED] += 1
                self._released.add(job.req_id)
            else:
                self._bytes += job.nbytes
                self.peak_bytes = max(self.peak_bytes, self._bytes)
                self._to_copy.append(job)
                self._cv.notify_all()
        if why:
            logger.warning("crosskv: request %s: its KV is not saved (dropped): %s", job.req_id, why)
        return why is None

    def take_released(self) -> set[str]:
        """Requests whose blocks the saver no longer needs, since the last call."""
        with self._cv:
            out, self._released = self._released, set()
        return out

    def take_counts(self) -> tuple[dict, list[float]]:
        """Save outcomes since the last call, and the seconds each written save took from submit."""
        with self._cv:
            out, self._counts = dict(self._counts), collections.Counter()
            seconds, self._seconds = self._seconds, []
        return out, seconds

    @property
    def queued_bytes(self) -> int:
        with self._cv:
            return self._bytes

    def idle(self) -> bool:
        with self._cv:
            return not (self._to_copy or self._to_write or self._busy)

    # ------------------------------------------------------------------------------------------- threads
    def _loop(self, stage: str):
        queue = self._to_copy if stage == "copy" else self._to_write
        item = None
        try:
            while True:
                item = None
                with self._cv:
                    while not queue and not self.dead and not (self._closing and self.idle_unlocked()):
                        self._cv.wait()
                    if self.dead or not queue:
                        return
                    item = queue.popleft()
                    self._busy += 1
                try:
                    self._copy(item) if stage == "copy" else self._write(*item)
                finally:
                    with self._cv:
                        self._busy -= 1
                        self._cv.notify_all()
        except BaseException as e:  # a bug in the saver itself: the engine goes on, without saving
            self._die(f"{stage} thread: {type(e).__name__}: {e}", item[0] if isinstance(item, tuple) else item,
                      release=stage == "copy")  # a job being written was released after its copy

    def idle_unlocked(self) -> bool:
        return not (self._to_copy or self._to_write or self._busy)

    def _copy(self, job: SaveJob):
        try:
            copy = job.snapshot()
        except Exception as e:
            logger.warning("crosskv: request %s: its KV could not be read out of the cache: %s: %s", job.req_id,
                           type(e).__name__, e)
            self._finish(job, FAILED, release=True)
            return
        with self._cv:
            self._released.add(job.req_id)
            self._to_write.append((job, copy))
            self._cv.notify_all()

    def _write(self, job: SaveJob, copy: tuple):
        try:
            written, shared = job.write(*copy)
            outcome = STORED if written else SHARED
        except Exception as e:  # an unsaved prefix only means a later re-prefill
            logger.warning("crosskv: request %s: its KV was not saved: %s: %s", job.req_id, type(e).__name__, e)
            outcome = FAILED
        self._finish(job, outcome)

    def _finish(self, job: SaveJob, outcome: str, release: bool = False):
        with self._cv:
            self._bytes -= job.nbytes
            self._counts[outcome] += 1
            if outcome in (STORED, SHARED):
                self._seconds.append(time.perf_counter() - job.queued_at)
            if release:
                self._released.add(job.req_id)

    def _die(self, why: str, held: Optional[SaveJob], release: bool):
        logger.error("crosskv: the saver stopped (%s); the engine goes on, and no later request's KV is saved", why)
        with self._cv:
            self.dead = why
            if held is not None:  # the job the thread held when it died
                self._bytes -= held.nbytes
                self._counts[FAILED] += 1
                if release:
                    self._released.add(held.req_id)
            self._abandon()
            self._cv.notify_all()

    def _abandon(self) -> tuple[int, int]:
        """Every queued job given up (under the lock): (count, bytes)."""
        jobs = list(self._to_copy) + [j for j, _ in self._to_write]
        self._to_copy.clear()
        self._to_write.clear()
        for j in jobs:
            self._bytes -= j.nbytes
            self._released.add(j.req_id)
        self._counts[ABANDONED] += len(jobs)
        return len(jobs), sum(j.nbytes for j in jobs)

    # ------------------------------------------------------------------------------------------ shutdown
    def close(self, drain_seconds: float) -> bool:
        """Writes what is queued for at most drain_seconds, then abandons the rest; True when everything was written.
        One log line says which."""
        t0 = time.monotonic()
        with self._cv:
            if self._closing:  # closed already (vLLM's shutdown, then the exit's)
                return self.idle_unlocked()
            self._closing = True
            self._cv.notify_all()
            pending = len(self._to_copy) + len(self._to_write) + self._busy
            while not self.idle_unlocked() and not self.dead and time.monotonic() - t0 < drain_seconds:
                self._cv.wait(timeout=max(0.0, min(0.1, drain_seconds - (time.monotonic() - t0))))
            n, nbytes = self._abandon()
            busy = self._busy
            self._cv.notify_all()
        if pending:
            if n or busy:
                logger.warning("crosskv: shutdown: %d queued saves abandoned (%d bytes) after %.1f s; %d still being "
                               "written", n, nbytes, time.monotonic() - t0, busy)
            else:
                logger.info("crosskv: shutdown: the save queue (%d saves) drained in %.2f s", pending,
                            time.monotonic() - t0)
        return not (n or busy)
