"""Streamed /generate requests against a running SGLang server, for tests and benchmarks that
time tokens as they come or keep a request decoding while they send others.

SGLang streams server-sent events: one `data: {...}` line per chunk (the output so far and its
meta_info), then `data: [DONE]`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import requests


def stream(url: str, payload: dict, timeout: float = 1800) -> Iterator[dict]:
    """The chunks of `payload` posted to the server at `url` with streaming on, as they come.
    Closing the iterator early drops the connection, and SGLang aborts the request."""
    with requests.post(f"{url}/generate", json={**payload, "stream": True}, stream=True,
                       timeout=timeout) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                yield json.loads(line[len(b"data: "):])


class StreamingRequest:
    """A request streaming in a thread of its own, so that others can be sent while it decodes:
    constructed once its first chunk came; `times` are when each chunk came
    (`time.monotonic()`), `last` is the latest chunk. `join()` waits for it to finish, `stop()`
    drops its connection at its next chunk (SGLang aborts it); both give the last chunk."""

    def __init__(self, url: str, payload: dict, *, first_timeout: float = 600,
                 timeout: float = 1800) -> None:
        self.times: list[float] = []
        self.last: dict = {}
        self.error: Exception | None = None
        self._first, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, payload, timeout),
                                        daemon=True)
        self._thread.start()
        if not self._first.wait(first_timeout) or not self.times:
            raise RuntimeError(f"the streamed request sent no token in {first_timeout:g} s"
                               + (f": {self.error!r}" if self.error else ""))

    def _run(self, url: str, payload: dict, timeout: float) -> None:
        try:
            for chunk in stream(url, payload, timeout):
                self.times.append(time.monotonic())
                self.last = chunk
                self._first.set()
                if self._stop.is_set():
                    break
        except Exception as error:  # kept for the caller; the thread ends here
            self.error = error
        finally:
            self._first.set()

    def join(self, timeout: float = 1800) -> dict:
        self._thread.join(timeout)
        if self.error is not None:
            raise RuntimeError("the streamed request failed") from self.error
        return self.last

    def stop(self, timeout: float = 600) -> dict:
        self._stop.set()
        return self.join(timeout)
