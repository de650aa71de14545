"""Every store call of a connector side goes through a StoreGuard, so that a store that is slow or down costs a
re-prefill, never the engine:
- a deadline: the call runs on one of the guard's threads and the caller waits at most that long (a call that
  overruns goes on in the background, bounded by the store's own socket timeout, and fails the caller now with the
  kind store_timeout);
- a circuit breaker: after `failures` consecutive late or failed calls the store is marked unhealthy and not asked
  at all for `seconds` (callers fail at once with the kind store_unhealthy); then one call probes it, and the store
  is healthy again when that call reaches it in time, whatever the data it finds (an evicted or damaged chunk is
  the data's fault, not the store's). Each change of state is logged once and counted in the metrics."""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

from vllm.logger import init_logger

from .store import PrefixError

logger = init_logger("vllm.crosskv")

HEALTHY, UNHEALTHY, PROBING = "healthy", "unhealthy", "probing"


class StoreGuard:
    def __init__(self, where: str, failures: int = 3, seconds: float = 30.0, threads: int = 4,
                 clock: Callable[[], float] = time.monotonic):
        self.where, self.failures, self.seconds, self.clock = where, failures, seconds, clock
        self.state = HEALTHY
        self.opened = 0  # times the store was marked unhealthy
        self._streak = 0  # consecutive failures
        self._until = 0.0  # while unhealthy: when a call may probe the store
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="crosskv-store")

    # ---------------------------------------------------------------------------------------- the breaker
    def admit(self) -> None:
        """Raises PrefixError(store_unhealthy) while the store is not to be asked; lets one probe through after the
        back-off."""
        with self._lock:
            if self.state == HEALTHY:
                return
            now = self.clock()
            if self.state == UNHEALTHY and now >= self._until:
                self.state = PROBING
                return
            left = max(0.0, self._until - now)
            raise PrefixError(f"the store at {self.where} is marked unhealthy after {self.failures} failed calls; not "
                              f"asked for another {left:.0f} s" if self.state == UNHEALTHY else
                              f"the store at {self.where} is marked unhealthy; a probe is under way",
                              "store_unhealthy")

    def succeeded(self) -> None:
        with self._lock:
            was, self.state, self._streak = self.state, HEALTHY, 0
        if was != HEALTHY:
            logger.warning("crosskv: the store at %s answers again: healthy", self.where)

    def failed(self, why: str) -> None:
        with self._lock:
            self._streak += 1
            if self.state == PROBING or (self.state == HEALTHY and self._streak >= self.failures):
                opened_now = self.state == HEALTHY
                self.state, self._until = UNHEALTHY, self.clock() + self.seconds
                self.opened += 1
            else:
                return
        if opened_now:
            logger.warning("crosskv: the store at %s is unhealthy after %d failed calls (the last: %s); not asked for "
                           "%.0f s, requests re-prefill meanwhile", self.where, self.failures, why, self.seconds)

    # ------------------------------------------------------------------------------------------- calls
    def call(self, what: str, fn: Callable, timeout_s: Optional[float]):
        """fn() under the breaker, waited for at most timeout_s (None: on the caller's thread, as long as the store's
        own timeout). PrefixError (store_timeout, store_unhealthy, or the store's own) otherwise."""
        self.admit()
        if timeout_s is None:
            return self._run(what, fn)
        fut = self.submit(what, fn, timeout_s)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            self.failed(f"{what}: no answer within {timeout_s * 1e3:.0f} ms")
            raise PrefixError(f"the store at {self.where} did not {what} within {timeout_s * 1e3:.0f} ms",
                              "store_timeout") from None

    def submit(self, what: str, fn: Callable, timeout_s: Optional[float] = None) -> Future:
        """fn() on a guard thread, its outcome counted by the breaker (an answer later than timeout_s is no sign of
        health: the caller counts it as a failure); the caller decides how long to wait."""
        return self._pool.submit(self._run, what, fn, timeout_s)

    def _run(self, what, fn, timeout_s=None):
        t0 = time.monotonic()
        try:
            out = fn()
        except PrefixError as e:
            if e.kind == "store_unreachable":
                self.failed(str(e))
            elif timeout_s is None or time.monotonic() - t0 <= timeout_s:
                self.succeeded()  # the store answered (evicted, damaged: the data's fault, not the store's)
            raise
        except Exception as e:  # anything else the store raised counts as a failure too, with its reason
            self.failed(f"{type(e).__name__}: {e}")
            raise PrefixError(f"the store at {self.where} cannot {what}: {type(e).__name__}: {e}",
                              "store_unreachable") from None
        if timeout_s is None or time.monotonic() - t0 <= timeout_s:
            self.succeeded()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
