"""A scheduler-side KV connector whose loads a test can make fail, or make asynchronous.

It plays a remote KV store holding the first ``external_tokens[request_id]`` tokens of
a request. vLLM's real scheduler asks it for matches, allocates blocks, and registers
their hashes in the same step (speculatively, inside ``allocate_slots``); the shadow
worker then performs the load, or, for requests in ``fail_loads``, leaves the blocks
unwritten and reports them in ``KVConnectorOutput.invalid_block_ids`` (only those of
the prompt's blocks listed in ``failed_blocks``, where it lists any: the others load).

A request in ``async_loads`` loads asynchronously, as P/D and offloading connectors do:
the scheduler allocates its blocks without registering them (``delay_cache_blocks``),
parks it in ``WAITING_FOR_REMOTE_KVS``, and registers them only once a step's output
lists it in ``finished_recving`` (``_update_waiting_for_remote_kv``). The worker reports
that ``async_loads[request_id]`` executed steps after the load starts; a whole failure is
reported per request (``failed_recving``, the only report vLLM 0.31+ accepts on a model
with several KV-cache groups), a failure of some blocks by their ids.

A hybrid model's state groups are loaded too, as vLLM expects of a connector by default
(``get_loaded_kv_cache_group_ids``: every prefix-cacheable group): the state after the
loaded prefix, into the request's state block for that boundary.
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
    # Executed steps until the worker reports the load done (0: synchronous, done
    # before the step that carries it computes anything).
    steps: int = 0
    # A failure is reported per request (``failed_recving``), not by block id.
    by_request: bool = False
    # (KV-cache group, block) of each state group's block for the loaded prefix's end.
    state_blocks: list[tuple[int, int]] = field(default_factory=list)

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
                self.steps,
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
        self.external_tokens: dict[str, int] = {}
        self.fail_loads: set[str] = set()
        # Request ID -> indices of the prompt's blocks whose load fails (default: all).
        self.failed_blocks: dict[str, frozenset[int]] = {}
        # Request ID -> executed steps its asynchronous load takes (absent: synchronous).
        self.async_loads: dict[str, int] = {}
        self._pending: list[PlannedLoad] = []
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else ()
        # Loads go by the first group's blocks (full attention); on a hybrid model the
        # cache block can be a larger state block.
        self.block_size: int = (
            groups[0].kv_cache_spec.block_size if groups else vllm_config.cache_config.block_size
        )
        # (group id, block size) of each align-mode state group.
        self.state_groups: list[tuple[int, int]] = [
            (group_id, group.kv_cache_spec.block_size)
            for group_id, group in enumerate(groups)
            if getattr(group.kv_cache_spec, "mamba_cache_mode", None) == "align"
        ]

    # -- scheduler side ----------------------------------------------------------------

    def _matched_end(self, request: Any) -> int:
        """Where the remote copy of ``request`` ends: whole blocks, one token left to compute."""
        available = self.external_tokens.get(request.request_id, 0)
        cap = (request.num_tokens - 1) // self.block_size * self.block_size
        return min(available, cap) // self.block_size * self.block_size

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        matched = max(0, self._matched_end(request) - num_computed_tokens)
        return matched, matched > 0 and request.request_id in self.async_loads

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34 (``--max-num-inflight-kv-loads``): whether ``request`` may load
        asynchronously, so that it waits in the queue of loads that can start while the
        batch is full."""
        return request.request_id in self.async_loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        end = self._matched_end(request)
        start = end - num_external_tokens
        group_blocks = blocks.blocks[0]
        block_ids = [
            b.block_id for b in group_blocks[start // self.block_size : end // self.block_size]
        ]
        request_id = request.request_id
        fails = request_id in self.fail_loads
        failed_blocks = self.failed_blocks.get(request_id)
        steps = self.async_loads.get(request_id, 0)
        load = PlannedLoad(
            request_id,
            start,
            num_external_tokens,
            block_ids,
            fails,
            steps,
            by_request=steps > 0 and failed_blocks is None,
            state_blocks=self._state_blocks(blocks, end),
        )
        if fails and failed_blocks is not None:
            self._pending.extend(load.per_block(self.block_size, failed_blocks.__contains__))
        else:
            self._pending.append(load)
        if steps:
            # The remote copy serves one load, as a P/D transfer does: a request whose
            # asynchronous load failed does not find it again (it would retry forever).
            del self.external_tokens[request_id]

    def _state_blocks(self, blocks: Any, end: int) -> list[tuple[int, int]]:
        """Each state group's block for the state after ``end`` tokens, unless null (align
        mode: block ``k`` holds the state after ``(k + 1) * block size`` tokens, or after
        a hash boundary inside it, a partial hit's checkpoint)."""
        found = []
        for group_id, block_size in self.state_groups:
            group_blocks = blocks.blocks[group_id]
            index = -(-end // block_size) - 1
            if 0 <= index < len(group_blocks) and not group_blocks[index].is_null:
                found.append((group_id, group_blocks[index].block_id))
        return found

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
