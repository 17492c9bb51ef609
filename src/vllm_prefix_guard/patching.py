"""The one patch primitive: replace an attribute, remember what was there, undo it.

Every change the guard makes to vLLM goes through :class:`PatchRegistry`, so that
- the same attribute is never patched twice (a second attempt raises instead of
  silently stacking wrappers or overwriting a foreign patch);
- the original stays reachable (``original_of``) for tests and for the wrappers;
- ``undo_all`` restores stock vLLM in-process (tests compare stock and guarded runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_MISSING = object()
# Marker set on every replacement so a second registry (e.g. after a module reload)
# still recognises the guard's own wrappers.
PATCH_MARKER = "__prefix_guard_patch__"


def is_guard_patch(obj: Any) -> bool:
    """Whether ``obj`` is one of the guard's replacements (from any registry)."""
    fget = getattr(obj, "fget", None)
    return bool(getattr(obj, PATCH_MARKER, False) or getattr(fget, PATCH_MARKER, False))


class PatchError(RuntimeError):
    """An attribute could not be patched as asked."""


@dataclass(frozen=True)
class AppliedPatch:
    """One replaced attribute: where, what was there before, and what replaced it."""

    owner: Any
    name: str
    original: Any
    replacement: Any

    @property
    def target(self) -> str:
        return f"{getattr(self.owner, '__qualname__', self.owner)}.{self.name}"


class PatchRegistry:
    """Records applied patches so they can be listed, looked up and undone."""

    def __init__(self) -> None:
        self._applied: dict[tuple[int, str], AppliedPatch] = {}

    def apply(self, owner: Any, name: str, make: Callable[[Any], Any]) -> AppliedPatch:
        """Replace ``owner.name`` with ``make(original)``.

        ``original`` is the attribute as stored on ``owner`` itself (``__dict__``), not an
        inherited one, so undo restores exactly the previous state; a missing attribute is
        passed as ``None`` and removed again on undo.

        Raises:
            PatchError: the attribute is already patched (by this registry or by an
                earlier guard instance).
        """
        key = (id(owner), name)
        if key in self._applied:
            raise PatchError(f"{owner!r}.{name} is already patched by vllm-prefix-guard")
        stored = vars(owner).get(name, _MISSING)
        if is_guard_patch(stored):
            raise PatchError(
                f"{owner!r}.{name} already carries a vllm-prefix-guard patch from another "
                "registry; refusing to wrap it twice"
            )
        replacement = make(None if stored is _MISSING else stored)
        try:
            setattr(replacement, PATCH_MARKER, True)
        except (AttributeError, TypeError):
            # A property carries the marker on its getter; a plain value (a class-level
            # default such as None) carries none: the registry entry guards it.
            fget = getattr(replacement, "fget", None)
            if fget is not None:
                setattr(fget, PATCH_MARKER, True)
        setattr(owner, name, replacement)
        applied = AppliedPatch(owner, name, stored, replacement)
        self._applied[key] = applied
        return applied

    def original_of(self, owner: Any, name: str) -> Any:
        """The attribute ``owner.name`` had before it was patched."""
        applied = self._applied[(id(owner), name)]
        return None if applied.original is _MISSING else applied.original

    @property
    def applied(self) -> list[AppliedPatch]:
        return list(self._applied.values())

    def undo_all(self) -> None:
        """Restore every patched attribute, newest first."""
        for applied in reversed(list(self._applied.values())):
            if applied.original is _MISSING:
                delattr(applied.owner, applied.name)
            else:
                setattr(applied.owner, applied.name, applied.original)
        self._applied.clear()
