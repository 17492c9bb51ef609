"""vLLM's ``ExampleConnector`` with KV loads that fail on purpose, deterministically by seed.

``ExampleConnector`` (``vllm.distributed.kv_transfer.kv_connector.v1.example_connector``)
stores each new prompt's KV, layer by layer, as safetensors files under
``shared_storage_path`` and loads them back, synchronously, into a later request with
the same block-aligned prompt. This subclass keeps that storage and its load path, and
adds what a flaky remote store does: some loads fail for their last blocks. The worker
half writes garbage (seeded noise) into those blocks after the real load and reports
them through ``get_block_ids_with_load_errors()``, the contract vLLM's scheduler handles
with ``kv_load_failure_policy``. It is test harness code, not part of the wheel.

Which loads fail is decided on the scheduler side, from the seed and the tokens being
loaded, so the same prompts fail the same way whatever the request ids, the batch or
the timing (``kv_connector_extra_config`` keys):

* ``fail_seed`` (int, 0);
* ``fail_rate`` (float, 1.0): the fraction of stored prefixes whose load fails;
* ``fail_blocks`` (int, 1): how many of a failing load's last external blocks fail;
  0 draws 1 to all of them from the seed;
* ``fail_first_load_only`` (bool, true): a prefix fails on its first load only, later
  loads of it succeed (a transient error);
* ``store_prompts`` (bool, true): store new prompts, as ``ExampleConnector`` does. A
  loading engine that chunks its prefills sets it false: ``ExampleConnector`` saves a
  prompt in the step that first schedules it, so a chunked prompt would be stored with
  blocks not computed yet;
* ``async_load`` (bool, false): load asynchronously, as a request state of its own
  (``WAITING_FOR_REMOTE_KVS``), instead of in the step that computes the prompt's
  tail. ``ExampleConnector`` itself only loads synchronously; this mode runs its load
  at the start of the next worker step (a forward or the no-forward connector step)
  and reports the request as received in that step.

The scheduler half's ``async_load`` and ``plan`` attributes can also be changed at run
time by an in-process test, between steps.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["FailingExampleConnector", "FailingMetadata", "FailurePlan"]

#: Standard deviation of the garbage written into a failed block (the KV itself is O(1)).
GARBAGE_STD = 4.0


@dataclass(frozen=True)
class FailurePlan:
    """Which loads fail, and how; see the module docstring."""

    seed: int = 0
    rate: float = 1.0
    blocks: int = 1
    first_load_only: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> FailurePlan:
        return cls(
            seed=int(extra.get("fail_seed", 0)),
            rate=float(extra.get("fail_rate", 1.0)),
            blocks=int(extra.get("fail_blocks", 1)),
            first_load_only=bool(extra.get("fail_first_load_only", True)),
        )

    def draw(self, prefix: Sequence[int]) -> tuple[float, int]:
        """Two deterministic draws for a stored prefix: a uniform in [0, 1) and an int."""
        digest = hashlib.sha256(struct.pack("<q", self.seed) + bytes(_token_bytes(prefix)))
        uniform, count = struct.unpack("<QQ", digest.digest()[:16])
        return uniform / 2.0**64, count

    def failing_blocks(self, prefix: Sequence[int], num_external_blocks: int) -> int:
        """How many trailing external blocks of a load of ``prefix`` fail (0: it succeeds)."""
        if num_external_blocks <= 0:
            return 0
        uniform, count = self.draw(prefix)
        if uniform >= self.rate:
            return 0
        if self.blocks > 0:
            return min(self.blocks, num_external_blocks)
        return 1 + count % num_external_blocks


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


@dataclass
class FailingMetadata(ExampleConnectorMetadata):
    """``ExampleConnector``'s metadata plus this step's planned failures and async loads."""

    #: Blocks whose load fails in this step (they get garbage and are reported invalid).
    fail_block_ids: list[int] = field(default_factory=list)
    #: Requests whose async load runs in this step (reported as received after it).
    async_req_ids: list[str] = field(default_factory=list)


class FailingExampleConnector(ExampleConnector):
    """``ExampleConnector`` whose loads fail as :class:`FailurePlan` says."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.plan = FailurePlan.from_extra_config(extra)
        self.async_load = bool(extra.get("async_load", False))
        self.store_prompts = bool(extra.get("store_prompts", True))
        # Scheduler side.
        self._failed_prefixes: set[bytes] = set()
        self._pending_failures: list[int] = []
        self._async_pending: dict[str, tuple[Any, list[int], list[int]]] = {}
        self._async_decided: set[str] = set()
        self._async_seen: set[str] = set()
        #: (request id, number of external tokens, block ids that fail) per load, in order.
        self.loads: list[tuple[str, int, list[int]]] = []
        # Worker side.
        self._invalid_block_ids: set[int] = set()
        self._garbage_seed = self.plan.seed

    # -- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._async_seen:
            return 0, False  # its async load already ran (failed or not)
        num_tokens, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        num_tokens = max(0, num_tokens or 0)
        load_async = self.async_load and num_tokens > 0
        if load_async:
            self._async_decided.add(request.request_id)
        return num_tokens, load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            return
        block_ids = list(blocks.get_block_ids()[0])
        prompt = list(request.prompt_token_ids or [])
        end = align_to_block_size(len(prompt) - 1, self._block_size)
        start = end - num_external_tokens
        external = block_ids[start // self._block_size : end // self._block_size]
        key = _token_bytes(prompt[:end])
        num_failing = 0
        if not (self.plan.first_load_only and key in self._failed_prefixes):
            num_failing = self.plan.failing_blocks(prompt[:end], len(external))
        failing = external[len(external) - num_failing :] if num_failing else []
        if failing:
            self._failed_prefixes.add(key)
        self.loads.append((request.request_id, num_external_tokens, failing))
        if request.request_id in self._async_decided:
            self._async_decided.discard(request.request_id)
            self._async_seen.add(request.request_id)
            self._async_pending[request.request_id] = (request, block_ids, failing)
            return
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._pending_failures.extend(failing)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FailingMetadata:
        base = super().build_connector_meta(scheduler_output)
        requests = [r for r in base.requests if self.store_prompts or not r.is_store]
        meta = FailingMetadata(requests=requests, fail_block_ids=self._pending_failures)
        self._pending_failures = []
        for req_id, (request, block_ids, failing) in self._async_pending.items():
            meta.add_request(
                token_ids=list(request.prompt_token_ids or []),
                block_ids=block_ids,
                block_size=self._block_size,
                is_store=False,
                mm_hashes=[f.identifier for f in request.mm_features],
            )
            meta.async_req_ids.append(req_id)
            meta.fail_block_ids.extend(failing)
        self._async_pending.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        self._async_seen.discard(request.request_id)
        return super().request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, FailingMetadata)
        if forward_context.attn_metadata is None and any(not r.is_store for r in meta.requests):
            # A step with no forward (only async loads): ExampleConnector reads the
            # attention metadata only to detect MLA layouts, which this model has none of.
            forward_context.attn_metadata = _NoAttentionMetadata()
        super().start_load_kv(forward_context, **kwargs)
        if meta.fail_block_ids:
            self._write_garbage(forward_context, meta.fail_block_ids)
            self._invalid_block_ids.update(meta.fail_block_ids)

    def _write_garbage(self, forward_context: ForwardContext, block_ids: list[int]) -> None:
        generator = torch.Generator().manual_seed(self._garbage_seed)
        self._garbage_seed += 1
        index = torch.tensor(sorted(block_ids))
        for layer in forward_context.no_compile_layers.values():
            kv_cache = getattr(layer, "kv_cache", None)
            if not isinstance(kv_cache, torch.Tensor):
                continue
            shape = (len(index), *kv_cache.shape[1:])
            noise = torch.randn(shape, generator=generator, dtype=torch.float32)
            kv_cache[index.to(kv_cache.device)] = (noise * GARBAGE_STD).to(
                kv_cache.device, kv_cache.dtype
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._get_connector_metadata()
        if isinstance(meta, FailingMetadata) and meta.async_req_ids:
            return None, set(meta.async_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid


class _NoAttentionMetadata(dict[str, None]):
    """Per-layer attention metadata of a step without a forward: None for every layer."""

    def __missing__(self, key: str) -> None:
        return None
