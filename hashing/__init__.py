"""Namespace-seeded page hash chains (storage keys) for paged KV."""
