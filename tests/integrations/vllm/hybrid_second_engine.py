"""A second engine (its own process, vLLM's own Scheduler) over a hybrid model's file store, for
``test_hybrid_spec.py`` (run as a script: ``python hybrid_second_engine.py KIND MODEL_DIR URL``;
not a test module). It serves the test's prompt once and prints, as JSON, the tokens it computed,
each group store's pages read, kvstage's restorable length over what each group's store holds,
whether every loaded block holds the first engine's bytes, the worker's failed loads and, per
group, the blocks it reported with load errors.
"""

from __future__ import annotations

import json
import sys


def main(kind: str, model_dir: str, url: str) -> None:
    import torch
    from vllm.v1.kv_offload.base import make_offload_key

    from kvstage.offload.restorable import pages_to_load, restorable_lengths

    from vllm_hybrid_rig import HybridRig
    from vllm_rig import run_to_prompt_end

    prompt = list(range(1, 6 * HybridRig.BLOCK_SIZE + 6))
    rig = HybridRig(model_dir, url, kind=kind)
    try:
        worker = rig.worker.connector_worker.worker
        errors: set[int] = set()
        take = worker.take_block_ids_with_load_errors

        def recorded_take() -> set[int]:
            taken = take()
            errors.update(taken)
            return taken

        worker.take_block_ids_with_load_errors = recorded_take
        scheduled = run_to_prompt_end(rig, "b", prompt)
        spec, stores = rig.spec, rig.manager.storage.stores
        request = rig.scheduler.requests["b"]
        present = {
            name: list(stores[g].exists([make_offload_key(h, g).hex() for h in request.block_hashes]))
            for g, name in spec.group_components.items()
        }
        restorable = restorable_lengths(spec.layout, rig.BLOCK_SIZE, len(prompt), present).max_length
        plan = pages_to_load(spec.layout, rig.BLOCK_SIZE, restorable)
        exact = True
        for g, name in spec.group_components.items():
            blocks = rig.group_block_ids("b", g)
            for index in plan[name]:
                for layer in rig.groups[g]:
                    if spec.layout.component(name).kind == "state":
                        held = rig.rows[blocks[index], : rig.state_bytes]
                        want = rig.state_after(prompt[: (index + 1) * rig.BLOCK_SIZE], layer)
                    else:
                        held, want = rig.bits[layer][blocks[index]], rig.expected_block(prompt, layer, index)
                    exact &= bool(torch.equal(held, want))
        print(
            json.dumps(
                {
                    "hit": len(prompt) - scheduled,
                    "restorable": restorable,
                    "pages_read": {str(g): stores[g].stats.pages_read for g in stores},
                    "exact": exact,
                    "loads_failed": worker.loads_failed,
                    "load_errors": {
                        str(g): sorted(set(rig.group_block_ids("b", g)) & errors) for g in spec.group_components
                    },
                }
            )
        )
    finally:
        rig.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
