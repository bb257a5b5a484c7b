"""An urgent tenant is served through a flood of less urgent work on a real server, with the official
`openai` client.

What is checked: a request at priority -1 gets its answer while a flood of priority-5 requests is
still queued in the engine (more requests than `max_num_seqs`), i.e. it did not wait for the flood to
drain. Both come from one tenant (default priority -1; the flood sends `priority: 5`), so nothing but
priority puts the urgent request first: across tenants VTC fairness alone would favour a newcomer.
What is not: latency in seconds (this machine is shared; the step-count measure of
TTFT under saturation is tests/base_engine/test_priority_ttft.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.harness.servers import Server, launch_server, main_server_args
from tests.harness.wait import wait_for

NUM_FLOOD = 10
FLOOD_PRIORITY = 5


def _args(model_dir: Path) -> list[str]:
    args = main_server_args(model_dir)
    args[args.index("--max-num-seqs") + 1] = "2"  # two rows: the flood queues at once
    return args


def _tenant(server: Server, prefix: str, priority: int) -> AsyncOpenAI:
    tenant_id, key = server.tenant(prefix)
    r = server.admin("PUT", f"/tenants/{tenant_id}/priority", json={"default_priority": priority})
    assert r.status_code == 200, r.text
    return AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, timeout=600, max_retries=0)


async def _flood_then_urgent(server: Server) -> tuple[int, str | None]:
    client = _tenant(server, "urgent", -1)
    model = (await client.models.list()).data[0].id
    flood = [
        asyncio.create_task(
            client.completions.create(
                model=model,
                prompt=f"story {i}",
                max_tokens=200,
                extra_body={"ignore_eos": True, "priority": FLOOD_PRIORITY},
            )
        )
        for i in range(NUM_FLOOD)
    ]
    await asyncio.to_thread(
        wait_for, lambda: server.engine_stats()["num_waiting"] >= 4, 120, 0.05, "the flood queued"
    )
    answer = await client.completions.create(model=model, prompt="hello", max_tokens=4)
    num_flood_done = sum(task.done() for task in flood)
    await asyncio.gather(*flood)
    return num_flood_done, answer.choices[0].finish_reason


@pytest.mark.slow
def test_a_priority_minus_one_request_finishes_while_a_priority_5_flood_is_queued(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    with launch_server(_args(tiny_llama_dir), tmp_path_factory.mktemp("flood") / "data") as server:
        num_flood_done, finish_reason = asyncio.run(_flood_then_urgent(server))
    assert finish_reason in ("length", "stop")
    # Two rows serve the flood two at a time: if the urgent request had queued behind it, most of it
    # would be done by now.
    assert num_flood_done <= 2, num_flood_done
