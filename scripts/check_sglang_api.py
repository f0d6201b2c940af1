"""Check pivot's SGLang backend against SGLang's real source, without importing SGLang (its
CUDA dependencies do not install on a CPU machine).

It reads the pinned wheel (``pivot.actors.sglang_surface.PIN``) with ``zipfile`` and ``ast``
and checks every entry of ``pivot.actors.sglang_surface``: the names the backend imports are
defined where it imports them; each call exists on its class (or a base), sync or async as
the table says, with exactly the table's parameters; request classes have the fields the
backend sets; ``sampling_params`` keys are SamplingParams fields; ``Engine`` keywords are
ServerArgs fields; the result keys the backend reads are built in the module named; the
memory tags have the values named; the attributes the backend reads are assigned on their
class; the pause mode is one ``PauseGenerationReqInput`` offers.

    python scripts/check_sglang_api.py [WHEEL_OR_DIR]

WHEEL_OR_DIR: a wheel, or a folder holding ``sglang/`` (an install's site-packages). Without
an argument it takes the wheel from ~/.cache/pivot/wheels (PIVOT_WHEEL_CACHE),
downloading it there first with ``pip download --no-deps sglang==PIN``. Exit 0: every entry
holds; 1: the problems, one a line; 2: bad input.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without an install
    sys.path.insert(0, str(ROOT))

from pivot.actors import sglang_surface  # noqa: E402


def wheel_cache() -> Path:
    return Path(os.environ.get("PIVOT_WHEEL_CACHE", Path.home() / ".cache" / "pivot" / "wheels"))


def fetch_wheel(cache: Path | None = None, version: str = sglang_surface.PIN) -> Path:
    """The sglang wheel of ``version`` in ``cache``, downloaded (no dependencies) if absent."""
    cache = cache or wheel_cache()
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(cache),
                f"sglang=={version}",
            ],
            check=True,
        )
        found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download left no sglang-{version} wheel in {cache}")
    return found[0]


class Source:
    """The Python files of an SGLang wheel or of a folder holding ``sglang/``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._trees: dict[str, ast.Module | None] = {}

    def names(self, prefix: str) -> list[str]:
        """The files under ``prefix`` (a folder, "sglang/srt/" or "" for all in a wheel)."""
        if self._zip is not None:
            return [n for n in self._zip.namelist() if n.startswith(prefix)]
        root = self.path / prefix
        return [str(p.relative_to(self.path)) for p in root.rglob("*") if p.is_file()]

    def read(self, name: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(name).decode("utf-8")
            except KeyError:
                return None
        file = self.path / name
        return file.read_text(encoding="utf-8") if file.is_file() else None

    def version(self) -> str | None:
        """The SGLang version of the wheel, or of the installed folder's dist-info."""
        if self._zip is not None:
            names = [n for n in self._zip.namelist() if n.endswith(".dist-info/METADATA")]
        else:
            names = [
                str(p.relative_to(self.path)) for p in self.path.glob("sglang-*.dist-info/METADATA")
            ]
        for name in names:
            if name.startswith("sglang-"):
                for line in (self.read(name) or "").splitlines():
                    if line.startswith("Version:"):
                        return line.split(":", 1)[1].strip()
        return None

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._trees:
            base = dotted.replace(".", "/")
            text = self.read(base + ".py") or self.read(base + "/__init__.py")
            self._trees[dotted] = ast.parse(text) if text is not None else None
        return self._trees[dotted]

    def package(self, dotted: str) -> Iterator[ast.Module]:
        for name in self.names(dotted.replace(".", "/") + "/"):
            if name.endswith(".py"):
                tree = self.module(name[:-3].replace("/", "."))
                if tree is not None:
                    yield tree


def _class(src: Source, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    """The class ``name`` as ``module`` sees it: defined there, or imported from elsewhere."""
    tree = src.module(module)
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _class(src, node.module, alias.name)
    return None


def _lineage(src: Source, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases found in the source, nearest first."""
    found = _class(src, module, name)
    if found is None:
        return []
    out = [found]
    where, cls = found
    for base in cls.bases:
        if isinstance(base, ast.Name):
            out += _lineage(src, where, base.id)
    return out


def _members(lineage: list[tuple[str, ast.ClassDef]]) -> dict[str, ast.AST]:
    members: dict[str, ast.AST] = {}
    for _, cls in reversed(lineage):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                members[node.name] = node
    return members


def _fields(lineage: list[tuple[str, ast.ClassDef]]) -> set[str]:
    return {
        node.target.id
        for _, cls in lineage
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    args = [a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    return tuple(args if static else args[1:])


def _strings(tree: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _self_attributes(lineage: list[tuple[str, ast.ClassDef]]) -> set[str]:
    out = set()
    for _, cls in lineage:
        for node in ast.walk(cls):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else ([node.target] if isinstance(node, ast.AnnAssign) else [])
            )
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and (t.value.id == "self")
                ):
                    out.add(t.attr)
    return out


def check(src: Source, surface: ModuleType = sglang_surface) -> list[str]:
    """Every way the source differs from the table, one line each (none: it holds)."""
    problems: list[str] = []
    version = src.version()
    if version is not None and version != surface.PIN:
        problems.append(f"the source is SGLang {version}, the table is pinned to {surface.PIN}")
    for name, module in surface.MODULES.items():
        if _class(src, module, name) is None:
            problems.append(f"{module} defines or imports no class {name}")
    for call in surface.CALLS:
        what = f"{call.owner}.{call.name}"
        lineage = _lineage(src, call.module, call.owner)
        if not lineage:
            problems.append(f"{call.module}: no class {call.owner} (for {what})")
            continue
        fn = _members(lineage).get(call.name)
        if fn is None:
            problems.append(f"{what}: no such method on {call.owner} or its bases")
            continue
        is_async = isinstance(fn, ast.AsyncFunctionDef)
        if is_async != call.is_async:
            kind = "async" if is_async else "sync"
            problems.append(f"{what}: is {kind}, the table says otherwise")
        params = _params(fn)  # type: ignore[arg-type]
        if params != call.params:
            problems.append(f"{what}: parameters {params}, the table has {call.params}")
    io = surface.MODULES
    for name, wanted in surface.REQUESTS.items():
        lineage = _lineage(src, io[name], name)
        if not lineage:
            continue  # reported with MODULES
        missing = sorted(set(wanted) - _fields(lineage))
        if missing:
            problems.append(f"{name}: no fields {missing}")
    mode_cls = _lineage(src, io["PauseGenerationReqInput"], "PauseGenerationReqInput")
    if mode_cls and surface.PAUSE_MODE not in _strings(mode_cls[0][1]):
        problems.append(f"PauseGenerationReqInput offers no mode {surface.PAUSE_MODE!r}")
    sampling = _lineage(src, surface.SAMPLING_MODULE, "SamplingParams")
    if not sampling:
        problems.append(f"{surface.SAMPLING_MODULE}: no class SamplingParams")
    else:
        missing = sorted(set(surface.SAMPLING) - _fields(sampling))
        if missing:
            problems.append(f"SamplingParams: no fields {missing}")
    server_fields = {
        node.target.id
        for tree in src.package(surface.SERVER_ARGS_PACKAGE)
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    missing = sorted(set(surface.SERVER_ARGS) - server_fields)
    if missing:
        problems.append(f"ServerArgs ({surface.SERVER_ARGS_PACKAGE}): no fields {missing}")
    for module, keys in surface.RESULT_KEYS.items():
        tree = src.module(module)
        if tree is None:
            problems.append(f"no module {module} (for result keys {keys})")
            continue
        missing = sorted(set(keys) - _strings(tree))
        if missing:
            problems.append(f"{module} builds no keys {missing}")
    constants = {}
    tree = src.module(surface.MEMORY_TAGS_MODULE)
    for node in tree.body if tree is not None else []:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    constants[t.id] = node.value.value
    for name, value in surface.MEMORY_TAGS.items():
        if constants.get(name) != value:
            problems.append(
                f"{surface.MEMORY_TAGS_MODULE}.{name} is {constants.get(name)!r}, "
                f"the table has {value!r}"
            )
    for (module, cls), names in surface.ATTRIBUTES.items():
        lineage = _lineage(src, module, cls)
        if not lineage:
            problems.append(f"{module}: no class {cls}")
            continue
        missing = sorted(set(names) - _self_attributes(lineage))
        if missing:
            problems.append(f"{cls} assigns no attributes {missing}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: check_sglang_api.py [WHEEL_OR_DIR]", file=sys.stderr)
        return 2
    if argv:
        path = Path(argv[0])
        if not path.exists():
            print(f"check_sglang_api: {path}: no such wheel or folder", file=sys.stderr)
            return 2
    else:
        path = fetch_wheel()
    problems = check(Source(path))
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} problems in pivot/actors/sglang_surface.py against {path.name}")
        return 1
    print(f"sglang_surface holds against {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
