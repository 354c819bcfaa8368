"""Fixtures shared by the test modules, and the bytecode that the suite's processes share."""

from __future__ import annotations

import compileall
import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path

import pytest

import unicoll as uc
from helpers.several import SESSION
from unicoll.testing.spawn import PRELOAD

ROOT = Path(__file__).resolve().parent.parent
COMPILED = ("unicoll", "backends", "tests", "examples", "tools")
"""The repository's folders of Python source that the suite's processes import or run."""


def pytest_configure(config: pytest.Config) -> None:
    """Compile the repository's bytecode once where the interpreter may not write it, and
    start the forkserver that spawned worlds fork from, in each process that runs tests (not
    in pytest-xdist's controller, whose workers run them)."""
    _compile_bytecode(config)
    if not _distributes(config):
        _start_a_warm_forkserver()


def _distributes(config: pytest.Config) -> bool:
    """Whether this process is pytest-xdist's controller, which hands the tests to workers."""
    return bool(config.getoption("numprocesses", None)) and not hasattr(config, "workerinput")


WARM = "helpers.warm_server"
"""What the suite's forkserver imports beside :data:`unicoll.testing.spawn.PRELOAD`."""


def _start_a_warm_forkserver() -> None:
    """Start the server that :func:`unicoll.testing.spawn` forks its ranks from, now and with
    :data:`WARM` among what it imports: one compile run and Paddle, JAX and transformers' MoE
    models loaded there, once, instead of in each rank (helpers/warm_server.py). ``spawn``
    names the server's imports only for a server it starts itself, and starts none while one
    runs; this one starts while pytest collects, on the other core. Python 3.11's server does
    not apply the ``sys.path`` it is handed, so ``tests/`` reaches it through ``PYTHONPATH``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, WARM])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(ROOT / "tests"), prepend=os.pathsep)
        forkserver.ensure_running()


def _compile_bytecode(config: pytest.Config) -> None:
    """Where the interpreter may not write bytecode (``PYTHONDONTWRITEBYTECODE``, as on CI), each
    new interpreter the suite starts (some 250 ranks, launchers and examples) compiles the
    repository's source again: compile it once, into the usual (git-ignored) ``__pycache__``
    folders, and remove what this session wrote when it ends. (A cache folder of its own,
    ``PYTHONPYCACHEPREFIX``, would not do: the interpreters would look there for the installed
    packages' bytecode too, and compile torch's.)"""
    if not sys.dont_write_bytecode:
        return
    before = set(_bytecode())
    for folder in COMPILED:
        compileall.compile_dir(ROOT / folder, quiet=1)
    config.stash[_WRITTEN] = sorted(set(_bytecode()) - before)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the bytecode this session wrote (and the folders it left empty)."""
    for path in config.stash.get(_WRITTEN, []):
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when empty


def _bytecode() -> Iterator[Path]:
    """The bytecode files beside the repository's source."""
    for folder in COMPILED:
        yield from (ROOT / folder).rglob("__pycache__/*.pyc")


_WRITTEN = pytest.StashKey[list]()


@pytest.fixture(scope="session", autouse=True)
def _session_worlds_shared_by_the_workers(
    pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Under pytest-xdist, each session world runs once for all the workers: in a folder of
    the run's base temporary folder, which the workers' own folders are in."""
    if hasattr(pytestconfig, "workerinput"):
        SESSION.share_through(tmp_path_factory.getbasetemp().parent / "session-worlds")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process that is no rank of any world: the variables ``unicoll.init`` reads unset, and
    unicoll finalized afterwards."""
    for name in (
        "UNICOLL_BACKEND",
        "UNICOLL_TIMEOUT",
        "UNICOLL_CHECK",
        "UNICOLL_HANDSHAKE",
        "UNICOLL_VERIFY",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    uc.finalize()
