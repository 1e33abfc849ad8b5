"""The gateway's per-token path: the update queue each stream waits on, the pre-serialized SSE
chunk, and the request table writing an in-process store directly."""

from __future__ import annotations

import asyncio
import json

import pytest

from common.protocol import TokenUpdate
from common.store import InProcessStore
from control_plane.gateway import UpdateQueue
from control_plane.responses import ResponseBuilder
from control_plane.request_table import Phase, RequestRecord, RequestTable


def test_updates_come_out_in_order_and_a_wait_ends_when_one_arrives():
    async def go():
        queue = UpdateQueue()
        queue.put_nowait(TokenUpdate("a", [1]))
        first = await queue.get(1.0)
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, queue.put_nowait, TokenUpdate("a", [2]))
        loop.call_later(0.01, queue.put_nowait, TokenUpdate("a", [3]))
        second, third = await queue.get(5.0), await queue.get(5.0)
        return first, second, third, queue.qsize()

    first, second, third, left = asyncio.run(go())
    assert [first.token_ids, second.token_ids, third.token_ids] == [[1], [2], [3]]
    assert left == 0


def test_a_wait_without_updates_times_out_with_none():
    async def go():
        queue = UpdateQueue()
        got = await queue.get(0.01)
        queue.put_nowait(TokenUpdate("a", [7]))  # after a timeout the queue still works
        return got, await queue.get(0.0)

    got, later = asyncio.run(go())
    assert got is None and later.token_ids == [7]


def test_a_cancelled_wait_leaves_the_queue_usable():
    async def go():
        queue = UpdateQueue()
        task = asyncio.create_task(queue.get(5.0))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        queue.put_nowait(TokenUpdate("a", [1]))
        return await queue.get(1.0)

    assert asyncio.run(go()).token_ids == [1]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("text, finish, usage_now", [
    ("Hello", None, None), ("", None, None), ('q"u\\o\n\t\u2028é😀\x00', None, None),
    ("end", "stop", None), ("", "length", None), ("x", None, {"prompt_tokens": 1})])
def test_the_serialized_chunk_is_exactly_json_dumps_of_the_chunk(chat, text, finish, usage_now):
    fast, slow = ResponseBuilder(chat, 'model "m"'), ResponseBuilder(chat, 'model "m"')
    slow.id, slow.created = fast.id, fast.created
    for _ in range(2):  # the first chat chunk carries the role; later ones do not
        assert fast.chunk_json(text, finish, usage_now) == json.dumps(
            slow.chunk(text, finish, usage_now))


def test_an_in_process_store_is_written_at_once_and_redis_through_a_thread():
    table = RequestTable(InProcessStore())
    table.create(RequestRecord("r1", 1.0, 4))
    table.advance("r1", Phase.PREFILLED)
    assert table.get("r1").phase is Phase.PREFILLED  # no flush needed: no writer thread
    assert InProcessStore.may_block is False

    class SlowStore(InProcessStore):
        may_block = True

    threaded = RequestTable(SlowStore())
    threaded.create(RequestRecord("r2", 1.0, 4))
    threaded.flush()
    assert threaded.get("r2").phase is Phase.QUEUED
