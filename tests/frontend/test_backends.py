"""Backend selection, registration, init/finalize and adoption of torch.distributed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import unicoll as uc
from helpers import cli
from helpers.several import SESSION, Case, share
from unicoll import registry, runtime
from unicoll.backends.torch.gloo import GlooFactory

pytestmark = pytest.mark.usefixtures("clean_env")


def test_selection_order(monkeypatch) -> None:
    assert registry.resolve(None) == registry.resolve("auto")
    monkeypatch.setenv("UNICOLL_BACKEND", "gloo")
    assert registry.resolve(None) == "gloo"
    monkeypatch.setenv("UNICOLL_BACKEND", "no-such")
    assert registry.resolve("gloo") == "gloo"  # explicit beats the environment
    with pytest.raises(
        uc.BackendUnavailableError, match=r"\$UNICOLL_BACKEND: unknown backend 'no-such'.*usable here: gloo"
    ):
        registry.resolve(None)


def test_unknown_backend_lists_the_valid_ones() -> None:
    with pytest.raises(uc.BackendUnavailableError) as info:
        uc.init("ucx")
    message = str(info.value)
    assert "init(backend=...): unknown backend 'ucx'" in message
    for name in ("cupy-nccl", "gloo", "mpi", "torch-nccl"):
        assert name in message
    assert not uc.is_initialized()


def test_auto_picks_gloo_without_cuda() -> None:
    expected = "torch-nccl" if torch.cuda.is_available() else "gloo"
    assert registry.resolve("auto") == expected


def test_registered_backend_is_selectable() -> None:
    registry.register_backend("gloo-twin", GlooFactory())
    try:
        uc.init("gloo-twin")
        assert uc.get_backend() == "gloo"  # the running transport names itself
        assert uc.alltoall_single(None, np.ones((2, 1))).shape == (2, 1)
    finally:
        uc.finalize()
        registry._factories.pop("gloo-twin")


def test_register_backend_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="name: expected a non-empty string other than 'auto'"):
        registry.register_backend("auto", GlooFactory())
    with pytest.raises(TypeError, match=r"factory: expected an object with .capabilities"):
        registry.register_backend("x", object())


def test_info_reports_every_backend() -> None:
    out = cli.info()
    assert "gloo         usable" in out
    for name in ("torch-nccl", "cupy-nccl"):
        line = next(line for line in out.splitlines() if line.strip().startswith(name))
        if not torch.cuda.is_available():
            assert "not usable: " in line
    assert "auto picks: " in out
    libraries = out[out.index("array libraries:") : out.index("backends:")]
    for name in ("numpy", "torch", "cupy", "paddle", "jax"):
        assert f"\n  {name} " in libraries


def test_init_finalize_init() -> None:
    uc.init("gloo", timeout=30)
    assert uc.is_initialized() and uc.get_backend() == "gloo"
    assert (uc.get_rank(), uc.get_world_size()) == (0, 1)
    with pytest.raises(RuntimeError, match="already initialized"):
        uc.init("gloo")
    stale = uc.new_group([0])
    uc.finalize()
    assert not uc.is_initialized() and not dist.is_initialized()
    uc.init("gloo")
    with pytest.raises(ValueError, match="group: expected a group made since the last init()"):
        uc.all_gather(None, np.ones(1), group=stale)
    uc.barrier()


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [({"timeout": -1}, ValueError, r"init: timeout: expected a number of seconds from 0.001 to 1e\+07, got -1$"),
     ({"timeout": float("inf")}, ValueError, r"init: timeout: expected a number of seconds from 0.001 to 1e\+07, got inf$"),
     ({"timeout": float("nan")}, ValueError, r"init: timeout: expected a number of seconds from 0.001 to 1e\+07, got nan$"),
     ({"timeout": 0.0004}, ValueError, r"init: timeout: expected a number of seconds from 0.001 to 1e\+07, got 0.0004$"),
     ({"timeout": "5"}, TypeError, r"init: timeout: expected a number of seconds, got str$"),
     ({"timeout": True}, TypeError, r"init: timeout: expected a number of seconds, got bool$"),
     ({"env": "soon"}, ValueError, r"\$UNICOLL_TIMEOUT: expected a number of seconds, got 'soon'"),
     ({"env": "0"}, ValueError, r"\$UNICOLL_TIMEOUT: expected a number of seconds from 0.001 to 1e\+07, got 0.0"),
     ({"env": "inf"}, ValueError, r"\$UNICOLL_TIMEOUT: expected a number of seconds from 0.001 to 1e\+07, got inf")],
)  # fmt: skip
def test_bad_timeout(setting, error, message, monkeypatch) -> None:
    if "env" in setting:
        monkeypatch.setenv("UNICOLL_TIMEOUT", setting["env"])
    with pytest.raises(error, match=message):
        uc.init("gloo", timeout=setting.get("timeout"))
    assert not uc.is_initialized()


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [({"backend": 3}, TypeError, r"^unicoll.init: backend: expected a backend name \(a str\) or None, got int$"),
     ({"check": 1}, TypeError, r"^unicoll.init: check: expected True, False or None, got 1$"),
     ({"env": "yes"}, ValueError, r"^unicoll.init: \$UNICOLL_CHECK: expected 0 or 1 \(or false or true; empty is 0\), got 'yes'$"),
     ({"env": " 2"}, ValueError, r"got ' 2'$")],
)  # fmt: skip
def test_bad_backend_or_check_setting(setting, error, message, monkeypatch) -> None:
    if "env" in setting:
        monkeypatch.setenv("UNICOLL_CHECK", setting["env"])
    with pytest.raises(error, match=message):
        uc.init(setting.get("backend", "gloo"), check=setting.get("check"))
    assert not uc.is_initialized()


@pytest.mark.parametrize(
    ("value", "checking"), [("1", True), ("TRUE", True), (" true ", True), ("0", False), ("false", False), ("", False)]
)
def test_check_setting_from_the_environment(value, checking, monkeypatch) -> None:
    """Every value the error message names is accepted, and means what it says."""
    monkeypatch.setenv("UNICOLL_CHECK", value)
    uc.init("gloo")
    assert runtime.state("test").check is checking


def test_bad_rank_environment(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"\$RANK: expected 0 <= RANK < WORLD_SIZE \(2\), got 2"):
        uc.init("gloo")


def test_adopts_an_existing_default_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        uc.init("gloo")
        assert uc.all_gather(None, np.arange(3)).tolist() == [0, 1, 2]
        ours = uc.new_group([0]).handle
        assert ours in dist.distributed_c10d._world.pg_map
        uc.finalize()
        assert dist.is_initialized(), "finalize must leave a group it did not create"
        assert ours not in dist.distributed_c10d._world.pg_map, "finalize must release the groups it made"
    finally:
        dist.destroy_process_group()


def mixes_with_raw_torch(rank: int) -> list[float]:
    """unicoll created the default group, so raw torch.distributed calls work beside it."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return [t.item(), *uc.all_gather(None, t).tolist()]


def test_raw_torch_distributed_beside_unicoll() -> None:
    assert SESSION.results(RAW_TORCH, "backends: raw torch beside") == [[3.0, 3.0, 3.0]] * 2


def test_ranks_and_groups_in_a_world() -> None:
    assert SESSION.results(GROUP_FACTS, "backends: group facts") == [
        (0, 3, None, None),
        (1, 3, 0, 2),
        (2, 3, 1, 2),
    ]


def _group_facts(rank: int):
    group = uc.new_group([2, 1])
    assert group.ranks == (1, 2)
    if not group.is_member:
        return (uc.get_rank(), uc.get_world_size(), None, None)
    uc.barrier(group)
    return (uc.get_rank(), uc.get_world_size(), uc.get_rank(group), uc.get_world_size(group))


# In the session's shared gloo worlds (helpers/several.py).
RAW_TORCH = share("gloo", 2, [Case("backends: raw torch beside", mixes_with_raw_torch)])
GROUP_FACTS = share("gloo", 3, [Case("backends: group facts", _group_facts)])


def test_new_group_rejects_bad_ranks() -> None:
    uc.init("gloo")
    for ranks, message in (
        ([], "non-empty list of world ranks in \\[0, 1\\)"),
        ([3], "got \\[3\\]"),
        ("0", "sequence of ints"),
    ):
        with pytest.raises((ValueError, TypeError), match=message):
            uc.new_group(ranks)
