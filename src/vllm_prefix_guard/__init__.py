"""vllm-prefix-guard: commit-fenced automatic prefix caching for vLLM V1."""

__version__ = "0.1.0"
