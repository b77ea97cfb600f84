"""The folder to name instead, when an import root holds none of the patches' packages.

A new user names one level off (``-s .../site-packages/vllm``, a venv's ``lib/`` or
``lib/python3.X``, the folder above a checkout) or forgets ``-s`` (the running interpreter's
site-packages, fp32patch's own environment, holds no vLLM). Every command then finds nothing;
this says where the packages are and prints the command again with that folder: the folders
above the root (the root is inside a package), a few levels below it (environments, checkouts),
and for the default root the places a shell points at (``$VIRTUAL_ENV``, ``$CONDA_PREFIX``, the
current folder, the interpreters on ``PATH``). Reads folder listings only; imports nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from fp32patch.patcher.envs import is_environment, site_packages
from fp32patch.patcher.locate import LocateError, locate
from fp32patch.patcher.model import Spec
from fp32patch.patcher.report import Invocation

DEPTH = 4  # folders below a root looked at (a venv's site-packages is 3 below its top)
SHOWN = 4  # import roots named in one line at most
BUDGET = 3000  # folders looked at in all, so a root such as / costs a fraction of a second
_SKIP = {".git", "node_modules", "__pycache__", ".fp32patch", "proc", "sys", "dev"}
# how the stacks and engines are named in a sentence (distribution -> name)
NAMES = {
    "vllm": "vLLM",
    "sglang": "SGLang",
    "nemo-rl": "NeMo-RL",
    "verl": "verl",
    "trl": "TRL",
    "openrlhf": "OpenRLHF",
    "slime": "slime",
    "prime-rl": "Prime-RL",
    "areal": "AReaL",
    "skyrl": "SkyRL",
}


def holds(root: Path, specs: Sequence[Spec]) -> list[str]:
    """The distributions of ``specs`` found in ``root`` (as every command looks: editable installs too)."""
    found: list[str] = []
    for spec in specs:
        try:
            located = locate(spec, root)
        except (LocateError, OSError):
            continue
        if located is not None and spec.target.distribution not in found:
            found.append(spec.target.distribution)
    return found


def _quick(folder: Path, specs: Sequence[Spec]) -> bool:
    """Whether any target file sits in ``folder`` (a stat per spec, for the walk)."""
    return any((folder / s.target.path).is_file() for s in specs)


def _below(root: Path, specs: Sequence[Spec]) -> list[Path]:
    """Import roots under ``root`` that hold a target: a folder with a target file, or an environment's
    site-packages; the walk stops at each one found and never enters an environment's own files."""
    found: list[Path] = []
    level, seen = [root], 0
    for _ in range(DEPTH):
        below: list[Path] = []
        for folder in level:
            try:
                children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
            except OSError:
                continue
            for child in children:
                seen += 1
                if seen > BUDGET:
                    return found
                if child.name in _SKIP:
                    continue
                if is_environment(child):
                    found += [sp for sp in site_packages(child) if holds(sp, specs)]
                elif _quick(child, specs):
                    found.append(child)
                else:
                    below.append(child)
        level = below
    return found


def _above(root: Path, specs: Sequence[Spec]) -> Path | None:
    """The folder above ``root`` that holds a target whose package folder ``root`` is in."""
    for folder in list(root.parents)[:DEPTH]:
        top = root.relative_to(folder).parts[0]
        if any(s.target.path.split("/")[0] == top for s in specs) and _quick(folder, specs):
            return folder
    return None


def _environment_of(sp: Path) -> Path | None:
    """The environment whose site-packages ``sp`` is (``-s`` takes the environment's folder too)."""
    for env in list(sp.parents)[:3]:
        if is_environment(env) and sp in site_packages(env):
            return env
    return None


def _shell_places() -> list[tuple[Path, bool]]:
    """Where the packages may be when no root was named: what the shell points at, each with whether
    to look below it (the interpreters on PATH: their prefix's lib/python3.X/*-packages only)."""
    places = [(os.environ.get("VIRTUAL_ENV"), True), (os.environ.get("CONDA_PREFIX"), True), (os.getcwd(), True)]
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if folder and Path(folder).name == "bin" and any(Path(folder).glob("python3*")):
            places.append((str(Path(folder).parent), False))
    out: dict[Path, bool] = {}
    for place, walk in places:
        if place and Path(place).is_dir():
            out.setdefault(Path(place).resolve(), walk)
    return list(out.items())


def _candidates(place: Path, walk: bool, specs: Sequence[Spec]) -> list[Path]:
    """Import roots at or under ``place`` (a prefix such as /usr/local has lib/python3.X/dist-packages)."""
    if is_environment(place):
        return [sp for sp in site_packages(place) if holds(sp, specs)]
    if _quick(place, specs):
        return [place]
    prefix = [p for p in sorted(place.glob("lib*/python3*/*-packages")) if p.is_dir() and holds(p, specs)]
    return prefix or (_below(place, specs) if walk else [])


def _named(path: Path) -> Path:
    """How a found import root is best named with -s: an environment by its folder."""
    return _environment_of(path) or path


def names(distributions: Iterable[str]) -> list[str]:
    """The stacks' and engines' names for ``distributions``, once each, engines first."""
    wanted = set(distributions)
    return [name for d, name in NAMES.items() if d in wanted] + sorted(wanted - set(NAMES))


def _packages(roots: Sequence[Path], specs: Sequence[Spec]) -> str:
    return ", ".join(names(d for root in roots for d in holds(root, specs)))


def advice(
    root: Path, specs: Sequence[Spec], inv: Invocation, verb: str, extra: Sequence[str] = (), *, default: bool = False
) -> str:
    """One line for a root that holds none of ``specs``' packages: why, and the command to run instead."""
    wanted = ", ".join(names(s.target.distribution for s in specs))
    others = [r for r in inv.roots if Path(r).absolute() != root and Path(r).resolve() != root]

    def again(*roots: Path, envs: Sequence[Path] = ()) -> str:
        fixed = Invocation((*others, *roots), (*inv.envs, *envs), inv.spec_dir, inv.patches)
        return f"`{fixed.command(verb, *extra)}`"

    if default:
        what = f"none of the patches' packages ({wanted}) is in {root}, this interpreter's site-packages (used when no -s or --envs is given)"
        found = [c for place, walk in _shell_places() for c in _candidates(place, walk, specs)]
        found = [f for f in dict.fromkeys(found) if f != root]
        if found:
            name = _named(found[0])
            return f"{what}; {_packages(found[:1], specs)} is in {found[0]}: {again(name)}"
        return (
            f"{what}: name the import root that holds them (a site-packages, a venv's folder, a checkout): "
            f"{again(Path('DIR'))}, or a folder of environments: {again(envs=[Path('DIR')])}"
        )
    real = root.resolve()
    above = _above(real, specs)
    if above is not None:
        package = above / real.relative_to(above).parts[0]
        where = (
            f"is the package folder {package} itself" if package == real else f"is inside the package folder {package}"
        )
        return f"{root} {where}, not an import root; name the folder that holds it: {again(above)}"
    below = _below(real, specs)
    envs = list(dict.fromkeys(e for b in below if (e := _environment_of(b)) is not None))
    what = f"{root} holds none of the patches' packages ({wanted})"
    if len(envs) > 1 and len(envs) == len(below):
        return f"{what}, but {len(envs)} Python environments under it do: {again(envs=[root])}"
    if below:
        named = list(dict.fromkeys(_named(b) for b in below))[:SHOWN]
        more = f" and {len(below) - SHOWN} more folders" if len(below) > SHOWN else ""
        return f"{what}; {_packages(below, specs)} is in {', '.join(map(str, below[:SHOWN]))}{more}: {again(*named)}"
    return (
        f"{what}, nor does any folder near it: name the import root that holds them (a site-packages, a venv's "
        f"folder, a checkout): {again(Path('DIR'))}"
    )


def advise(
    given: Sequence[Path],
    envs: Sequence[Path],
    specs: Sequence[Spec],
    inv: Invocation,
    verb: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """A line for each root named with -s (or the default root) that holds none of ``specs``' packages."""
    from fp32patch.patcher.plan import roots as import_roots

    if envs and not given:
        return []  # --envs alone: environments without the targets are the rule, not a mistake
    out: list[str] = []
    for named in given or [None]:
        try:
            pairs = import_roots([named] if named is not None else [], [])
        except ValueError:
            continue
        if any(holds(root, specs) for root, _ in pairs):
            continue
        root = Path(named).absolute() if named is not None else pairs[0][0]
        out.append(advice(root, specs, inv, verb, extra, default=named is None))
    return out
