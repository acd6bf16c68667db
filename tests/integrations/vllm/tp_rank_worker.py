"""One tensor-parallel rank of vLLM's worker-side ``KVStageConnector``, in its own process, for
``vllm_tp_rig.TPRig`` (run as a script: ``python tp_rank_worker.py FD``; not a test module).

It does what vLLM's model runner does with a KV connector each step
(``kv_connector_model_runner_mixin``): apply the scheduler's block copies, bind its connector
metadata, start loads, let the "forward" write the scheduled tokens' KV (a rank model the rig
names: a stand-in per token, position, layer and rank), save, collect the transfer results, the
blocks with load errors and the connector's worker metadata, and return the
``KVConnectorOutput``. Messages are pickled over the socket ``FD``
(``multiprocessing.connection``), as vLLM's multiprocess executor pickles its own.
"""

from __future__ import annotations

import socket
import sys
import time
from multiprocessing.connection import Connection


def main(fd: int) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.forward_context import ForwardContext
    from vllm.v1.outputs import KVConnectorOutput

    from kvstage.integrations.vllm import KVStageConnector

    channel = Connection(socket.socket(fileno=fd).detach())
    vllm_config, kv_cache_config, factory, args = channel.recv()
    rank = vllm_config.parallel_config.rank
    model = factory(*args)  # this rank's KV cache (model.kv: layer name -> block tensor) and stand-in
    connector = KVStageConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    with set_current_vllm_config(vllm_config):
        connector.register_kv_caches(model.kv)
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
        if message[0] == "groups":  # a hybrid model: each group store's prefix and pages stored and read
            stores = storage.stores
            channel.send({g: (s.prefix, s.stats.pages_stored, s.stats.pages_read) for g, s in stores.items()})
            continue
        if message[0] == "model":  # a rank model's method, e.g. a check of this rank's blocks
            _, method, method_args = message
            channel.send(getattr(model, method)(*method_args))
            continue
        _, metadata, work, copies, finished_req_ids = message  # one step
        model.copy_blocks(copies)  # the model runner's copy-on-write, before the step's loads
        connector.handle_preemptions(metadata)
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv(forward_context)
        for request_id, tokens, group_blocks, start, end in work:
            model.write(request_id, tokens, group_blocks, start, end)
        if work:
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
