"""The pieces of the end-to-end harness that need no engine: the reference comparison, the
metrics and counter parsers, process bookkeeping, and the tiny model generator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from guard_demo.compare import (
    LOGPROB_ATOL,
    Completion,
    compare_completions,
    find_mismatches,
)
from guard_demo.engine_proof import EngineProof, ScenarioRun
from guard_demo.metrics import (
    MetricsSnapshot,
    guard_counters_by_engine,
    per_engine,
    read_guard_rollbacks,
)
from guard_demo.processes import live_pids
from guard_demo.server import (
    GUARD_STATS_FILE_ENV,
    ApiServer,
    known_vllm_shutdown_race,
    shutdown_problems,
)
from guard_demo.tiny_model import generate_tiny_model, weights_digest
from guard_demo.workload import make_workload

REFERENCE = Completion(
    token_ids=(7, 3),
    top_logprobs=(
        {7: -0.5, 9: -1.5, 4: -2.0},
        {3: -1.0, 8: -1.2, 5: -3.0},
    ),
)


def _shifted(delta: float, position: int = 0, token: int = 7) -> Completion:
    top = [dict(p) for p in REFERENCE.top_logprobs]
    top[position][token] += delta
    return Completion(REFERENCE.token_ids, tuple(top))


def test_batch_shape_noise_passes() -> None:
    assert compare_completions(_shifted(1.2e-5), REFERENCE) is None


@pytest.mark.parametrize("delta", [1e-1, 0.82, float("nan")])
def test_corruption_fails(delta: float) -> None:
    assert compare_completions(_shifted(delta), REFERENCE) is not None


def test_greedy_flip_between_tied_tokens_passes() -> None:
    reference = Completion((3,), ({3: -1.0, 8: -1.0 - LOGPROB_ATOL / 2},))
    flipped = Completion((8,), ({3: -1.0, 8: -1.0 - LOGPROB_ATOL / 2},))
    assert compare_completions(flipped, reference) is None


def test_different_token_fails() -> None:
    other = Completion((7, 8), REFERENCE.top_logprobs)
    assert compare_completions(other, REFERENCE) == "position 1: token 8 != reference 3"


def test_top_k_boundary_swap_passes_only_for_a_tie() -> None:
    tie = Completion((7,), ({7: -0.5, 9: -1.5, 6: -2.0 + 1e-6},))
    assert compare_completions(tie, Completion((7,), (REFERENCE.top_logprobs[0],))) is None
    intruder = Completion((7,), ({7: -0.5, 9: -1.5, 6: -1.9},))
    assert compare_completions(intruder, Completion((7,), (REFERENCE.top_logprobs[0],)))


def test_openai_choice_parsing() -> None:
    choice = {
        "token_ids": [7],
        "logprobs": {"top_logprobs": [{"token_id:7": -0.5, "token_id:9": -1.5}]},
    }
    assert Completion.from_openai_choice(choice) == Completion((7,), ({7: -0.5, 9: -1.5},))


def test_mismatches_by_name_skip_one_sided_names() -> None:
    actual = {"b": _shifted(0.5), "a": REFERENCE, "failed-on-reference": _shifted(0.5)}
    reference = {"a": REFERENCE, "b": REFERENCE, "failed-on-guarded": REFERENCE}
    assert list(find_mismatches(actual, reference)) == ["b"]


def test_metrics_parsing_sums_label_sets() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0',
            'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 2',
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09',
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 64.0',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 5.0',
        ]
    )
    assert MetricsSnapshot.parse(text) == MetricsSnapshot(64.0, 32.0, 5.0)


def test_per_engine_counters_of_stock_and_guarded_servers() -> None:
    from guard_demo.__main__ import _guard_line

    stock = "\n".join(
        [
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 4.0',
        ]
    )
    counters = per_engine(stock)
    assert counters == {
        "0": {"prefix_cache_queries": 200.0, "prefix_cache_hits": 50.0, "preemptions": 4.0}
    }
    assert _guard_line(counters["0"]) == "hits 25.0%, 4 preemptions; no guard series"
    guarded = stock + '\nvllm:prefix_guard_registrations_tracked_total{engine="0",model_name="m"} 9'
    line = _guard_line(per_engine(guarded)["0"])
    assert line.startswith("hits 25.0%, 4 preemptions; guard: 9 registrations tracked, 0 rolled")


def _stats_document(engine: int, rolled_back: int) -> str:
    # What the guard's StatsPublisher writes (vllm_prefix_guard.stats).
    counters = {"rolled_back": rolled_back, "rolled_back_preempted": rolled_back}
    return json.dumps({"model_name": "m", "engine": str(engine), "counters": counters})


def test_guard_series_by_engine() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:prefix_guard_registrations_tracked counter",
            'vllm:prefix_guard_registrations_tracked_total{engine="0",model_name="m"} 7.0',
            'vllm:prefix_guard_registrations_tracked_total{engine="1",model_name="m"} 5.0',
            "# TYPE vllm:prefix_guard_rolled_back counter",
            'vllm:prefix_guard_rolled_back_total{cause="preempted",engine="0",model_name="m"} 2',
            'vllm:prefix_guard_rolled_back_total{cause="kv_load_failure",engine="1"} 3',
            "# TYPE vllm:prefix_guard_uncommitted_entries gauge",
            'vllm:prefix_guard_uncommitted_entries{engine="0",model_name="m"} 1.0',
            "# TYPE vllm:num_preemptions counter",
            'vllm:num_preemptions_total{engine="0",model_name="m"} 5.0',
        ]
    )
    by_engine = guard_counters_by_engine(text)
    assert list(by_engine) == ["0", "1"]
    assert by_engine["0"] == {
        "registrations_tracked": 7.0,
        "rolled_back_preempted": 2.0,
        "uncommitted_entries": 1.0,
        "rolled_back": 2.0,
    }
    assert by_engine["1"]["rolled_back_kv_load_failure"] == 3.0
    assert by_engine["1"]["rolled_back"] == 3.0


def test_guard_rollbacks_from_stats_file_or_log(tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    stats.write_text(_stats_document(0, 3))
    assert read_guard_rollbacks(stats) == 3
    for engine, rolled_back in ((0, 3), (1, 4)):
        (tmp_path / f"per-engine.{engine}.json").write_text(_stats_document(engine, rolled_back))
    assert read_guard_rollbacks(tmp_path / "per-engine.{engine}.json") == 7
    line = (
        "(EngineCore pid=1) INFO [hooks.py:290] vllm-prefix-guard counters: "
        "rolled_back_preempted=2 rolled_back_kv_load_failure=0 rolled_back=2"
    )
    assert read_guard_rollbacks(tmp_path / "missing.json", line) == 2
    assert read_guard_rollbacks(None, "no counters here") is None


def test_server_start_removes_a_stale_stats_file(tmp_path: Path) -> None:
    """The guard rewrites its stats file while it runs: one from an earlier server must not
    pass for this server's counters."""
    stats = tmp_path / "guard-stats.json"
    stats.write_text(_stats_document(0, 7))
    args = [sys.executable, "-c", "pass"]
    server = ApiServer(args, {GUARD_STATS_FILE_ENV: str(stats)}, tmp_path / "server.log", port=0)
    with server:
        assert server.wait_exit(timeout_s=30) == 0
    assert read_guard_rollbacks(stats) is None


def _stopped(tmp_path: Path, script: str) -> ApiServer:
    server = ApiServer([sys.executable, "-c", script], {}, tmp_path / "server.log", port=0)
    server.start()
    time.sleep(1.5)  # the script has set its signal handlers
    server._healthy = True  # as after wait_healthy(): the full grace period applies
    server.stop(grace_s=4)
    return server


def test_stop_waits_for_a_clean_exit_and_kills_nothing(tmp_path: Path) -> None:
    server = _stopped(
        tmp_path,
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0)))\n"
        "time.sleep(60)",
    )
    assert server.returncode == 0 and server.force_killed == []


def test_stop_kills_only_what_outlives_the_grace_period_and_says_so(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The leader exits on SIGTERM; its child (same process group) ignores it.
    server = _stopped(
        tmp_path,
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        "time.sleep(60)",
    )
    assert len(server.force_killed) == 1 and server.returncode == 0
    assert all(pid not in live_pids() for pid in server.force_killed)
    assert "force-killing 1 process(es)" in capfd.readouterr().err


def test_shutdown_problems_in_a_log() -> None:
    log = "\n".join(
        [
            "(APIServer pid=1) INFO [launcher.py:254] [shutdown] API server: shutdown triggered",
            "(APIServer pid=1) ERROR [async_llm.py:906] Traceback (most recent call last):",
            "(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError",
            "(APIServer pid=1) WARNING [utils.py:653] [shutdown] Process manager: force killing "
            "remaining process EngineCore pid 2",
            "(EngineCore pid=2) WARNING [multiproc_executor.py:491] [shutdown] Executor: workers "
            "still running after grace period; sending SIGTERM count=1",
            "(APIServer pid=1) INFO [core_client.py:777] [shutdown] MPClient: complete",
        ]
    )
    assert len(shutdown_problems(log)) == 4


_RACE = [
    "(APIServer pid=1) ERROR 12-01 05:25:48 [async_llm.py:906] AsyncLLM output_handler failed.",
    "(APIServer pid=1) ERROR 12-01 05:25:48 [async_llm.py:906] Traceback (most recent call last):",
    '(APIServer pid=1) ERROR 12-01 05:25:48 [async_llm.py:906]   File "async_llm.py", line 849',
    "(APIServer pid=1) ERROR 12-01 05:25:48 [async_llm.py:906] vllm.v1.engine.exceptions."
    "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
]
_CLEANUP = (
    "(APIServer pid=1) INFO 12-01 05:25:48 [core_client.py:775] [shutdown] MPClient: cleaning up "
    "background resources"
)


def test_vllm_shutdown_race_is_told_apart_from_real_tracebacks() -> None:
    """vLLM's own shutdown race (vllm#48745) logs an EngineDeadError traceback after the engine
    client's cleanup began: recognised, and only there."""
    after_cleanup = "\n".join([_CLEANUP, *_RACE, "INFO:     Shutting down"])
    assert shutdown_problems(after_cleanup) == []
    assert known_vllm_shutdown_race(after_cleanup) == _RACE
    mid_run = "\n".join([*_RACE, _CLEANUP])  # the engine died while serving
    assert len(shutdown_problems(mid_run)) == 2 and known_vllm_shutdown_race(mid_run) == []
    other_process = "\n".join([_CLEANUP.replace("pid=1", "pid=2"), *_RACE])
    assert len(shutdown_problems(other_process)) == 2


def test_live_pids_filter_by_command_line_and_group(tmp_path: Path) -> None:
    marker = f"live-pids-marker-{tmp_path.name}"
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", marker], start_new_session=True
    )
    try:
        assert live_pids(cmdline_contains=marker) == [sleeper.pid]
        assert live_pids(process_group=sleeper.pid) == [sleeper.pid]
        assert os.getpid() not in live_pids(process_group=sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert live_pids(cmdline_contains=marker) == []


def test_workload_is_deterministic_and_mixed() -> None:
    items = make_workload(40, seed=3)
    assert items == make_workload(40, seed=3)
    assert len(items) == 40
    assert {item.priority for item in items} == {0, 2}  # interactive and background
    assert any(item.cancel_after_s is not None for item in items)
    assert len({item.prompt for item in items}) < len(items)  # some prompts repeat
    assert all(max(item.prompt) < 510 for item in items)  # no special tokens


def test_tiny_model_is_deterministic_and_cached(tmp_path: Path) -> None:
    first = generate_tiny_model(tmp_path / "a", seed=0)
    second = generate_tiny_model(tmp_path / "b", seed=0)
    assert weights_digest(first) == weights_digest(second)
    assert weights_digest(generate_tiny_model(tmp_path / "c", seed=1)) != weights_digest(first)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    generate_tiny_model(first, seed=0)
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_model_never_overwrites_other_directories(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        generate_tiny_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_tiny_tokenizer_round_trips(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    model = generate_tiny_model(tmp_path / "m")
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    config = json.loads((model / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    text = "the quick brown fox, naïvely"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_demo_report_states_shutdown_in_one_line() -> None:
    """Clean, orderly but for vLLM's own known race (named as such, never called clean), or
    not clean; one line either way."""
    from guard_demo.__main__ import DemoReport
    from guard_demo.metrics import MetricsSnapshot

    def report(shutdown: dict[str, list[str]], race: list[str]) -> str:
        demo = DemoReport(
            guard=True,
            vllm_version="0.32.0",
            requests=1,
            completed=1,
            cancelled=0,
            failed=0,
            metrics=MetricsSnapshot(0, 0, 0),
            guard_rollbacks=0,
            shutdown=shutdown,
            vllm_shutdown_race=race,
        )
        [line] = [line for line in demo.render().splitlines() if "shutdown" in line]
        return line.split("shutdown", 1)[1].strip()

    assert report({"guarded-server.log": []}, []).startswith("clean")
    raced = report({"guarded-server.log": []}, ["guarded-server.log"])
    assert raced.startswith("orderly") and "vllm#48745" in raced and "clean" not in raced
    broken = report({"guarded-server.log": ["Traceback (most recent call last):"]}, [])
    assert broken.startswith("NOT CLEAN: guarded-server.log: 1 problem(s)")


def _proof(stock_c: Completion, guarded_c: Completion) -> EngineProof:
    """An engine proof whose C completion is ``stock_c`` on stock and ``guarded_c`` guarded
    (A alike), every other completion the reference's."""
    preempted = [set(), set(), {"A"}]
    reference = ScenarioRun(completions=dict.fromkeys("ABCD", REFERENCE), preempted=preempted)

    def run(completion: Completion, cached: int, guard: bool) -> ScenarioRun:
        completions = {**reference.completions, "A": completion, "C": completion}
        return ScenarioRun(
            completions=completions,
            num_cached_tokens={"C": cached},
            preempted=preempted,
            guard_counters={"rolled_back_preempted": 2} if guard else None,
            guard_applied=guard,
        )

    return EngineProof(reference, run(stock_c, 288, False), run(guarded_c, 256, True))


def test_engine_proof_verdict_and_report() -> None:
    """The report names stock's first diverging token and its logprob gap, and the guard's
    largest difference, which must be within the tolerance."""
    shown = _proof(_shifted(0.82, position=1, token=3), _shifted(1.2e-5))
    assert shown.stock_diverges and shown.guard_matches and shown.ok
    [_, first_c] = shown.stock_divergences()
    assert (first_c.request, first_c.position, first_c.token) == ("C", 1, 3)
    assert first_c.logprob_gap == pytest.approx(0.82)
    text = "\n".join(shown.render())
    assert "C: from output token 1 (same token 3), logprob off by 0.82" in text
    assert "stock vLLM        C hits 288 tokens, block 9 that A never wrote" in text
    assert "all 4 completions within 1.2e-05 of no prefix caching" in text
    assert text.endswith("OK: stock read never-written KV, the guard did not")
    # Round trip through the JSON the demo's subprocess writes.
    again = EngineProof.from_json(json.loads(json.dumps(shown.to_json())))
    assert again.render() == shown.render()
    # Stock within noise proves nothing; the guard off the reference fails.
    assert not _proof(_shifted(1e-5), _shifted(1e-5)).ok
    failed = _proof(_shifted(0.82), _shifted(0.5))
    assert failed.failed_checks() == ["guarded: every completion matches no prefix caching"]
    assert "    not so: guarded: every completion matches" in "\n".join(failed.render())


def test_demo_fails_when_the_engine_proof_does() -> None:
    from guard_demo.__main__ import DemoReport

    demo = DemoReport(
        guard=True,
        vllm_version="0.32.0",
        requests=1,
        completed=1,
        cancelled=0,
        failed=0,
        metrics=MetricsSnapshot(0, 0, 0),
        guard_rollbacks=0,
        engine_proof=_proof(_shifted(1e-5), _shifted(1e-5)),
    )
    assert not demo.ok
    lines = demo.render().splitlines()
    assert lines[1].startswith("1. the bug and the fix on one engine")
    assert lines[-1].endswith("FAILED")
    demo.engine_proof = None
    demo.engine_proof_error = "exit status 2"
    assert not demo.ok and "FAILED to run: exit status 2" in demo.render()
