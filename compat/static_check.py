#!/usr/bin/env python3
"""What a vLLM release moved in the internals the guard touches, read from its wheel's source.

Before anything is installed: the wheel of ``vllm==X.Y.Z`` is downloaded (``pip download
--no-deps``, about 240 MB for the GPU wheel, nothing imported, no torch), and every entry
of the guard's start-up checks (``targets.INTERNALS`` and the three structural checks) is
looked up in its Python source with ``ast``, as the start-up check asks the live vLLM:
does the class define or inherit the method, with which parameters; is the field declared;
does a constructor in the class or its bases assign the attribute. The same is read from a
base release (default: the newest tested one), and each internal is classed:

- *removed*: there in the base, gone here (the guard refuses this release until ported);
- *signature changed*: a callable's parameters differ (refused where the guard forwards or
  names them);
- *body changed*: same signature, other code (read the diff: the guard reasons about it);
- *unchanged*.

It also lists what the classes the guard patches gained or lost (new methods of
``Scheduler``, ``BlockPool``, ``KVCacheManager``, ...), which is where a new path that
registers or drops prefix-cache entries appears first.

The page it writes (``docs/compat/vllm-X.Y.Z.md``) is the porter's checklist; the live
checks (``vllm-prefix-guard doctor``) stay the authority once installed.

Usage::

    python compat/static_check.py --vllm 0.34.0 [--base 0.33.0] [--out docs/compat/vllm-0.34.0.md]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from vllm_prefix_guard import targets  # noqa: E402  (stdlib only: no vLLM import)
from vllm_prefix_guard.patches import PATCHES  # noqa: E402
from vllm_prefix_guard.versions import TESTED_VLLM  # noqa: E402

WHEELS = ROOT / ".nox" / "vllm-wheels"
#: The classes the guard wraps or grafts onto: what they gained or lost is listed.
PATCHED_CLASSES = (
    (targets.SCHEDULER, "Scheduler"),
    (targets.BLOCK_POOL, "BlockPool"),
    (targets.BLOCK_POOL, "BlockHashToBlockMap"),
    (targets.MANAGER, "KVCacheManager"),
    (targets.COORDINATOR, "KVCacheCoordinator"),
    (targets.SINGLE_TYPE_MANAGER, "SingleTypeKVCacheManager"),
    (targets.SINGLE_TYPE_MANAGER, "MambaManager"),
)


def wheel_path(version: str, cache: Path = WHEELS) -> Path:
    """The wheel of ``vllm==version`` (downloaded once into ``cache``, no dependencies)."""
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--dest",
                str(cache),
                f"vllm=={version}",
            ],
            check=True,
        )
        found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"no wheel of vllm=={version} was downloaded")
    return found[-1]


@dataclass
class Source:
    """The Python modules of one vLLM, parsed on demand: ``read(path)`` returns the text of
    ``vllm/...py`` (from a wheel, or an installed tree) or raises ``KeyError``."""

    read: Callable[[str], str]
    _trees: dict[str, ast.Module | None] = field(default_factory=dict)

    @classmethod
    def of_wheel(cls, wheel: zipfile.ZipFile) -> Source:
        return cls(lambda path: wheel.read(path).decode())

    @classmethod
    def of_tree(cls, site_packages: Path) -> Source:
        def read(path: str) -> str:
            try:
                return (site_packages / path).read_text()
            except FileNotFoundError as exc:
                raise KeyError(path) from exc

        return cls(read)

    def module(self, name: str) -> ast.Module | None:
        if name not in self._trees:
            path = name.replace(".", "/")
            tree = None
            for candidate in (f"{path}.py", f"{path}/__init__.py"):
                try:
                    tree = ast.parse(self.read(candidate))
                    break
                except KeyError:
                    continue
            self._trees[name] = tree
        return self._trees[name]

    def resolve_class(self, module: str, name: str, depth: int = 0) -> ast.ClassDef | None:
        """The class ``name`` defines or imports at module level in ``module``."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        imported = imported_from(tree, module, name)
        if imported is not None:
            return self.resolve_class(imported[0], imported[1], depth + 1)
        return None

    def mro(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """``(module, class)`` for the class and its bases that this source defines, in a
        depth-first order (enough for the single inheritance vLLM uses here)."""
        out: list[tuple[str, ast.ClassDef]] = []
        pending = [(module, name)]
        while pending and len(out) < 16:
            mod, cls_name = pending.pop(0)
            cls = self.resolve_class(mod, cls_name)
            if cls is None:
                continue
            home = self.home_module(mod, cls_name)
            out.append((home, cls))
            for base in cls.bases:
                base_name = base.id if isinstance(base, ast.Name) else None
                if base_name is None and isinstance(base, ast.Attribute):
                    base_name = base.attr
                if base_name and base_name not in ("object", "ABC", "Generic"):
                    pending.append((home, base_name))
        return out

    def home_module(self, module: str, name: str, depth: int = 0) -> str:
        tree = self.module(module)
        if tree is None or depth > 8:
            return module
        if any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body):
            return module
        imported = imported_from(tree, module, name)
        return self.home_module(*imported, depth + 1) if imported else module


def imported_from(tree: ast.Module, module: str, name: str) -> tuple[str, str] | None:
    """``(module, name)`` a module-level ``from X import name`` brings in, if any."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    base = node.module or ""
                    if node.level:
                        parts = module.split(".")[: -node.level]
                        base = ".".join([*parts, base] if base else parts)
                    return base, alias.name
    return None


def functions(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> tuple[str, ...]:
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if method and names:
        names = names[1:]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    if args.kwarg:
        names.append("**" + args.kwarg.arg)
    return tuple(names)


def annotated(cls: ast.ClassDef) -> set[str]:
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def class_level(cls: ast.ClassDef) -> set[str]:
    names = annotated(cls) | set(functions(cls))
    for node in cls.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def stored_on_self(fn: ast.AST) -> set[str]:
    """Attribute names ``fn`` assigns on ``self`` (``self.x = ...``, ``self.x: T = ...``)."""
    stored = set()
    for node in ast.walk(fn):
        targets_: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets_ = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets_ = [node.target]
        for target in targets_:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    stored.add(sub.attr)
    return stored


@dataclass(frozen=True)
class Found:
    """What one internal is in one release: absent, or its signature and code digest."""

    present: bool
    detail: str = ""
    signature: tuple[str, ...] | None = None
    digest: str = ""


def code_digest(node: ast.AST) -> str:
    return hashlib.sha256(ast.dump(node, include_attributes=False).encode()).hexdigest()[:12]


def look_up(source: Source, internal: targets.Internal) -> Found:
    """``internal`` in ``source``, as :func:`targets.check` asks the live vLLM."""
    tree = source.module(internal.module)
    if tree is None:
        return Found(False, f"no module {internal.module}")
    owner = internal.owner
    if internal.kind is targets.Kind.NAME or owner is None:
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == internal.name:
                return Found(True)  # its members are checked one by one
            if isinstance(node, ast.FunctionDef) and node.name == internal.name:
                return Found(True, signature=parameters(node, False), digest=code_digest(node))
            if isinstance(node, ast.Assign | ast.AnnAssign):
                names = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == internal.name for t in names):
                    return Found(True, digest=code_digest(node))
        if imported_from(tree, internal.module, internal.name):
            return Found(True, "imported")
        return Found(False, f"{internal.module} defines no {internal.name}")
    classes = source.mro(internal.module, owner)
    if not classes:
        return Found(False, f"no class {owner}")
    name = internal.name
    for _, cls in classes:
        if internal.kind is targets.Kind.CALLABLE:
            fn = functions(cls).get(name)
            if fn is not None:
                return Found(True, signature=parameters(fn, method=True), digest=code_digest(fn))
        elif internal.kind is targets.Kind.FIELD:
            if name in annotated(cls):
                return Found(True)
        elif name in class_level(cls):
            return Found(True)
    if internal.kind is targets.Kind.ATTRIBUTE:
        for _, cls in classes:
            init = functions(cls).get("__init__")
            if init is not None and name in stored_on_self(init):
                return Found(True, "assigned by a constructor")
    what = {targets.Kind.CALLABLE: "method", targets.Kind.FIELD: "field"}.get(
        internal.kind, "attribute"
    )
    return Found(False, f"no {what} {name} on {owner} or its bases")


def pool_calls(source: Source, module: str, name: str) -> set[str]:
    """What a class's own code uses on a block pool (``self.block_pool.x`` or
    ``block_pool.x``): the source twin of ``targets.pool_calls``."""
    cls = source.resolve_class(module, name)
    if cls is None:
        return set()
    calls = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute):
            value = node.value
            if (isinstance(value, ast.Attribute) and value.attr == "block_pool") or (
                isinstance(value, ast.Name) and value.id == "block_pool"
            ):
                calls.add(node.attr)
    return calls


def added_names(how: str) -> set[str]:
    """The class-level names of the guard's own class ``module:Class`` (what a patch of
    the table adds), read from this repository's source, not imported."""
    module, _, name = how.partition(":")
    path = ROOT / "src" / (module.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    return class_level(cls)


def additions(source: Source) -> Found:
    """What the patch table adds to vLLM's classes, none of it there already."""
    clashing = []
    for patch in PATCHES:
        if patch.name is not None:
            continue
        have: set[str] = set()
        for _, cls in source.mro(patch.module, patch.owner):
            have |= class_level(cls) | stored_on_self(functions(cls).get("__init__") or cls)
        clashing += [f"{patch.owner}.{n}" for n in sorted(added_names(patch.how) & have)]
    return Found(not clashing, f"already there: {', '.join(clashing)}" if clashing else "")


def structural(source: Source) -> dict[str, Found]:
    """The start-up checks beyond the list of internals, read from source."""
    out: dict[str, Found] = {}
    calls = pool_calls(source, targets.SINGLE_TYPE_MANAGER, "MambaManager")
    unknown = sorted(calls - targets.STATE_GROUP_POOL_CALLS.keys())
    out[f"{targets.STATE_GROUP_MANAGER} (pool calls)"] = Found(
        not unknown,
        f"calls {', '.join(unknown)}, not reviewed" if unknown else ", ".join(sorted(calls)),
        digest=",".join(sorted(calls)),
    )
    cached = source.resolve_class(targets.SCHEDULER_OUTPUT, "CachedRequestData")
    fields = annotated(cached) if cached is not None else set()
    resumes = "cached" if "resumed_req_ids" in fields else "new"
    other = sorted(f for f in fields if "resum" in f or "preempt" in f) if resumes == "new" else []
    out[f"{targets.CACHED_REQUEST_DATA} (resumed requests)"] = Found(
        cached is not None and not other,
        f"resumed requests sent among the {resumes} ones"
        + (f"; other fields: {', '.join(other)}" if other else ""),
        digest=resumes,
    )
    out["what the patch table adds (absent from vLLM)"] = additions(source)
    return out


def survey(source: Source, internals: tuple[targets.Internal, ...]) -> dict[str, Found]:
    """Every start-up check's subject in ``source``, by the name ``doctor`` prints."""
    found = {internal.qualname: look_up(source, internal) for internal in internals}
    found.update(structural(source))
    return found


#: Prints the internals the guard checks at one revision, as JSON (run by that revision's
#: own ``targets``, in a subprocess: its code, not this one's, says what it touched).
_DUMP_INTERNALS = """
import json
from vllm_prefix_guard import targets
print(json.dumps([
    [i.module, i.path, i.kind.name, i.used_by, list(i.params), i.exact]
    for i in targets.INTERNALS
]))
"""


def internals_at(revision: str) -> tuple[targets.Internal, ...]:
    """The guard's list of internals at a git ``revision`` of this repository (what it
    touched when the release came out: ``--guard-rev`` of the commit before a port)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", revision, "src/vllm_prefix_guard"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        listed = subprocess.run(
            [sys.executable, "-c", _DUMP_INTERNALS],
            check=True,
            capture_output=True,
            text=True,
            env={"PYTHONPATH": str(Path(tmp) / "src"), "PATH": os.environ.get("PATH", "")},
        ).stdout
    return tuple(
        targets.Internal(module, path, targets.Kind[kind], used_by, tuple(params), exact)
        for module, path, kind, used_by, params, exact in json.loads(listed)
    )


def members(source: Source) -> dict[str, set[str]]:
    """``Class`` -> its own method names, for each class the guard patches."""
    out = {}
    for module, name in PATCHED_CLASSES:
        cls = source.resolve_class(module, name)
        out[name] = set(functions(cls)) if cls is not None else set()
    return out


@dataclass(frozen=True)
class Moved:
    name: str
    status: str
    detail: str


def compare(base: dict[str, Found], new: dict[str, Found]) -> list[Moved]:
    rows = []
    for name, found in new.items():
        before = base.get(name)
        if not found.present:
            status = "removed" if before is None or before.present else "absent in both"
            rows.append(Moved(name, status, found.detail))
        elif before is None or not before.present:
            rows.append(Moved(name, "added", found.detail))
        elif found.signature != before.signature:
            old = ", ".join(before.signature or ())
            rows.append(
                Moved(name, "signature changed", f"({old}) -> ({', '.join(found.signature or ())})")
            )
        elif found.digest != before.digest and found.signature is None and found.detail:
            rows.append(Moved(name, "changed", f"{before.detail} -> {found.detail}"))
        elif found.digest != before.digest:
            rows.append(Moved(name, "body changed", found.detail))
        else:
            rows.append(Moved(name, "unchanged", found.detail))
    return rows


#: Where the part of a release's page that the routine writes begins.
KEPT_FROM = "<!-- routine:begin -->"

ORDER = (
    "removed",
    "signature changed",
    "changed",
    "added",
    "body changed",
    "absent in both",
    "unchanged",
)


def render_checks(rows: list[Moved], who: str) -> list[str]:
    """One table of the start-up checks, read against the internals of ``who``."""
    counts = {status: sum(r.status == status for r in rows) for status in ORDER}
    lines = [
        f"{len(rows)} start-up checks of {who}: "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + ".",
        "",
        "| internal | status | detail |",
        "|---|---|---|",
    ]
    for status in ORDER[:-1]:
        lines += [f"| `{r.name}` | {status} | {r.detail} |" for r in rows if r.status == status]
    unchanged = [r.name.split(".")[-2:] for r in rows if r.status == "unchanged"]
    lines += [
        "",
        f"Unchanged ({len(unchanged)}): " + ", ".join(f"`{'.'.join(n)}`" for n in unchanged) + ".",
    ]
    return lines


def render(
    version: str,
    base_version: str,
    sections: list[tuple[str, list[Moved]]],
    gained: dict[str, tuple[set[str], set[str]]],
    command: str,
) -> str:
    lines = [
        f"# vLLM {version} against {base_version}: what moved in what the guard touches",
        "",
        f"Read statically from the two wheels' sources (`{command}`: nothing imported, no "
        f"torch), before {version} is installed. A *removed* or *signature changed* entry "
        "makes the guard refuse to start (never half-protected); *changed* and *body changed* "
        "are code to read before claiming the release. `vllm-prefix-guard doctor` on the "
        "installed release has the last word.",
    ]
    for heading, rows in sections:
        lines += ["", f"## {heading}", "", *render_checks(rows, heading.split(": ", 1)[-1])]
    lines += [
        "",
        "## What the classes the guard patches gained and lost",
        "",
        "| class | new methods | methods gone |",
        "|---|---|---|",
    ]
    for name, (added, gone) in gained.items():
        lines.append(
            f"| `{name}` | {', '.join(f'`{m}`' for m in sorted(added)) or '-'} "
            f"| {', '.join(f'`{m}`' for m in sorted(gone)) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def check(
    version: str, base_version: str, internals: tuple[targets.Internal, ...] = targets.INTERNALS
) -> tuple[list[Moved], dict[str, tuple[set[str], set[str]]]]:
    with (
        zipfile.ZipFile(wheel_path(version)) as new_whl,
        zipfile.ZipFile(wheel_path(base_version)) as base_whl,
    ):
        new, base = Source.of_wheel(new_whl), Source.of_wheel(base_whl)
        rows = compare(survey(base, internals), survey(new, internals))
        new_members, base_members = members(new), members(base)
    gained = {
        name: (new_members[name] - base_members[name], base_members[name] - new_members[name])
        for name in new_members
    }
    return rows, gained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", required=True, help="the release to read, e.g. 0.34.0")
    parser.add_argument(
        "--base", default=None, help="the release to compare with (default: the newest tested)"
    )
    parser.add_argument("--out", type=Path, default=None, help="the page to write")
    parser.add_argument(
        "--guard-rev",
        default=None,
        help="check the internals the guard touched at this git revision (default: this "
        "checkout's); the commit before a port shows what the release broke",
    )
    args = parser.parse_args(argv)
    base = args.base or max(TESTED_VLLM, key=lambda v: tuple(int(p) for p in v.split(".")))
    if base == args.vllm:
        base = sorted(TESTED_VLLM, key=lambda v: tuple(int(p) for p in v.split(".")))[-2]
    sections = []
    if args.guard_rev:
        rows, gained = check(args.vllm, base, internals_at(args.guard_rev))
        sections.append((f"Before the port: the guard at {args.guard_rev}", rows))
    rows, gained = check(args.vllm, base, targets.INTERNALS)
    sections.append(("Now: the guard of this checkout", rows))
    command = f"python compat/static_check.py --vllm {args.vllm} --base {base}"
    if args.guard_rev:
        command += f" --guard-rev {args.guard_rev}"
    page = render(args.vllm, base, sections, gained, command)
    out = args.out or ROOT / "docs" / "compat" / f"vllm-{args.vllm}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    # The routine's results (compat/routine.py) follow the static part; they are kept.
    kept = out.read_text().partition(KEPT_FROM)[1:] if out.exists() else ()
    out.write_text(page + ("\n" + "".join(kept) if kept and kept[0] else ""))
    for heading, rows in sections:
        refused = [r for r in rows if r.status in ("removed", "signature changed")]
        print(f"{heading}: {len(rows)} checks, {len(refused)} that refuse start-up")
        for row in refused:
            print(f"  {row.status}: {row.name}: {row.detail}")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
