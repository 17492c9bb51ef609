"""A scheduler-side KV connector with synchronous loads that a test can make fail.

It plays a remote KV store holding the first ``external_tokens[request_id]`` tokens of
a request. vLLM's real scheduler asks it for matches, allocates blocks, and registers
their hashes in the same step (speculatively, inside ``allocate_slots``); the shadow
worker then performs the load, or, for requests in ``fail_loads``, leaves the blocks
unwritten and reports them in ``KVConnectorOutput.invalid_block_ids`` (only those of
the prompt's blocks listed in ``failed_blocks``, where it lists any: the others load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


@dataclass
class PlannedLoad:
    """Tokens ``[start, start + num_tokens)`` of a request, loaded into ``block_ids``."""

    request_id: str
    start: int
    num_tokens: int
    block_ids: list[int]
    fails: bool

    def per_block(self, block_size: int, fails: Callable[[int], bool]) -> list[PlannedLoad]:
        """This load as one load per block, which fails where ``fails`` holds for the
        block's index in the request (a load that fails on some blocks only)."""
        first = self.start // block_size
        return [
            PlannedLoad(
                self.request_id,
                (first + offset) * block_size,
                block_size,
                [block_id],
                fails(first + offset),
            )
            for offset, block_id in enumerate(self.block_ids)
        ]


@dataclass
class FakeLoadMetadata(KVConnectorMetadata):
    loads: list[PlannedLoad] = field(default_factory=list)


class FakeLoadConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler role only; the worker half is the shadow-KV runner. It loads the first
    KV-cache group (full attention); on a hybrid model the others are computed."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size: int = vllm_config.cache_config.block_size
        self.external_tokens: dict[str, int] = {}
        self.fail_loads: set[str] = set()
        # Request ID -> indices of the prompt's blocks whose load fails (default: all).
        self.failed_blocks: dict[str, frozenset[int]] = {}
        self._pending: list[PlannedLoad] = []

    # -- scheduler side ----------------------------------------------------------------

    def _matched_end(self, request: Any) -> int:
        """Where the remote copy of ``request`` ends: whole blocks, one token left to compute."""
        available = self.external_tokens.get(request.request_id, 0)
        cap = (request.num_tokens - 1) // self.block_size * self.block_size
        return min(available, cap) // self.block_size * self.block_size

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return max(0, self._matched_end(request) - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        end = self._matched_end(request)
        start = end - num_external_tokens
        group_blocks = blocks.blocks[0]
        block_ids = [
            b.block_id for b in group_blocks[start // self.block_size : end // self.block_size]
        ]
        fails = request.request_id in self.fail_loads
        load = PlannedLoad(request.request_id, start, num_external_tokens, block_ids, fails)
        failed_blocks = self.failed_blocks.get(request.request_id)
        if fails and failed_blocks is not None:
            self._pending.extend(load.per_block(self.block_size, failed_blocks.__contains__))
        else:
            self._pending.append(load)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = FakeLoadMetadata(self._pending)
        self._pending = []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, Any]:
        return False, None

    # -- worker side: unused, the shadow-KV runner executes the loads ----------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
