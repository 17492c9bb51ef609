"""The one patch primitive: replace an attribute, remember what was there, undo it.

A change to vLLM is declared as a :class:`Patch` (the table is
:data:`vllm_prefix_guard.patches.PATCHES`) and applied through :class:`PatchRegistry`, so that
- the same attribute is never patched twice (a second attempt raises instead of
  silently stacking wrappers or overwriting a foreign patch);
- the original stays reachable (``original_of``) for tests and for the wrappers;
- ``undo_all`` restores stock vLLM in-process (tests compare stock and guarded runs).
"""

from __future__ import annotations

import importlib
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


def resolve(module: str, path: str) -> Any:
    """Import ``module`` and return the object at the dotted ``path`` inside it."""
    value: Any = importlib.import_module(module)
    for part in path.split("."):
        value = getattr(value, part)
    return value


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


@dataclass(frozen=True)
class Patch:
    """One change the guard makes to vLLM, with the reasons a reviewer asks for.

    ``path`` is ``Owner.name`` (the attribute ``how`` replaces: ``how`` names a function
    that takes vLLM's original and returns the replacement) or ``Owner`` (a class whose
    own members ``how`` names a class of: each is added, vLLM having none of that name).
    """

    #: The vLLM module that defines the owner.
    module: str
    path: str
    #: ``module:qualname`` of the wrapper's factory, or of the class of members added.
    how: str
    #: What goes wrong in stock vLLM without it.
    why: str
    #: Where vLLM gets the same change (``upstream/``).
    upstream: str
    #: When the patch can go.
    remove_when: str
    #: The parameters of vLLM's method the replacement names (besides ``self``); with
    #: ``exact``, all of them in this order (the replacement forwards them one by one).
    params: tuple[str, ...] = ()
    exact: bool = False
    #: ``Owner.name`` is what an earlier patch of the table adds, not vLLM's.
    wraps_addition: bool = False

    @property
    def owner(self) -> str:
        return self.path.partition(".")[0]

    @property
    def name(self) -> str | None:
        """The attribute replaced; None where members are added."""
        return self.path.partition(".")[2] or None

    def resolve_how(self) -> Any:
        """The object ``how`` names (imported only when the patch is applied: the
        table itself imports nothing of vLLM)."""
        module, _, qualname = self.how.partition(":")
        return resolve(module, qualname)

    def members(self) -> dict[str, Any]:
        """What an ``Owner`` patch adds: the own members of the class ``how`` names."""
        body = self.resolve_how()
        return {k: v for k, v in vars(body).items() if not (k[:2] == k[-2:] == "__")}

    def label(self) -> str:
        """How the start-up log names it: ``Owner.name``, or ``Owner.{a,b}`` for members
        added."""
        if self.name is not None:
            return self.path
        return f"{self.owner}.{{{','.join(self.members())}}}"

    def apply(self, registry: PatchRegistry, owner: Any) -> str:
        """Apply to the class ``owner`` through ``registry``; return its :meth:`label`."""
        if self.name is not None:
            registry.apply(owner, self.name, self.resolve_how(), over_own=self.wraps_addition)
        else:
            for name, value in self.members().items():
                registry.apply(owner, name, _added(f"{self.owner}.{name}", value))
        return self.label()


def _added(path: str, value: Any) -> Callable[[Any], Any]:
    """The patch that adds ``value`` where vLLM has no such attribute."""

    def make(original: Any) -> Any:
        if original is not None:
            raise PatchError(f"{path} is vLLM's own: vLLM carries this part of the fix")
        return value

    return make


class PatchRegistry:
    """Records applied patches so they can be listed, looked up and undone."""

    def __init__(self) -> None:
        self._applied: list[AppliedPatch] = []
        self._patched: set[tuple[int, str]] = set()

    def apply(
        self, owner: Any, name: str, make: Callable[[Any], Any], over_own: bool = False
    ) -> AppliedPatch:
        """Replace ``owner.name`` with ``make(original)``.

        ``original`` is the attribute as stored on ``owner`` itself (``__dict__``), not an
        inherited one, so undo restores exactly the previous state; a missing attribute is
        passed as ``None`` and removed again on undo.

        Args:
            over_own: wrap what this registry put there (a patch over an addition).

        Raises:
            PatchError: the attribute is already patched (by this registry, unless
                ``over_own``, or by an earlier guard instance).
        """
        key = (id(owner), name)
        if (key in self._patched) != over_own:
            raise PatchError(
                f"{owner!r}.{name} is already patched by vllm-prefix-guard"
                if not over_own
                else f"{owner!r}.{name} is not one of this registry's patches"
            )
        stored = vars(owner).get(name, _MISSING)
        if not over_own and is_guard_patch(stored):
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
        self._applied.append(applied)
        self._patched.add(key)
        return applied

    def original_of(self, owner: Any, name: str) -> Any:
        """The attribute ``owner.name`` had before it was patched."""
        applied = next(a for a in self._applied if a.owner is owner and a.name == name)
        return None if applied.original is _MISSING else applied.original

    @property
    def applied(self) -> list[AppliedPatch]:
        return list(self._applied)

    def undo_all(self) -> None:
        """Restore every patched attribute, newest first."""
        for applied in reversed(self._applied):
            if applied.original is _MISSING:
                delattr(applied.owner, applied.name)
            else:
                setattr(applied.owner, applied.name, applied.original)
        self._applied.clear()
        self._patched.clear()
