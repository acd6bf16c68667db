"""kvstage inside sglang 0.5.23 (needs the ``sglang`` extra).

- :class:`KVStageStorage`: a HiCache L3 storage backend over any kvstage store, loaded by
  sglang's storage factory as ``dynamic`` (``module_path: "kvstage.integrations.sglang"``,
  ``class_name: "KVStageStorage"``, ``interface_v1: 1``, ``url``).
- :class:`KVStageDecodeOffloadManager`: kvstage's offload manager in the place of sglang's
  decode-side ``DecodeKVCacheOffloadManager``; :func:`sglang_plugin` (sglang's plugin entry point)
  switches sglang's scheduler to it when ``KVSTAGE_SGLANG_DECODE_OFFLOAD=1``.
- :mod:`kvstage.integrations.sglang.key_space`: the extra config both read and the key space
  (fingerprint, fp8 kind) both store under, built one way.
- :mod:`kvstage.integrations.sglang.host_layouts`: sglang's host pool layouts as views in
  kvstage's page byte order.
"""

from kvstage.integrations.sglang.decode_offload import KVStageDecodeOffloadManager, sglang_plugin
from kvstage.integrations.sglang.storage import KVStageStorage

__all__ = ["KVStageDecodeOffloadManager", "KVStageStorage", "sglang_plugin"]
