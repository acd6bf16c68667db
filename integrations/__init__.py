"""Engine adapters: each subpackage speaks one engine's interfaces and translates them to
kvstage's (``kvstage.integrations.sglang``; see each subpackage). Adapters hold no offload or
storage logic of their own."""
