"""Bounded-exhaustive exploration of the guard's rollback rules on vLLM's real scheduler
(``vllm-prefix-guard-harness explore``): ``scope`` what may happen, ``system`` the lanes stepped
by named events, ``digest`` the canonical state, ``search`` the forking depth-first walk
over a shared ``visited`` table, ``mutations`` the rules with one taken out, ``report``
and ``cli`` what it prints."""
