"""The per-request offload manager, host page pool, copy streams and storage backends."""
