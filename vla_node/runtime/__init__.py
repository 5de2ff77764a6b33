"""The cached policy (host bookkeeping over the KV partitions), the token caches, the reuse gate, the reference."""
