"""Sessions for the Colossal monorepo.

Every package is tested in a virtual environment that holds only that package, the sibling
packages it declares (installed from this tree, never from a registry), its ``test`` extra
(local packages there too, e.g. the test-only ``colossal-testkit``) and torch. That is how we
prove the import arrows of ``ARCHITECTURE.md``.

torch comes from one pinned spec, ``COLOSSAL_TORCH_SPEC`` (default ``torch==2.13.0``, the CPU
build that lies on this project's machines), passed as a pip constraint to every install so that
no session can ever pull a different (multi-GB CUDA) torch by accident.

Two caches keep the many venvs cheap (installing was most of CI's time): torch is installed once,
with ``pip install --target``, into ``.nox/_shared/`` and each session venv sees it through a
``.pth`` file (every package declares torch, so this adds nothing a package did not ask for); and
each local package is built into a wheel once per source state (its files' digest and the commit,
which setuptools-scm puts in the version) and installed from that wheel by every session that
needs it.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import tomllib

import nox

ROOT = pathlib.Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
TORCH_SPEC = os.environ.get("COLOSSAL_TORCH_SPEC", "torch==2.13.0")
PACKAGES = sorted(p.name for p in PACKAGES_DIR.iterdir() if (p / "pyproject.toml").exists())

nox.options.sessions = ["tests", "lint", "docs"]  # + "flakes" (3 random orders) before a release
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True


def _requirement_names(requirements: list[str]) -> list[str]:
    return [re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements]


def _project(dist: str) -> dict:
    return tomllib.loads((PACKAGES_DIR / dist / "pyproject.toml").read_text())["project"]


def _folders() -> dict[str, str]:
    """Distribution name -> folder under ``packages/``: the folders keep the import-side names
    (``packages/colossalai``, ``packages/fastfold``) while the distributions are ``colossal-stack``
    and ``colossal-fastfold`` (the public index's ``colossalai`` is another project)."""
    return {_project(folder)["name"]: folder for folder in PACKAGES}


def sibling_closure(dist: str, extras: tuple[str, ...] = ()) -> list[str]:
    """Local packages (folders) ``dist`` (a folder) needs at run time (and for ``extras``),
    dependencies first."""
    project = _project(dist)
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    folders = _folders()
    order: list[str] = []
    for name in [folders[n] for n in _requirement_names(reqs) if n in folders]:
        if name != dist:
            for dep in sibling_closure(name) + [name]:
                if dep not in order:
                    order.append(dep)
    return order


def _constraints(session: nox.Session) -> str:
    path = pathlib.Path(session.create_tmp()) / "constraints.txt"
    path.write_text(TORCH_SPEC + "\n")
    return str(path)


def test_extras(dist: str) -> str:
    """The extras a package's test session installs: ``test``, plus ``hf`` where the package has it
    (its tests of Hugging Face models must run in CI, not be skipped)."""
    optional = _project(dist).get("optional-dependencies", {})
    return "test,hf" if "hf" in optional else "test"


SHARED = ROOT / ".nox" / "_shared"
"""Where the shared torch install and the local packages' wheels live (see the module docstring)."""


def _session_python(session: nox.Session, code: str) -> str:
    return session.run("python", "-c", code, silent=True).strip()


def _shared_torch(session: nox.Session, constraints: str) -> None:
    """Make the pinned torch importable in the session venv from one shared install (a ``.pth``)."""
    tag = _session_python(session, "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
    target = SHARED / f"{re.sub(r'[^A-Za-z0-9.+-]', '_', TORCH_SPEC)}-{tag}"
    if not (target / ".complete").exists():
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        session.run("python", "-m", "pip", "install", "-q", "--target", str(partial), "-c", constraints, TORCH_SPEC)
        (partial / ".complete").write_text(TORCH_SPEC + "\n")
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    site = pathlib.Path(_session_python(session, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    (site / "_colossal_shared_torch.pth").write_text(str(target) + "\n")


def _source_state(dist: str) -> str:
    """A digest of a local package's files and of the commit (setuptools-scm's version input)."""
    digest = hashlib.sha256()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        digest.update(head.stdout.encode())
    except (OSError, subprocess.CalledProcessError):
        digest.update(b"no git")
    base = PACKAGES_DIR / dist
    skip = {"build", "dist", "__pycache__", ".eggs"}
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(base)
        if path.is_file() and not any(p in skip or p.endswith(".egg-info") for p in rel.parts):
            digest.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _local_wheel(session: nox.Session, dist: str) -> pathlib.Path:
    """The wheel of local package ``dist`` for its current source state, built once."""
    folder = SHARED / "wheels" / f"{dist}-{_source_state(dist)}"
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        session.run("python", "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(partial), str(PACKAGES_DIR / dist))
        shutil.rmtree(folder, ignore_errors=True)
        partial.rename(folder)
        wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel of {dist} in {folder}, found {[w.name for w in wheels]}")
    return wheels[0]


def install_packages(session: nox.Session, dists: list[str], extras: dict[str, str] | None = None) -> None:
    """Install torch (pinned, shared) and the given local packages (from their cached wheels) in one
    resolver run. Local packages are named by wheel path, so pip never looks for them on a registry."""
    extras = extras or {}
    constraints = _constraints(session)
    _shared_torch(session, constraints)
    wheels = {d: _local_wheel(session, d) for d in dists}
    paths = [f"{dist_name(d)}[{extras[d]}] @ {wheels[d].as_uri()}" if d in extras else str(wheels[d]) for d in dists]
    session.install("-c", constraints, TORCH_SPEC, *paths)


def dist_name(dist: str) -> str:
    """The distribution name in a package's ``pyproject.toml``."""
    return _project(dist)["name"]


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Run one package's tests in its own venv (package + declared siblings + test extra)."""
    install_packages(session, sibling_closure(package, ("test",)) + [package], {package: test_extras(package)})
    session.env.setdefault("OMP_NUM_THREADS", "1")
    session.run(
        "python",
        "-m",
        "pytest",
        str(PACKAGES_DIR / package / "tests"),
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )


FLAKE_SEEDS = (1, 2, 3)
"""pytest-randomly seeds of ``nox -s flakes``: three shuffled orders of every package's suite."""


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def flakes(session: nox.Session, package: str) -> None:
    """Run one package's tests three times, each in a different random order (pytest-randomly,
    seeds ``FLAKE_SEEDS`` or ``-- --seeds 7,8,9``); any failure is an order dependency or a flake.

    pytest-randomly is a tool of this session only, not a test dependency of the packages.
    """
    args = list(session.posargs)
    seeds = FLAKE_SEEDS
    if "--seeds" in args:
        i = args.index("--seeds")
        seeds = tuple(int(s) for s in args[i + 1].split(","))
        del args[i : i + 2]
    install_packages(session, sibling_closure(package, ("test",)) + [package], {package: test_extras(package)})
    session.install("-c", _constraints(session), "pytest-randomly>=3.15")
    session.env.setdefault("OMP_NUM_THREADS", "1")
    for seed in seeds:
        session.log(f"{package}: random order, seed {seed}")
        session.run(
            "python",
            "-m",
            "pytest",
            str(PACKAGES_DIR / package / "tests"),
            "-p",
            "no:cacheprovider",
            "-p",
            "randomly",
            f"--randomly-seed={seed}",
            *args,
        )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree, plus the import-arrow check."""
    session.install("ruff==0.17.6", "pytest>=8")  # pinned: formatting rules change between releases
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", str(ROOT / "tools" / "check_arrows.py"))
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tools"))


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site strictly (warnings are errors)."""
    session.install("-r", str(ROOT / "requirements-docs.txt"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(pathlib.Path(session.create_tmp()) / "site"))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: ``colossalai train``: Gemini trains the mini GPT on the embedded corpus under a
    device budget smaller than its model states.

    Extra arguments go to ``colossalai train`` (e.g. ``nox -s demo -- --plugin zero --nproc 2``).
    """
    install_packages(session, sibling_closure("colossalai") + ["colossalai"])
    # Two threads by default, or the caller's; passive waits: with spinning OpenMP threads a step took
    # 13x the CPU time on a shared, loaded machine (2.0 s against 0.15 s).
    session.env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "2")
    session.env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    session.run("colossalai", "train", *session.posargs)


def bench_siblings(dist: str) -> list[str]:
    """Local packages a benchmark runs side by side with ``dist`` (``bench/siblings.txt``, one per
    line, ``#`` comments), with their own siblings: bench-only peers, not a run-time arrow."""
    path = PACKAGES_DIR / dist / "bench" / "siblings.txt"
    if not path.exists():
        return []
    names = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    unknown = sorted(n for n in names if n and n not in PACKAGES)
    if unknown:
        raise ValueError(f"{path}: {unknown} are not packages of this tree ({PACKAGES})")
    order: list[str] = []
    for name in filter(None, names):
        order += [d for d in sibling_closure(name) + [name] if d not in order and d != dist]
    return order


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def bench(session: nox.Session, package: str) -> None:
    """Run every script in ``packages/<package>/bench/`` (side-by-side comparisons)."""
    scripts = sorted((PACKAGES_DIR / package / "bench").glob("bench_*.py"))
    if not scripts:
        session.skip(f"{package} has no benchmarks yet")
    bench_reqs = PACKAGES_DIR / package / "bench" / "requirements.txt"
    peers = bench_siblings(package)
    install_packages(session, [d for d in sibling_closure(package) + [package] if d not in peers] + peers)
    if bench_reqs.exists():
        session.install("-c", _constraints(session), "-r", str(bench_reqs))
    for script in scripts:
        session.run("python", str(script), *session.posargs)


INSTALL_DOC = ROOT / "docs" / "install.md"
"""Where the one-line install-from-the-tree commands live, between the two markers below; ``nox -s
install`` runs each of them exactly as written."""
INSTALL_BEGIN, INSTALL_END = "<!-- install-from-tree:begin -->", "<!-- install-from-tree:end -->"


def documented_installs(path: pathlib.Path = INSTALL_DOC) -> dict[str, str]:
    """Folder -> the documented ``pip install ...`` line that installs that package alone from a
    checkout (the last ``./packages/<folder>`` on the line is the package it is for)."""
    text = path.read_text()
    block = text.split(INSTALL_BEGIN, 1)[1].split(INSTALL_END, 1)[0]
    lines = [line.strip() for line in block.splitlines() if line.strip().startswith("pip install ")]
    return {re.findall(r"\./packages/([\w-]+)", line)[-1]: line for line in lines}


def _install_probe(folder: str) -> list[str]:
    """What proves a package installed alone: it imports (``colossalai check`` for the meta-package,
    which also warns when the imported ``colossalai`` is another project)."""
    if folder == "colossalai":
        return ["colossalai", "check"]
    module = {"fastfold": "fastfold"}.get(folder, "colossal." + folder.removeprefix("colossal-").replace("-", "_"))
    return ["python", "-c", f"import {module}; print({module}.__name__, 'imports')"]


@nox.session
def install(session: nox.Session) -> None:
    """Install each package alone in a fresh venv with exactly the command ``docs/install.md`` gives
    (run from the repository root, as a user would), then import it.

    Every user-facing package must have its line (the test-only ``colossal-testkit`` must not). The
    fresh venvs see the shared pinned torch through a ``.pth`` (as the test sessions do), so the
    line's ``torch==2.13.0`` is already satisfied and is not reinstalled for every line.
    """
    commands = documented_installs()
    expected = sorted(p for p in PACKAGES if p != "colossal-testkit")
    if sorted(commands) != expected:
        session.error(f"{INSTALL_DOC}: install lines for {sorted(commands)}, expected {expected}")
    for line in commands.values():
        if "colossal-testkit" in line or "./packages/*" in line:
            session.error(f"{INSTALL_DOC}: {line!r} installs the test-only colossal-testkit")
    constraints = _constraints(session)
    _shared_torch(session, constraints)
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    shared_pth = pathlib.Path(_session_python(session, purelib)) / "_colossal_shared_torch.pth"
    for folder in session.posargs or expected:
        venv = pathlib.Path(session.create_tmp()).resolve() / f"venv-{folder}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("python", "-m", "venv", str(venv))
        bindir = venv / "bin"
        site = subprocess.run([bindir / "python", "-c", purelib], capture_output=True, text=True, check=True)
        shutil.copy(shared_pth, pathlib.Path(site.stdout.strip()) / shared_pth.name)
        # Not session.run: nox would put its own venv first on PATH, and `pip` must be the fresh one's.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env |= {"PATH": f"{bindir}{os.pathsep}{env['PATH']}", "VIRTUAL_ENV": str(venv)}
        # The documented line from the repository root; the probe from elsewhere, so that it imports
        # what was installed and nothing of the tree.
        for command, cwd in ((commands[folder], ROOT), (shlex.join(_install_probe(folder)), venv)):
            session.log(f"{folder}: {command}")
            if subprocess.run(["bash", "-c", command], cwd=cwd, env=env).returncode != 0:
                session.error(f"{folder}: {command!r} failed in a fresh venv")
