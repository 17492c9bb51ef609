"""The commands that write figures into docs/ replace exactly their block, with links that
resolve from the document (stdlib scripts: no vLLM needed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"doc_block_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def doc(tmp_path: Path, name: str) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        f"# Page\n\nbefore\n\n<!-- {name}:begin -->\nold\n<!-- {name}:end -->\n\nafter\n"
    )
    return page


SOAK_REPORT = """Soak: vLLM 0.32.0, Python 3.11.7 (PYTHONHASHSEED=0), 2 CPUs, 1 job(s), 10 s.
Command: `python -m vllm_prefix_guard_harness.fuzz.soak --steps 100 --out x.md`

| configuration | steps (per mode) | checks |
|---|---:|---|
| fcfs-families | 100 | ok |

| configuration | mode | bad reads |
|---|---|---:|
| fcfs-families | stock | 0 |
"""


def test_soak_report_copies_each_release_summary(tmp_path: Path) -> None:
    soak_report = load(ROOT / "benchmarks" / "soak_report.py")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name in ("soak-vllm-0.33.md", "soak-vllm-0.32.md", "soak-vllm-0.32-one-config.md"):
        (results / name).write_text(SOAK_REPORT)
    page = doc(tmp_path, "soak")
    soak_report.update_doc(page, results)
    text = page.read_text()
    assert text.startswith("# Page\n\nbefore\n\n<!-- soak:begin -->\n")
    assert text.endswith("<!-- soak:end -->\n\nafter\n")
    assert text.index("#### Soak on vLLM 0.32") < text.index("#### Soak on vLLM 0.33")
    assert "one-config" not in text and "OLD-BLOCK" not in text
    assert "](../benchmarks/results/soak-vllm-0.32.md)" in text
    assert "| fcfs-families | 100 | ok |" in text
    assert "| fcfs-families | stock | 0 |" not in text  # the summary table only


def soak_report_of(rows: dict[str, str]) -> str:
    lines = [
        "Soak: vLLM 0.34.0, 2 CPUs, 2 job(s), 10 s.",
        "Command: `python -m vllm_prefix_guard_harness.fuzz.soak --config x`",
        "",
        "| configuration | steps (per mode) | bad reads: stock / guard | checks |",
        "|---|---:|---:|---|",
        *(f"| {name} | 100 | {reads} / 0 | ok |" for name, reads in rows.items()),
    ]
    return "\n".join(lines) + "\n"


def test_soak_report_merges_a_release_soaked_in_parts_beside_the_release_before(
    tmp_path: Path,
) -> None:
    """A release soaked in parts stands once every part is there, its tables merged, with
    stock's bad reads on the release before beside its own."""
    soak_report = load(ROOT / "benchmarks" / "soak_report.py")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "soak-vllm-0.33.md").write_text(soak_report_of({"victim (targeted)": "7"}))
    (results / "soak-vllm-0.34-part1of2.md").write_text(soak_report_of({"victim (targeted)": "9"}))
    page = doc(tmp_path, "soak")
    soak_report.update_doc(page, results)
    assert "Soak on vLLM 0.34" not in page.read_text()  # one part of two: not its soak

    (results / "soak-vllm-0.34-part2of2.md").write_text(soak_report_of({"new-path": "5"}))
    soak_report.update_doc(page, results)
    text = page.read_text()
    section = text[text.index("#### Soak on vLLM 0.34") :]
    assert "Part 1 of 2." in section and "Part 2 of 2." in section
    assert (
        "| configuration | steps (per mode) | bad reads: stock / guard "
        "| stock's bad reads on 0.33 |" in section
    )
    assert "| victim (targeted) | 100 | 9 / 0 | 7 | ok |" in section
    assert "| new-path | 100 | 5 / 0 | - | ok |" in section


def test_vllm_suite_report_rewrites_the_rows_it_has_a_summary_for(tmp_path: Path) -> None:
    report = load(ROOT / "tests" / "vllm_suite" / "report.py")
    runs = tmp_path / "runs"
    (runs / "vllm-suite-ci-0.33").mkdir(parents=True)
    (runs / "vllm-suite-ci-0.33" / "summary.json").write_text(
        json.dumps(
            {
                "vllm": "0.33.0",
                "counts": {"stock": "761 passed", "guard": "3 failed, 758 passed"},
                "exercised_by_guard": 348,
                "expected": ["a", "b", "c"],
                "unexpected": [],
                "wall_s": {"stock": 148.2, "guard": 119.4},
            }
        )
    )
    page = doc(tmp_path, "vllm-suite")
    kept = (
        "| `vllm-suite-0.32` | 0.32.0 | 1 | 1 / 0 / 0 | 1 / 0 / 0 | 0, all listed | 1 tests | 1 s |"
    )
    page.write_text(page.read_text().replace("old", kept))
    report.update_doc(page, runs)
    text = page.read_text()
    assert kept in text
    assert (
        "| `vllm-suite-ci` | 0.33.0 | 761 | 761 / 0 / 0 | 758 / 3 / 0 | 3, all listed | "
        "348 tests | 148 s + 119 s |"
    ) in text
    assert text.index("vllm-suite-0.32") < text.index("vllm-suite-ci")


def test_compat_and_bench_blocks_land_in_the_document(tmp_path: Path) -> None:
    compat = load(ROOT / "benchmarks" / "compat.py")
    document = json.loads((ROOT / "benchmarks" / "results" / "compat.json").read_text())
    page = doc(tmp_path, "compat")
    compat.update_doc(page, document, tmp_path / "benchmarks" / "results")
    text = page.read_text()
    assert "](../benchmarks/results/compat.md)" in text and "OLD-BLOCK" not in text
    assert text.endswith("<!-- compat:end -->\n\nafter\n")
    bench = load(ROOT / "benchmarks" / "report.py")
    page = doc(tmp_path, "bench")
    assert bench.update_doc(page, "### Benchmark results\n")
    assert "<!-- bench:begin -->\n### Benchmark results\n<!-- bench:end -->" in page.read_text()
