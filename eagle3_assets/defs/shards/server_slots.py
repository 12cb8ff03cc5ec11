"""Several vLLM extraction servers: each shard run holds one of them for as long as it runs.

Its hold is a Dagster concurrency slot of one per server (key `vllm-server:<url>`), not a store lease
(`leases.py`, one owner of a store directory),
claimed under this run, so it is atomic on every instance storage (SQLite on one node,
PostgreSQL across nodes) and it is freed with the run's other slots when the run ends
or dies (`runs.sweep_dead_runs`, run monitoring). The `gpu` pool limit equals the number
of servers (`executor.py`), so a run that got a pool slot finds a free server; when a
dead run still holds one, the run waits, naming who holds them, until the sweep frees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dagster import DagsterInstance

SLOT_PREFIX = "vllm-server:"


def slot_key(url: str) -> str:
    return f"{SLOT_PREFIX}{url}"


@contextmanager
def server_slot(
    instance: DagsterInstance,
    run_id: str,
    step_key: str,
    urls: list[str],
    *,
    log: Callable[[str], None],
    poll_s: float = 5.0,
) -> Iterator[str]:
    """The URL of a server no other run holds, held until the block ends."""
    storage = instance.event_log_storage
    for url in urls:
        if storage.get_concurrency_info(slot_key(url)).slot_count != 1:
            storage.set_concurrency_slots(slot_key(url), 1)
    waited = 0.0
    while True:
        for url in urls:
            # One step key per server: freeing a lost claim removes just its queue entry, not the
            # step's `gpu` pool slot, which is held under the plain step key.
            claim = f"{step_key}@{url}"
            if storage.claim_concurrency_slot(slot_key(url), run_id, claim).is_claimed:
                try:
                    yield url
                finally:
                    storage.free_concurrency_slot_for_step(run_id, claim)
                return
            storage.free_concurrency_slot_for_step(run_id, claim)
        if waited == 0.0 or waited % 60 < poll_s:
            held = {u: [s.run_id for s in storage.get_concurrency_info(slot_key(u)).claimed_slots] for u in urls}
            log(f"all {len(urls)} vLLM servers are held ({held}); waiting for one to be free")
        time.sleep(poll_s)
        waited += poll_s
