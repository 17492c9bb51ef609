"""The rules, as the upstream series writes them into vLLM: one copy, run by the plugin.

``uncommitted`` (the per-step record and the rules that remove its entries) and
``failed_kv_loads`` (the rollback of a failed KV load) become new vLLM modules;
``block_pool`` and ``kv_cache_manager`` lend methods to vLLM's classes. Only license
headers and import lines differ (``tests/repo/test_rules_are_upstream.py``).
"""
