"""List, then watch, one kind of object in one namespace, re-listing when the watch breaks: the loop the fake
kubelet (pods), `rlkube bench operator` and the operator tests (TrainingJobs) each need, written once.

Every object reaches `on_event(type, obj)` as the API server's JSON (camelCase dict), in the order the API
server sent it: the initial listing as ADDED, then the watch's ADDED / MODIFIED / DELETED. A broken watch
(410 Gone, a dropped connection, the API server restarting) lists again, so a consumer may see an object twice
but never misses its latest state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from rlkube.api.spec import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

OnEvent = Callable[[str, dict], Awaitable[None]]


class _RawWatch(watch.Watch):
    """A watch whose events keep the API server's JSON: kubernetes_asyncio would otherwise re-encode every pod
    and build its model objects from it (most of the fake kubelet's CPU), only for us to turn them back."""

    def get_return_type(self, func: object) -> None:
        return None


class ListWatch:
    """`await start()` returns once the initial listing went through `on_event`; `close()` stops the watch."""

    def __init__(self, api: client.ApiClient, list_fn: Callable[..., Awaitable[Any]], args: tuple,
                 on_event: OnEvent, **kwargs: Any):
        self.api = api
        self.list_fn = list_fn
        self.args = args
        self.kwargs = kwargs
        self.on_event = on_event
        self._task: asyncio.Task | None = None

    @classmethod
    def trainingjobs(cls, api: client.ApiClient, namespace: str, on_event: OnEvent) -> ListWatch:
        custom = client.CustomObjectsApi(api)
        return cls(api, custom.list_namespaced_custom_object, (GROUP, VERSION, namespace, PLURAL), on_event)

    @classmethod
    def pods(cls, api: client.ApiClient, namespace: str, on_event: OnEvent, label_selector: str) -> ListWatch:
        core = client.CoreV1Api(api)
        return cls(api, core.list_namespaced_pod, (namespace,), on_event, label_selector=label_selector)

    async def start(self) -> ListWatch:
        ready = asyncio.Event()
        self._task = asyncio.create_task(self._run(ready))
        listed = asyncio.create_task(ready.wait())
        done, _ = await asyncio.wait({self._task, listed}, return_when=asyncio.FIRST_COMPLETED)
        listed.cancel()
        if self._task in done:
            self._task.result()  # the loop died before its first listing: raise why
        return self

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, ready: asyncio.Event) -> None:
        rv = None
        while True:
            try:
                if rv is None:
                    # Typed lists (pods) come back as models, custom objects as dicts: one JSON shape for both.
                    listing = self.api.sanitize_for_serialization(await self.list_fn(*self.args, **self.kwargs))
                    rv = listing["metadata"]["resourceVersion"]
                    for obj in listing["items"]:
                        await self.on_event("ADDED", obj)
                    ready.set()
                stream = _RawWatch().stream(self.list_fn, *self.args, **self.kwargs, resource_version=rv,
                                              timeout_seconds=60, _request_timeout=90)
                async with stream as events:
                    async for event in events:
                        if event["type"] == "ERROR":
                            rv = None  # 410 Gone: the resource version is too old; list again
                            break
                        obj = event["raw_object"]
                        rv = obj["metadata"]["resourceVersion"]
                        await self.on_event(event["type"], obj)
            except (TimeoutError, ApiException, OSError) as exc:
                log.warning("%s watch restarts: %s", self.list_fn.__name__, exc)
                rv = None
                await asyncio.sleep(0.2)  # retry delay before listing again
