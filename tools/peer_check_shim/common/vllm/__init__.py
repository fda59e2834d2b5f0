"""peer_check shim of the `vllm` package (our code; see tools/peer_check_shim/README.md).

Only environment facts live here; no test logic and no tolerances."""
