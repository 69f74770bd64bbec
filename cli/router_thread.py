"""An in-process router on a thread and event loop of its own.

``misat up`` and a trainer that starts a local pool (``local_pool``) run the
router inside their own process. Sharing the caller's event loop would make
the router hostage to it:

- A blocking call on that loop (the synchronous OpenAI client called from a
  coroutine, a tokenizer run inline) stops the router too; when the call is
  a request to the router itself, it never returns.
- The loop's file-descriptor registrations are shared. A client the caller
  never closed, collected later, unregisters descriptor numbers that the
  router may have been given since, and a connection to the router goes
  deaf (the failure docs/e2e.md traces).

On its own loop the router is served exactly as ``misat router`` serves it
(the same ``RouterService``, uvloop by default), and the caller talks to it
over HTTP like any client. The thread still shares the interpreter's lock,
so Python work in the caller's threads takes CPU time from the router; for a
router with a core of its own, run ``misat router`` as a process.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from misat_router.app import create_app
from misat_router.config import RouterConfig
from misat_router.server import event_loop_factory
from misat_router.service import RouterService

THREAD_NAME = "misat-router"


class RouterThread:
    """Start with ``await start(...)``, stop with ``await stop()``; ``port`` once started."""

    def __init__(self, config: RouterConfig, admin_token: str | None, *, event_loop: str = "uvloop") -> None:
        self.config = config
        self.admin_token = admin_token
        factory = event_loop_factory(event_loop)
        self._new_loop: Callable[[], asyncio.AbstractEventLoop] = factory or asyncio.new_event_loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._service: RouterService | None = None

    @property
    def port(self) -> int:
        if self._service is None:
            raise RuntimeError("the router thread is not started")
        return self._service.port

    async def start(self, host: str, port: int, *, backlog: int) -> None:
        """Start the thread's loop and the router on it; the router's own errors (OSError when the
        port is taken) are raised here, and leave no thread behind."""
        loop = self._new_loop()
        ready = threading.Event()
        thread = threading.Thread(target=self._run, args=(loop, ready), name=THREAD_NAME, daemon=True)
        thread.start()
        # Not a synchronisation sleep: the thread sets it as soon as its loop runs (microseconds).
        await asyncio.to_thread(ready.wait)
        self._loop, self._thread = loop, thread
        try:
            await self._call(self._start_service(host, port, backlog))
        except BaseException:
            await self._end_thread()
            raise

    async def stop(self) -> None:
        """Drain and stop the router (``RouterService.stop``), then end the thread and close its loop."""
        if self._loop is None:
            return
        try:
            if self._service is not None:
                await self._call(self._service.stop())
        finally:
            self._service = None
            await self._end_thread()

    async def _start_service(self, host: str, port: int, backlog: int) -> None:
        # Built on the router's loop: the app's background tasks and locks belong to it.
        service = RouterService(create_app(self.config, admin_token=self.admin_token))
        await service.start(host, port, backlog=backlog)
        self._service = service

    async def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        assert self._loop is not None
        fut: Future[None] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        await asyncio.wrap_future(fut)

    async def _end_thread(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)

    @staticmethod
    def _run(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            # What the service did not end itself (nothing, after a clean stop) is cancelled
            # and awaited here, so that no task dies with the loop unawaited.
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()
