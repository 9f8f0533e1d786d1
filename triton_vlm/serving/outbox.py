"""The `llm` model's one thread for its clients, free of Triton: it sends every response and asks
each request in flight whether its client cancelled, so that the engine's step loop does neither
(each is a round trip to the server: a response per token per sequence, and `is_cancelled` per
sequence per step, used to sit between one step and the next).

Every call on a request's client (a decoupled response sender) happens on this thread, in the
order given, and none after the response that ended it: in Triton a request is released with its
final response, and `is_cancelled()` on it then reads freed memory. A cancellation seen here is
passed on (`watch`'s `cancel`: the engine's, which ends the request within a step), once, at most
`poll_s` after the client went away. Requests are told apart by a key of the caller's (a request
id may come twice: the second is refused, and must not take the first's place here).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

log = logging.getLogger("triton_vlm")


class Outbox:
    def __init__(self, poll_s: float = 0.02) -> None:
        self.poll_s = poll_s
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        # key -> (is_cancelled, cancel); touched on the thread alone
        self._watched: dict[object, tuple[Callable[[], bool], Callable[[], None]]] = {}
        self._thread = threading.Thread(target=self._run, name="llm-outbox", daemon=True)
        self._thread.start()

    def watch(self, key: object, is_cancelled: Callable[[], bool], cancel: Callable[[], None]) -> None:
        """Poll `is_cancelled` of request `key`, and call `cancel` once it is true, until a delivery
        of it says it was the last. Before anything is `put` for it."""
        self._todo.put((key, None, (is_cancelled, cancel)))

    def put(self, key: object, deliver: Callable[[], bool]) -> None:
        """Run `deliver()` on the thread, after what was put before; it sends a response of request
        `key` and returns whether that was its last."""
        self._todo.put((key, deliver, None))

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued, then stop."""
        self._todo.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        next_poll = time.monotonic() + self.poll_s
        while True:
            try:
                item = self._todo.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                self._take(*item)
            if time.monotonic() >= next_poll:
                self._poll()
                next_poll = time.monotonic() + self.poll_s

    def _take(self, key: object, deliver: Callable[[], bool] | None,
              watched: tuple[Callable[[], bool], Callable[[], None]] | None) -> None:
        if deliver is None:
            self._watched[key] = watched
            return
        try:
            last = deliver()
        except Exception:
            log.exception("sending a response of request %s failed", key)
            last = True  # its client is not touched again
        if last:
            self._watched.pop(key, None)

    def _poll(self) -> None:
        for key, (is_cancelled, cancel) in list(self._watched.items()):
            try:
                cancelled = is_cancelled()
            except Exception:
                log.exception("is_cancelled of request %s raised; cancelling it", key)
                cancelled = True
            if cancelled:
                del self._watched[key]  # its last response is still to come, from the engine
                try:
                    cancel()
                except Exception:
                    log.exception("cancelling request %s failed", key)
