"""vllm-prefix-guard's proofs against the installed vLLM: the shadow-KV oracle, the
differential fuzzer and its soak, the bounded-exhaustive explorer, the scheduler factory and
KV-connector fakes they share. Installed from the repository (``pip install -e harness``) by
its tests, benchmarks and CI; not part of the wheel operators install."""
