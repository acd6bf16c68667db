"""vLLM's real ``Scheduler`` with ``KVStageConnector`` and a worker-side connector over CPU block
tensors (:class:`ConnectorRig`), and the helpers that drive and check it (importable as
``vllm_rig``; they import vLLM lazily); the same with its worker side as tensor-parallel ranks,
each in a process of its own (:class:`TPRig`). A hybrid model's rigs: ``vllm_hybrid_rig``; an
``OffloadingConfig`` without a scheduler: ``vllm_offloading_config``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from copy import deepcopy
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def slow_down(storage: Any, method: str, seconds: float = 0.3) -> Any:
    """Make ``storage.<method>`` (``put`` or ``get``) sleep ``seconds`` before each call, so a
    transfer is still running when the test acts (shutdown, reset, abort); the real method
    (to put back)."""
    real = getattr(storage, method)

    def slowed(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    setattr(storage, method, slowed)
    return real


def step_until_writes_in_flight(rig: Any, steps: int = 50) -> Any:
    """Step a ConnectorRig until its requests are done and its worker still has jobs in
    flight (at most ``steps`` steps); the worker (:class:`KVStageWorker`)."""
    worker = rig.worker.connector_worker.worker
    for _ in range(steps):
        rig.step()
        if not rig.scheduler.requests and worker.keyed.jobs_in_flight:
            break
    return worker


class ConnectorRig:
    """vLLM's own scheduler (``vllm.v1.core.sched.scheduler.Scheduler``) with kvstage's
    ``KVStageConnector`` (vLLM's OffloadingConnector plus failed-load reporting, as the README
    configures it: ``kv_load_failure_policy`` ``"recompute"``) on ``KVStageOffloadingSpec``, and a
    worker-side connector over real block tensors on CPU, stepped as vLLM's engine core and model
    runner step them (transfer results and blocks with load errors collected as
    ``kv_connector_model_runner_mixin`` does).

    The model is a stand-in: for every token a step schedules, it writes ``kv_value(token,
    position, layer)`` into the token's row of its block in each layer's KV tensor, so a block's
    bytes are a function of its tokens; a loaded block must hold exactly those bytes.
    ``extra_config`` adds keys to the connector's ``kv_connector_extra_config`` (e.g.
    ``num_host_pages``); ``max_num_batched_tokens`` below a prompt's length makes vLLM prefill it
    in chunks, one store job a step; ``connector_config`` replaces the whole
    ``kv_connector_extra_config`` (``storage`` and ``extra_config`` unused) and
    ``load_failure_policy`` sets ``kv_load_failure_policy``.
    """

    BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE = 16, 32, 2, 16
    LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    CACHE_CONFIG: dict = {}  # more of vLLM's CacheConfig (e.g. mamba_cache_mode)
    HASH_BLOCK_SIZE: int | None = None  # vLLM's prefix_match_unit (block hashes finer than the block)

    def __init__(
        self,
        model_dir,
        storage: str,
        *,
        events: bool = True,
        extra_config: dict | None = None,
        max_num_batched_tokens: int = 512,
        connector_config: dict | None = None,
        load_failure_policy: str = "recompute",
    ) -> None:
        import uuid

        from transformers import LlamaConfig
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.forward_context import ForwardContext
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from kvstage.integrations.vllm import KVStageConnector

        # A tiny Llama config (no weights: nothing runs the model) for vLLM's ModelConfig.
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=len(self.LAYERS),
            num_attention_heads=4,
            num_key_value_heads=self.NUM_KV_HEADS,
            vocab_size=256,
            max_position_embeddings=512,
        ).save_pretrained(model_dir)
        block_size, num_blocks = self.BLOCK_SIZE, self.NUM_BLOCKS
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir),
                tokenizer=str(model_dir),
                skip_tokenizer_init=True,
                dtype="float16",
                max_model_len=512,
            ),
            device_config=DeviceConfig(device="cpu"),
            cache_config=CacheConfig(
                block_size=block_size,
                enable_prefix_caching=True,
                prefix_match_unit=self.HASH_BLOCK_SIZE,
                **self.CACHE_CONFIG,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=4,
                max_model_len=512,
                is_encoder_decoder=False,
            ),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=events, publisher="null"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStageConnector",
                kv_connector_module_path="kvstage.integrations.vllm",
                kv_role="kv_both",
                kv_load_failure_policy=load_failure_policy,
                engine_id=f"kvstage-{uuid.uuid4().hex[:12]}",
                kv_connector_extra_config=connector_config
                if connector_config is not None
                else {
                    "spec_name": "KVStageOffloadingSpec",
                    "spec_module_path": "kvstage.integrations.vllm",
                    "storage": storage,
                    **(extra_config or {}),
                },
            ),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        kv_cache_config = self._kv_cache_config()
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            hash_block_size=self.HASH_BLOCK_SIZE,
            log_stats=True,
        )
        self.worker = KVStageConnector(self.vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        with set_current_vllm_config(self.vllm_config):
            self.worker.register_kv_caches(self.kv)
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(self.HASH_BLOCK_SIZE or block_size, sha256)
        self._forward_context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.manager = self.scheduler.connector.connector_scheduler.manager
        self.kv_events: list = []  # what vLLM's connector published (BlockStored, BlockRemoved)
        self.offloading_events: list = []  # what the manager's take_events gave vLLM's scheduler
        take_events = self.manager.take_events

        def recorded_take_events():
            events = list(take_events())
            self.offloading_events.extend(events)
            return events

        self.manager.take_events = recorded_take_events
        publish = self.scheduler.kv_event_publisher.publish

        def recorded_publish(batch):
            self.kv_events.extend(batch.events)
            return publish(batch)

        self.scheduler.kv_event_publisher.publish = recorded_publish

    def _kv_cache_config(self):
        """vLLM's KVCacheConfig of the model (one full-attention group over LAYERS), and the "GPU"
        KV cache it places: :attr:`backing` (one allocation, layer-outermost) and :attr:`kv`
        (each layer's block tensor, a view of it)."""
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

        block_size, num_blocks = self.BLOCK_SIZE, self.NUM_BLOCKS
        attention = FullAttentionSpec(
            block_size=block_size, num_kv_heads=self.NUM_KV_HEADS, head_size=self.HEAD_SIZE, dtype=torch.float16
        )
        page = attention.page_size_bytes
        self.backing = torch.zeros(len(self.LAYERS), num_blocks, page, dtype=torch.int8)
        self.kv = {
            name: self.backing[index]
            .view(torch.float16)
            .view(num_blocks, 2, block_size, self.NUM_KV_HEADS, self.HEAD_SIZE)
            for index, name in enumerate(self.LAYERS)
        }
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=len(self.LAYERS) * num_blocks * page,
                    layers=list(self.LAYERS),
                    layer_stride=num_blocks * page,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(self.LAYERS), attention)],
        )

    def forward(self, request_id: str, start: int, end: int) -> None:
        """The stand-in model's work on positions ``[start, end)`` of a request: each token's
        ``kv_value`` into its row of its block in every layer."""
        request = self.scheduler.requests[request_id]
        blocks, tokens = self.block_ids(request_id), request.all_token_ids
        for position in range(start, end):
            for layer, name in enumerate(self.LAYERS):
                self.kv[name][blocks[position // self.BLOCK_SIZE], :, position % self.BLOCK_SIZE] = self.kv_value(
                    tokens[position], position, layer
                )

    @staticmethod
    def kv_value(token: int, position: int, layer: int) -> float:
        return float((token * 7 + position * 3 + layer) % 251) / 8

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int = 2):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens)
        sampling.update_from_generation_config({}, None)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)
        return request

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def step(self):
        """One engine step: schedule, start loads, "forward", save, collect transfers, update."""
        import time

        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        output = self.scheduler.schedule()
        for copy in output.kv_cache_block_copies or ():  # the model runner's copy-on-write (Mamba align)
            self.backing[:, copy.dst_block_id] = self.backing[:, copy.src_block_id]
        metadata = output.kv_connector_metadata
        self.worker.handle_preemptions(metadata)
        self.worker.bind_connector_metadata(metadata)
        self.worker.start_load_kv(self._forward_context)
        for request_id, count in output.num_scheduled_tokens.items():
            computed = self.scheduler.requests[request_id].num_computed_tokens
            self.forward(request_id, computed - count, computed)
        if output.total_num_scheduled_tokens > 0:
            self.worker.wait_for_save()
        time.sleep(0.02)  # the copy stream and store threads run between steps, as on a GPU
        transfers = self.worker.get_transfer_results(output.finished_req_ids)  # as vLLM's model runner collects them
        invalid_block_ids = self.worker.get_block_ids_with_load_errors()
        self.worker.clear_connector_metadata()
        running = [request_id for request_id in output.num_scheduled_tokens if request_id in self.scheduler.requests]
        self.scheduler.update_from_output(
            output,
            ModelRunnerOutput(
                req_ids=running,
                req_id_to_index={request_id: index for index, request_id in enumerate(running)},
                # a prefill chunk that leaves prompt tokens for later samples nothing (vLLM's model runner discards it)
                sampled_token_ids=[
                    [5]
                    if self.scheduler.requests[request_id].num_computed_tokens
                    >= self.scheduler.requests[request_id].num_tokens
                    else []
                    for request_id in running
                ],
                kv_connector_output=KVConnectorOutput(
                    finished_sending=transfers.finished_sending,
                    finished_recving=transfers.finished_recving,
                    failed_recving=transfers.failed_recving,
                    invalid_block_ids=invalid_block_ids,
                    kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
                ),
            ),
        )
        return output

    def run(self, steps: int) -> list:
        return [self.step() for _ in range(steps)]

    def run_until_idle(self, max_steps: int = 500) -> list:
        """Step until no request is left and the worker has no transfer in flight or queued
        (the scheduler learns of finished stores one step later: one more step)."""
        worker = self.worker.connector_worker
        outputs = []
        for _ in range(max_steps):
            outputs.append(self.step())
            if not self.scheduler.requests and worker.worker.jobs_in_flight == 0 and not worker._unsubmitted_store_jobs:
                outputs.append(self.step())
                return outputs
        raise AssertionError(f"not idle after {max_steps} steps")

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.connector.shutdown()


def expected_block(rig: ConnectorRig, prompt: list[int], block_index: int) -> list[Any]:
    """Each layer's block ``block_index`` (a float16 tensor [2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE])
    as the rig's stand-in model writes it for ``prompt``."""
    import torch

    blocks = []
    for layer in range(len(rig.LAYERS)):
        block = torch.empty(2, rig.BLOCK_SIZE, rig.NUM_KV_HEADS, rig.HEAD_SIZE, dtype=torch.float16)
        for offset in range(rig.BLOCK_SIZE):
            position = block_index * rig.BLOCK_SIZE + offset
            block[:, offset] = rig.kv_value(prompt[position], position, layer)
        blocks.append(block)
    return blocks


def run_to_prompt_end(rig: ConnectorRig, request_id: str, prompt: list[int], max_tokens: int = 50) -> int:
    """Add a request and step until its prompt is computed; the prompt tokens vLLM scheduled."""
    request = rig.add_request(request_id, prompt, max_tokens=max_tokens)
    scheduled = 0
    for _ in range(200):
        scheduled += rig.step().num_scheduled_tokens.get(request_id, 0)
        if request.num_computed_tokens >= len(prompt):
            return scheduled
    raise AssertionError(f"{request_id}'s prompt not computed after 200 steps")


def assert_blocks_hold(rig: ConnectorRig, request_id: str, prompt: list[int], count: int) -> None:
    """The first ``count`` blocks of ``request_id`` hold what the stand-in model writes for ``prompt``."""
    import torch

    blocks = rig.block_ids(request_id)
    assert len(blocks) >= count, (request_id, len(blocks), count)
    for index in range(count):
        for name, block in zip(rig.LAYERS, expected_block(rig, prompt, index)):
            assert torch.equal(rig.kv[name][blocks[index]], block), (index, name)


# a rank's process: it builds its KV cache and stand-in from a picklable factory (TPRig.rank_model)
WORKER_SCRIPT = Path(__file__).parent / "integrations" / "vllm" / "tp_rank_worker.py"


class FullAttentionRank:
    """One rank's KV cache of a full-attention model: each layer a block tensor ``shape`` of one
    layer-outermost allocation, written with :meth:`kv_value` (a function of the rank too)."""

    def __init__(self, layers: list[str], shape: tuple[int, ...], rank: int) -> None:
        import torch

        self.layers, self.rank, self.block_size = list(layers), rank, shape[2]
        self.backing = torch.zeros(len(layers), *shape, dtype=torch.float16)
        self.kv = {name: self.backing[index] for index, name in enumerate(layers)}

    @staticmethod
    def kv_value(token: int, position: int, layer: int, rank: int) -> float:
        return float((token * 7 + position * 3 + layer + rank * 5) % 251) / 8

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.backing[:, dst] = self.backing[:, src]

    def write(self, request_id: str, tokens: list[int], group_blocks: list[list[int]], start: int, end: int) -> None:
        (blocks,) = group_blocks
        for position in range(start, end):
            for layer, name in enumerate(self.layers):
                block = blocks[position // self.block_size]
                self.kv[name][block, :, position % self.block_size] = self.kv_value(
                    tokens[position], position, layer, self.rank
                )


class TPRig:
    """vLLM's ``Scheduler`` with ``KVStageConnector`` in this process, and ``tp`` worker-side
    connectors, one per rank, each in a process of its own (``tp_rank_worker.py``), over real
    block tensors of ``NUM_KV_HEADS // tp`` heads each; stepped as ``ConnectorRig``, with each
    step's metadata, scheduled tokens and block copies pickled to every rank and their outputs
    aggregated by vLLM's ``KVOutputAggregator`` (what ``MultiprocExecutor`` does).
    ``kv_events_config`` is vLLM's ``KVEventsConfig`` (default: events on, a null publisher).

    Subclasses give another model: :meth:`rank_model` (a rank's KV cache and stand-in writes)
    and :meth:`_kv_cache_config` (vLLM's, the same on every rank).
    """

    BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE = 16, 32, 2, 16  # NUM_KV_HEADS: the model's, all ranks
    LAYERS = ConnectorRig.LAYERS
    CACHE_CONFIG: dict = {}  # more of vLLM's CacheConfig (e.g. mamba_cache_mode)

    def __init__(
        self, model_dir, storage: str, *, tp: int = 2, extra_config: dict | None = None, kv_events_config=None
    ) -> None:
        import uuid

        from transformers import LlamaConfig
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVEventsConfig,
            KVTransferConfig,
            ModelConfig,
            ParallelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.tp = tp
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=len(self.LAYERS),
            num_attention_heads=4,
            num_key_value_heads=self.NUM_KV_HEADS,
            vocab_size=256,
            max_position_embeddings=512,
        ).save_pretrained(model_dir)
        block_size, num_blocks = self.BLOCK_SIZE, self.NUM_BLOCKS
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir),
                tokenizer=str(model_dir),
                skip_tokenizer_init=True,
                dtype="float16",
                max_model_len=512,
            ),
            device_config=DeviceConfig(device="cpu"),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True, **self.CACHE_CONFIG),
            parallel_config=ParallelConfig(tensor_parallel_size=tp, distributed_executor_backend="mp"),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=512, max_num_seqs=4, max_model_len=512, is_encoder_decoder=False
            ),
            kv_events_config=kv_events_config or KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVStageConnector",
                kv_connector_module_path="kvstage.integrations.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                engine_id=f"kvstage-{uuid.uuid4().hex[:12]}",
                kv_connector_extra_config={
                    "spec_name": "KVStageOffloadingSpec",
                    "spec_module_path": "kvstage.integrations.vllm",
                    "storage": storage,
                    **(extra_config or {}),
                },
            ),
        )
        self.kv_cache_config = kv_cache_config = self._kv_cache_config()
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.channels: list[Connection] = []
        self.processes: list[subprocess.Popen] = []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        for rank in range(tp):  # the ranks start first: vLLM's workers exist before its scheduler
            ours, theirs = socket.socketpair()
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER_SCRIPT), str(theirs.fileno())], pass_fds=[theirs.fileno()], env=env
                )
            )
            theirs.close()
            self.channels.append(Connection(ours.detach()))
            rank_config = deepcopy(self.vllm_config)
            rank_config.parallel_config.rank = rank
            self.channels[-1].send((rank_config, kv_cache_config, *self.rank_model(rank)))
        for channel in self.channels:
            assert channel.poll(120), "a rank did not start"
            assert channel.recv()[0] == "ready"
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=True,
        )
        self.manager = self.scheduler.connector.connector_scheduler.manager
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler.connector, tp)
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(block_size, sha256)
        self.in_flight = 0

    def _kv_cache_config(self):
        """vLLM's KVCacheConfig of one rank: one full-attention group over LAYERS."""
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

        attention = FullAttentionSpec(
            block_size=self.BLOCK_SIZE,
            num_kv_heads=self.NUM_KV_HEADS // self.tp,
            head_size=self.HEAD_SIZE,
            dtype=torch.float16,
        )
        page = attention.page_size_bytes
        return KVCacheConfig(
            num_blocks=self.NUM_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=len(self.LAYERS) * self.NUM_BLOCKS * page,
                    layers=list(self.LAYERS),
                    layer_stride=self.NUM_BLOCKS * page,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(self.LAYERS), attention)],
        )

    def rank_model(self, rank: int) -> tuple:
        """(factory, args): what ``rank``'s process calls to build its KV cache and stand-in."""
        shape = (self.NUM_BLOCKS, 2, self.BLOCK_SIZE, self.NUM_KV_HEADS // self.tp, self.HEAD_SIZE)
        return FullAttentionRank, (list(self.LAYERS), shape, rank)

    def add_request(self, request_id: str, prompt: list[int], max_tokens: int = 2):
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens)
        sampling.update_from_generation_config({}, None)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sampling,
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)
        return request

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [list(blocks) for blocks in self.scheduler.kv_cache_manager.get_block_ids(request_id)]

    def step(self):
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        work = []  # what each rank's stand-in model computes this step
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            end = request.num_computed_tokens
            work.append((request_id, list(request.all_token_ids), self.group_block_ids(request_id), end - count, end))
        copies = [(c.src_block_id, c.dst_block_id) for c in output.kv_cache_block_copies or ()]
        for channel in self.channels:
            channel.send(("step", output.kv_connector_metadata, work, copies, output.finished_req_ids))
        replies = [channel.recv() for channel in self.channels]
        self.in_flight = sum(in_flight for _, in_flight in replies)
        running = [request_id for request_id in output.num_scheduled_tokens if request_id in self.scheduler.requests]
        requests = self.scheduler.requests
        outputs = [
            ModelRunnerOutput(
                req_ids=running if rank == 0 else [],
                req_id_to_index={request_id: index for index, request_id in enumerate(running)} if rank == 0 else {},
                sampled_token_ids=[
                    [5] if requests[request_id].num_computed_tokens >= requests[request_id].num_tokens else []
                    for request_id in running
                ]
                if rank == 0
                else [],
                kv_connector_output=kv_output,
            )
            for rank, (kv_output, _) in enumerate(replies)
        ]
        self.scheduler.update_from_output(output, self.aggregator.aggregate(outputs, 0))
        return output

    def run_until_idle(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            self.step()
            if not self.scheduler.requests and self.in_flight == 0:
                self.step()  # the scheduler learns of the last finished stores one step later
                return
        raise AssertionError(f"not idle after {max_steps} steps")

    def ask(self, *message) -> list:
        """Each rank's answer to ``message`` (see ``tp_rank_worker.py``)."""
        for channel in self.channels:
            channel.send(message)
        return [channel.recv() for channel in self.channels]

    def close(self) -> None:
        try:
            self.ask("close")
        finally:
            for process in self.processes:
                process.wait(timeout=60)
            self.scheduler.connector.shutdown()
            self.scheduler.kv_event_publisher.shutdown()
