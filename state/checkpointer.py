"""LangGraph checkpointers on plain Redis data structures (Redis >= 6.2, Valkey, Redis Cluster).

The official ``langgraph-checkpoint-redis`` needs RedisJSON and RediSearch, which managed Redis
offerings lack; these savers use only hashes, sorted sets and Lua, with every key of a thread under
one ``{thread_id}`` hash tag (layout in :mod:`elesium.state._keys`). Each write is one Lua script,
so it is atomic and costs one round trip.

Both savers are thin drivers over the operations of :mod:`elesium.state._saver_base`:
:class:`RedisSaver` runs them with blocking calls, :class:`AsyncRedisSaver` with awaits.

Example:
    >>> saver = RedisSaver.from_url()  # REDIS_URL, or the embedded Valkey server  # doctest: +SKIP
    >>> graph = builder.compile(checkpointer=saver)                              # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    SerializerProtocol,
)

from elesium.state import _keys as K
from elesium.state._saver_base import (
    ChainedCall,
    Command,
    Emit,
    Op,
    RedisSaverBase,
    Request,
    Scan,
    ScriptCall,
    prune_keep,
)
from elesium.state.connection import connect, connect_async, default_url, describe
from elesium.state.errors import StateError, translate_errors

T = TypeVar("T")


class RedisSaver(RedisSaverBase):
    """Synchronous checkpointer.

    The ``a*`` methods run the sync ones in the default executor, so the saver also works under
    ``ainvoke``; prefer :class:`AsyncRedisSaver` in async code to keep threads out of the loop.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` with ``decode_responses`` off.
        **options: ``prefix``, ``ttl_s``, ``keep_last``, ``serde`` (see ``RedisSaverBase``).
    """

    chains_in_writer = True
    """A run's audit cursor may be attached (``chains``): its checkpoints and writes are chained in
    the script that stores them. The async saver has none: a lock held across an await would stall
    its loop, so runs on it are chained from what they stored (``RunAudit.sync``)."""

    def __init__(self, client: Any, *, target: str = "the configured server", **options: Any) -> None:
        super().__init__(**options)
        self.client = client
        self._target = target
        self._scripts = {name: client.register_script(src) for name, src in K.SCRIPTS.items()}

    @classmethod
    def from_url(
        cls,
        url: str | None = None,
        *,
        prefix: str = K.DEFAULT_PREFIX,
        ttl_s: int | None = None,
        keep_last: int | None = None,
        serde: SerializerProtocol | None = None,
    ) -> RedisSaver:
        """Connect to ``url`` (default: ``REDIS_URL``, else the embedded server) and ping it.

        Raises:
            RedisURLError: malformed URL.
            RedisUnavailableError: nothing answers there within the connect timeout.
        """
        url = url or default_url()
        return cls(connect(url), target=describe(url), prefix=prefix, ttl_s=ttl_s,
                   keep_last=keep_last, serde=serde)

    # ------------------------------------------------------------ driver
    def _execute(self, req: Request) -> Any:
        if isinstance(req, ScriptCall):
            return self._scripts[req.name](keys=req.keys, args=req.args)
        if isinstance(req, ChainedCall):
            return req.cursor.run_chained(self._scripts[req.name], self._scripts[f"{req.name}_chained"],
                                          req.keys, req.args, req.records)
        if isinstance(req, Command):
            return self.client.execute_command(*req.args)
        if isinstance(req, Scan):
            return list(self.client.scan_iter(match=req.pattern, count=1000))
        pipe = self.client.pipeline(transaction=True)
        for command in req.commands:
            pipe.execute_command(*command)
        return pipe.execute()

    def _run(self, op: Op, where: str) -> Any:
        reply: Any = None
        with translate_errors(where, self._target):
            while True:
                try:
                    req = op.send(reply)
                except StopIteration as stop:
                    return stop.value
                reply = None if isinstance(req, Emit) else self._execute(req)

    def _iterate(self, op: Op, where: str) -> Iterator[CheckpointTuple]:
        reply: Any = None
        while True:
            with translate_errors(where, self._target):
                try:
                    req = op.send(reply)
                except StopIteration:
                    return
                if not isinstance(req, Emit):
                    reply = self._execute(req)
                    continue
            reply = None
            yield req.item

    # ------------------------------------------------------------ BaseCheckpointSaver
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names, or the thread's latest when it names none."""
        return self._run(self._op_get_tuple(config), self._where(config["configurable"]["thread_id"]))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first. ``config=None`` scans every thread (an admin operation)."""
        where = self._where(config["configurable"]["thread_id"] if config else None)
        return self._iterate(self._op_list(config, filter, before, limit), where)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint and the blobs of its changed channels in one script call."""
        op = self._op_put(config, checkpoint, metadata, new_versions)
        return self._run(op, self._where(config["configurable"]["thread_id"]))

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """Store a task's pending writes; repeating a (task, index) keeps the first value."""
        op = self._op_put_writes(config, writes, task_id, task_path)
        self._run(op, self._where(config["configurable"]["thread_id"]))

    def delete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint, write and blob of ``thread_id``, atomically."""
        self._run(self._op_prune([thread_id], 0), self._where(thread_id))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Keep the latest checkpoint per namespace ("keep_latest") or none ("delete")."""
        self._run(self._op_prune(thread_ids, prune_keep(strategy)), self._where())

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread's whole history (every ancestor, write and blob) under a new id."""
        self._run(self._op_copy_thread(source_thread_id, target_thread_id), self._where(source_thread_id))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints of these runs. Scans every thread: an admin operation."""
        self._run(self._op_delete_for_runs(run_ids), self._where())

    # ------------------------------------------------------------ async wrappers
    async def _in_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return await self._in_thread(self.get_tuple, config)

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        items = await self._in_thread(
            lambda: list(self.list(config, filter=filter, before=before, limit=limit))
        )
        for item in items:
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return await self._in_thread(self.put, config, checkpoint, metadata, new_versions)

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        await self._in_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await self._in_thread(self.delete_thread, thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await self._in_thread(self.prune, thread_ids, strategy=strategy)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await self._in_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await self._in_thread(self.delete_for_runs, run_ids)


class AsyncRedisSaver(RedisSaverBase):
    """Asyncio checkpointer, for ``ainvoke`` / ``astream`` and the API server.

    The sync methods are available from *other* threads than the event loop's (LangGraph calls
    them from worker threads in some paths); they schedule the coroutine on the loop the saver
    first ran on. Calling them on the loop's own thread would deadlock, so that raises.

    Args:
        client: a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``.
        **options: ``prefix``, ``ttl_s``, ``keep_last``, ``serde`` (see ``RedisSaverBase``).
    """

    def __init__(self, client: Any, *, target: str = "the configured server", **options: Any) -> None:
        super().__init__(**options)
        self.client = client
        self._target = target
        self._scripts = {name: client.register_script(src) for name, src in K.SCRIPTS.items()}
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_url(
        cls,
        url: str | None = None,
        *,
        prefix: str = K.DEFAULT_PREFIX,
        ttl_s: int | None = None,
        keep_last: int | None = None,
        serde: SerializerProtocol | None = None,
    ) -> AsyncRedisSaver:
        """A saver for ``url`` (default: ``REDIS_URL``, else the embedded server).

        Nothing is sent until first use; an unreachable server raises ``RedisUnavailableError``
        from that first call (after the 1 s connect timeout), a bad URL ``RedisURLError`` here.
        """
        url = url or default_url()
        return cls(
            connect_async(url),
            target=describe(url),
            prefix=prefix,
            ttl_s=ttl_s,
            keep_last=keep_last,
            serde=serde,
        )

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()

    # ------------------------------------------------------------ driver
    async def _execute(self, req: Request) -> Any:
        if isinstance(req, ScriptCall | ChainedCall):  # no cursor is attached here: see chains_in_writer
            return await self._scripts[req.name](keys=req.keys, args=req.args)
        if isinstance(req, Command):
            return await self.client.execute_command(*req.args)
        if isinstance(req, Scan):
            return [key async for key in self.client.scan_iter(match=req.pattern, count=1000)]
        pipe = self.client.pipeline(transaction=True)
        for command in req.commands:
            pipe.execute_command(*command)
        return await pipe.execute()

    async def _run(self, op: Op, where: str) -> Any:
        self._loop = self._loop or asyncio.get_running_loop()
        reply: Any = None
        with translate_errors(where, self._target):
            while True:
                try:
                    req = op.send(reply)
                except StopIteration as stop:
                    return stop.value
                reply = None if isinstance(req, Emit) else await self._execute(req)

    async def _iterate(self, op: Op, where: str) -> AsyncIterator[CheckpointTuple]:
        self._loop = self._loop or asyncio.get_running_loop()
        reply: Any = None
        while True:
            with translate_errors(where, self._target):
                try:
                    req = op.send(reply)
                except StopIteration:
                    return
                if not isinstance(req, Emit):
                    reply = await self._execute(req)
                    continue
            reply = None
            yield req.item

    # ------------------------------------------------------------ async API
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names, or the thread's latest when it names none."""
        return await self._run(self._op_get_tuple(config), self._where(config["configurable"]["thread_id"]))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints newest first. ``config=None`` scans every thread (an admin operation)."""
        where = self._where(config["configurable"]["thread_id"] if config else None)
        async for item in self._iterate(self._op_list(config, filter, before, limit), where):
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint and the blobs of its changed channels in one script call."""
        op = self._op_put(config, checkpoint, metadata, new_versions)
        return await self._run(op, self._where(config["configurable"]["thread_id"]))

    async def aput_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        """Store a task's pending writes; repeating a (task, index) keeps the first value."""
        op = self._op_put_writes(config, writes, task_id, task_path)
        await self._run(op, self._where(config["configurable"]["thread_id"]))

    async def adelete_thread(self, thread_id: str) -> None:
        """Delete every checkpoint, write and blob of ``thread_id``, atomically."""
        await self._run(self._op_prune([thread_id], 0), self._where(thread_id))

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Keep the latest checkpoint per namespace ("keep_latest") or none ("delete")."""
        await self._run(self._op_prune(thread_ids, prune_keep(strategy)), self._where())

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread's whole history (every ancestor, write and blob) under a new id."""
        await self._run(
            self._op_copy_thread(source_thread_id, target_thread_id), self._where(source_thread_id)
        )

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints of these runs. Scans every thread: an admin operation."""
        await self._run(self._op_delete_for_runs(run_ids), self._where())

    # ------------------------------------------------------------ sync bridge
    def _blocking(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None or not loop.is_running():
            coro.close()
            raise StateError(
                "AsyncRedisSaver's synchronous methods need its event loop running in another "
                "thread; call the a* methods (ainvoke/astream), or use RedisSaver for sync code."
            )
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            coro.close()
            raise StateError(
                "A synchronous AsyncRedisSaver method was called on its own event loop's thread, "
                "which would deadlock; use the a* method (e.g. aget_tuple) or graph.ainvoke."
            )
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        return self._blocking(self.aget_tuple(config))

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        async def collect() -> list[CheckpointTuple]:
            return [t async for t in self.alist(config, filter=filter, before=before, limit=limit)]

        return iter(self._blocking(collect()))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        return self._blocking(self.aput(config, checkpoint, metadata, new_versions))

    def put_writes(
        self, config: RunnableConfig, writes: Sequence[tuple[str, Any]], task_id: str, task_path: str = ""
    ) -> None:
        self._blocking(self.aput_writes(config, writes, task_id, task_path))

    def delete_thread(self, thread_id: str) -> None:
        self._blocking(self.adelete_thread(thread_id))
