"""The release routine's static check (``compat/static_check.py``) agrees with the live one.

Read from the installed vLLM's source with ``ast``, every start-up check's subject must be
found exactly where ``targets`` finds it on the imported vLLM, with the parameters
``inspect`` reports: the static page written before a new release is installed says what
``doctor`` will say once it is.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import vllm

from vllm_prefix_guard import targets
from vllm_prefix_guard.errors import GuardUnsupportedError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "compat"))
import static_check

SOURCE = static_check.Source.of_tree(Path(vllm.__file__).resolve().parent.parent)


@pytest.mark.parametrize("internal", targets.INTERNALS, ids=lambda i: i.path)
def test_each_internal_is_found_where_the_live_check_finds_it(internal: targets.Internal) -> None:
    found = static_check.look_up(SOURCE, internal)
    try:
        live = targets.check(internal)
    except GuardUnsupportedError as exc:
        assert not found.present, exc
        return
    assert found.present, found.detail
    if internal.kind is targets.Kind.CALLABLE:
        parameters = tuple(inspect.signature(live).parameters)[1 if internal.owner else 0 :]
        assert found.signature is not None
        assert tuple(p.lstrip("*") for p in found.signature) == parameters


def test_the_structural_checks_agree_with_the_live_ones() -> None:
    static = static_check.structural(SOURCE)
    live = dict(targets.all_checks()[len(targets.INTERNALS) :])
    assert static.keys() == live.keys()
    for name, run in live.items():
        try:
            run()
            passed = True
        except GuardUnsupportedError:
            passed = False
        assert static[name].present == passed, (name, static[name].detail)
    resumes = static[f"{targets.CACHED_REQUEST_DATA} (resumed requests)"].digest
    assert resumes == targets.check_resumes()
