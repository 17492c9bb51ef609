"""Whether a completion matches its reference: exact token ids, logprobs within a tolerance."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LOGPROB_ATOL",
    "TOP_LOGPROBS",
    "Completion",
    "compare_completions",
    "find_mismatches",
]

#: Absolute tolerance on each top-k logprob.
#:
#: Measured on the float32 tiny model with vLLM's CPU backend: changing only the batch shape
#: (chunk sizes, batch composition, prefix-cache hits vs recomputation) moves logprobs by at most
#: 1.2e-5, while a prefix-cache hit on a never-written block moves them by 0.1 to 1 nat (0.82 in
#: the engine-level reproduction). 1e-3 sits two orders of magnitude from both.
LOGPROB_ATOL = 1e-3
#: Top logprobs requested per position: enough to see a shifted distribution, small for JSON.
TOP_LOGPROBS = 5
_TOKEN_ID_PREFIX = "token_id:"


@dataclass(frozen=True)
class Completion:
    """One greedy completion: the sampled ids and, per position, the top logprobs by token id."""

    token_ids: tuple[int, ...]
    top_logprobs: tuple[Mapping[int, float], ...]

    @classmethod
    def from_openai_choice(cls, choice: Mapping[str, Any]) -> Completion:
        """Parse a ``/v1/completions`` choice sent with ``return_token_ids`` and
        ``return_tokens_as_token_ids``; the latter keys logprobs by id, not by (ambiguous) text.
        """
        logprobs = choice["logprobs"]["top_logprobs"]
        return cls(
            token_ids=tuple(int(t) for t in choice["token_ids"]),
            top_logprobs=tuple(
                {_parse_token_key(k): float(v) for k, v in position.items()}
                for position in logprobs
            ),
        )

    @classmethod
    def from_vllm_output(cls, output: Any) -> Completion:
        """Convert a ``vllm.CompletionOutput`` produced with ``SamplingParams(logprobs=k)``."""
        return cls(
            token_ids=tuple(output.token_ids),
            top_logprobs=tuple(
                {token_id: float(lp.logprob) for token_id, lp in position.items()}
                for position in output.logprobs
            ),
        )


def _parse_token_key(key: str) -> int:
    if not key.startswith(_TOKEN_ID_PREFIX):
        raise ValueError(f"logprob key {key!r} is not of the form 'token_id:N'")
    return int(key[len(_TOKEN_ID_PREFIX) :])


def compare_completions(
    actual: Completion, reference: Completion, atol: float = LOGPROB_ATOL
) -> str | None:
    """Compare a completion with its reference; return ``None`` or the first difference.

    Token ids must match exactly and every logprob both sides report must agree within ``atol``.
    Two legitimate effects of float noise are tolerated, and only when the reference shows a tie
    within ``atol``: a token entering or leaving the top-k at its boundary, and a greedy flip
    between two tied tokens (after which the sequences are no longer comparable, so comparison
    stops there). A NaN anywhere is a difference.
    """
    for position, (got, want) in enumerate(
        zip(actual.token_ids, reference.token_ids, strict=False)
    ):
        problem = _compare_top_logprobs(
            actual.top_logprobs[position], reference.top_logprobs[position], atol
        )
        if problem is not None:
            return f"position {position}: {problem}"
        if got != want:
            ref = reference.top_logprobs[position]
            if got in ref and want in ref and abs(ref[got] - ref[want]) <= atol:
                return None
            return f"position {position}: token {got} != reference {want}"
    if len(actual.token_ids) != len(reference.token_ids):
        return f"length {len(actual.token_ids)} != reference {len(reference.token_ids)}"
    return None


def _compare_top_logprobs(
    got: Mapping[int, float], want: Mapping[int, float], atol: float
) -> str | None:
    for token_id in got.keys() & want.keys():
        delta = abs(got[token_id] - want[token_id])
        if not delta <= atol:  # also catches NaN
            return f"logprob of token {token_id} differs by {delta:.3g}"
    for only, other, side in ((got, want, "actual"), (want, got, "reference")):
        if not other:
            continue
        boundary = min(other.values())
        for token_id in only.keys() - other.keys():
            if not only[token_id] <= boundary + atol:
                return f"token {token_id} is in the {side} top-k only ({only[token_id]:.4f})"
    return None


def find_mismatches(
    actual: Mapping[str, Completion],
    reference: Mapping[str, Completion],
    atol: float = LOGPROB_ATOL,
) -> dict[str, str]:
    """The first difference of each completion that differs from its reference, by name.

    Names only one side has are skipped: a request that failed on either side is a failure,
    not a mismatch. The result follows the order of ``actual``.
    """
    mismatches: dict[str, str] = {}
    for name, completion in actual.items():
        if name not in reference:
            continue
        problem = compare_completions(completion, reference[name], atol)
        if problem is not None:
            mismatches[name] = problem
    return mismatches
