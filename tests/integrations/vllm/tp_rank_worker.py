"""One tensor-parallel rank of vLLM's worker-side ``KVStageConnector``, in its own process, for
``test_kv_events.py`` (run as a script: ``python tp_rank_worker.py FD``; not a test module).

It does what vLLM's model runner does with a KV connector each step
(``kv_connector_model_runner_mixin``): bind the scheduler's connector metadata, start loads, let
the "forward" write the scheduled tokens' KV (a stand-in value per token, position, layer and
rank), save, collect the transfer results, the blocks with load errors and the connector's
worker metadata, and return the ``KVConnectorOutput``. Messages are pickled over the socket
``FD`` (``multiprocessing.connection``), as vLLM's multiprocess executor pickles its own.
"""

from __future__ import annotations

import socket
import sys
import time
from multiprocessing.connection import Connection


def kv_value(token: int, position: int, layer: int, rank: int) -> float:
    """The stand-in KV of one token in one layer of one rank."""
    return float((token * 7 + position * 3 + layer + rank * 5) % 251) / 8


def main(fd: int) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.forward_context import ForwardContext
    from vllm.v1.outputs import KVConnectorOutput

    from kvstage.integrations.vllm import KVStageConnector

    channel = Connection(socket.socket(fileno=fd).detach())
    vllm_config, kv_cache_config, layers, shape = channel.recv()
    rank = vllm_config.parallel_config.rank
    connector = KVStageConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    block_size = shape[2]
    backing = torch.zeros(len(layers), *shape, dtype=torch.float16)  # one layer-outermost allocation
    kv = {name: backing[index] for index, name in enumerate(layers)}
    with set_current_vllm_config(vllm_config):
        connector.register_kv_caches(kv)
    forward_context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    channel.send(("ready", rank))
    while True:
        message = channel.recv()
        if message[0] == "close":
            connector.shutdown()
            channel.send(("closed", rank))
            return
        storage = connector.connector_worker.worker.storage
        if message[0] == "stored_pages":  # pages this rank's store wrote
            channel.send(storage.stats.pages_stored)
            continue
        if message[0] == "holds":  # whether this rank's store holds each page key
            channel.send(storage.exists(message[1]))
            continue
        _, metadata, writes, finished_req_ids = message  # one step
        connector.handle_preemptions(metadata)
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv(forward_context)
        for block, position, token in writes:
            for layer, name in enumerate(layers):
                kv[name][block, :, position % block_size] = kv_value(token, position, layer, rank)
        if writes:
            connector.wait_for_save()
        time.sleep(0.02)  # the copy stream and store threads run between steps, as on a GPU
        transfers = connector.get_transfer_results(finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=transfers.finished_sending,
            finished_recving=transfers.finished_recving,
            failed_recving=transfers.failed_recving,
            invalid_block_ids=connector.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        in_flight = connector.connector_worker.worker.keyed.jobs_in_flight + len(
            connector.connector_worker._unsubmitted_store_jobs
        )
        channel.send((output, in_flight))


if __name__ == "__main__":
    main(int(sys.argv[1]))
