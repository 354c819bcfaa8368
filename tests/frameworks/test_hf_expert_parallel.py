"""Hugging Face MoE models made expert-parallel by unicoll.nn.expert_parallel on 2 ranks of gloo:
each rank trains on its own batch, and the logits, the gradients and every parameter
after three AdamW steps equal the single-process model's trained on the union of the batches
(float64, transformers' eager experts code), in the dynamic mode (the replicated gradients
summed while backward runs, by unicoll.nn.GradientReducer) and the static mode (summed after
it), for Mixtral, Qwen2-MoE (a shared expert), DeepSeek-V3 (a dense first layer, a shared
expert, a group-limited router), Qwen3-MoE and OLMoE. In bfloat16, ExpertParallel's
rounding="model" is bit-equal to the model's own experts code (eager and batched_mm). The
dynamic mode compiled, with a rank whose experts get no rows, equals eager; a whole Mixtral
compiled with ``fullgraph=True`` in the static mode is bit-equal to eager with one compile
over three batches. On mpi, Mixtral trains in the dynamic mode, its replicated gradients
summed by mpi while backward runs (examples/expert_parallel_hf.py trains it on mpi in the static
mode: tests/system/test_train_moe.py). Skipped where transformers is not installed."""

from __future__ import annotations

import copy
import importlib.metadata

import pytest


def _transformers_5() -> bool:
    """Whether transformers 5 or later is installed (read from its metadata: the ranks import
    it, this process need not)."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0]) >= 5
    except importlib.metadata.PackageNotFoundError:
        return False


if not _transformers_5():  # before the module adds its case to the shared mpi world
    pytest.skip("transformers 5 is not installed (pip install 'unicoll[hf]')", allow_module_level=True)

import torch  # noqa: E402

import unicoll as uc  # noqa: E402
from helpers.cpu_backends import MPI_REASON  # noqa: E402
from helpers.hf_models import MODELS, VOCAB, tiny  # noqa: E402
from helpers.several import SESSION, Case, share  # noqa: E402

STEPS = 3
CASES = [(name, static) for name in MODELS for static in (False, True)]
TOLERANCE = {"deepseek_v3": 1e-6}
"""DeepSeek-V3's router computes in float32 whatever the model's dtype: its weight's gradient,
summed over each rank's tokens and then over the ranks, rounds otherwise than summed over the
union (about 7e-11 after one step, the logits still equal), and AdamW's normalisation carries
that into the parameters (about 5e-8 after three). The others agree to float64's rounding."""


def _train(rank: int, name: str, static: bool) -> dict:
    """This rank's expert-parallel model and the single-process one, trained side by side:
    the largest differences of the logits, the gradients and the parameters over the steps."""
    import unicoll.nn as unn

    world = uc.get_world_size()
    model = tiny(name)
    single = copy.deepcopy(model)
    unn.expert_parallel(model, static=static, capacity_factor=4.0)  # no slot dropped
    local = next(m for m in model.modules() if isinstance(m, unn.ExpertParallel)).experts_per_rank
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, single)]
    # the dynamic mode sums the replicated gradients while backward runs, between the MoE blocks'
    # own backward collectives; the static mode after it
    reducer = None if static else unn.GradientReducer(unn.replicated_parameters(model), bucket_mib=0.01)
    generator = torch.Generator().manual_seed(1)
    worst = {"logits": 0.0, "grads": 0.0, "params": 0.0}
    references = dict(single.named_parameters())
    for _ in range(STEPS):
        batches = [torch.randint(0, VOCAB, (2, 8), generator=generator) for _ in range(world)]
        for optimizer in optimizers:
            optimizer.zero_grad()
        out = model(batches[rank], labels=batches[rank])
        (out.loss / world).backward()  # every rank's tokens weigh alike: the mean over the union
        if reducer is None:
            unn.all_reduce_gradients(unn.replicated_parameters(model))
        else:
            reducer.finish()
        whole = single(torch.cat(batches), labels=torch.cat(batches))
        whole.loss.backward()
        mine = slice(2 * rank, 2 * rank + 2)
        worst["logits"] = max(worst["logits"], (out.logits - whole.logits[mine]).abs().max().item())
        pairs = []
        for key, p in model.named_parameters():
            ref = references[key.replace("experts.experts.", "experts.")]
            shard = slice(rank * local, (rank + 1) * local) if p.shape != ref.shape else slice(None)
            pairs.append((p, ref, shard))
        worst["grads"] = max(worst["grads"], max((p.grad - r.grad[s]).abs().max().item() for p, r, s in pairs))
        for optimizer in optimizers:
            optimizer.step()
        worst["params"] = max(worst["params"], max((p - r[s]).abs().max().item() for p, r, s in pairs))
    return worst


def _compiled(rank: int) -> tuple[float, int]:
    """A whole Mixtral made expert-parallel in the static mode (transformers' batched_mm
    experts), compiled with ``fullgraph=True`` and static shapes, against the same model eager,
    three batches: the largest difference of the logits and gradients, and the compiles."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import unicoll.nn as unn

    model = tiny("mixtral")
    model.config._experts_implementation = "batched_mm"  # eager's loop over the experts present reads the host
    eager = copy.deepcopy(model)
    for m in (model, eager):
        unn.expert_parallel(m, static=True, capacity=16)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=counter)
    generator, worst = torch.Generator().manual_seed(rank), 0.0
    for _ in range(3):
        batch = torch.randint(0, VOCAB, (2, 8), generator=generator)
        out, ref = compiled(batch, labels=batch), eager(batch, labels=batch)
        out.loss.backward()
        ref.loss.backward()
        grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), eager.parameters()))
        worst = max(worst, (out.logits - ref.logits).abs().max().item(), grads)
        model.zero_grad()
        eager.zero_grad()
    return worst, counter.frame_count


ROUNDED = [("qwen2_moe", "eager", False), ("qwen2_moe", "batched_mm", True), ("mixtral", "eager", True)]
"""(model, transformers' experts implementation, static): Qwen2-MoE's weights are bfloat16, so
each product rounds; Mixtral's are float32, so only the eager code's order of additions tells."""


def _rounded(rank: int, name: str, implementation: str, static: bool) -> dict[str, float]:
    """The share of a bfloat16 top-4 model's logits that differ from the single process's on
    this rank's batch, with ExpertParallel's rounding "combine" and "model"."""
    import unicoll.nn as unn

    differ = {}
    for rounding in ("combine", "model"):
        model = tiny(name, experts=8, topk=4).to(torch.bfloat16)
        model.config._experts_implementation = implementation
        single = copy.deepcopy(model)
        unn.expert_parallel(model, static=static, capacity_factor=8.0, rounding=rounding)  # no slot dropped
        batch = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            differ[rounding] = (model(batch).logits != single(batch).logits).float().mean().item()
    return differ


def _dynamic_compiled(rank: int) -> list[float]:
    """ExpertParallel around a Mixtral block's experts (transformers' eager code, which skips
    experts without rows) in the dynamic mode, compiled (graph breaks at the experts' loop),
    every slot routed to rank 0's experts so that rank 1's get no rows: result and gradients of
    the hidden states and the weights against the same module eager."""
    import unicoll.nn as unn

    ep = unn.ExpertParallel(unn.sharded_experts(tiny("mixtral").model.layers[0].mlp.experts))
    ids = torch.tensor([[0, 1]] * 6)
    results = []
    for step in (torch.compile(ep, backend="aot_eager"), ep):
        x = torch.randn(6, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        w = torch.full((6, 2), 0.5, dtype=torch.float64, requires_grad=True)
        out = step(x, ids, w)
        out.square().sum().backward()
        results.append((out.detach(), x.grad, w.grad))
    return [(a - b).abs().max().item() for a, b in zip(*results)]


def _world(rank: int) -> dict:
    return {"compiled": _compiled(rank), "dynamic compiled": _dynamic_compiled(rank),
            **{case: _train(rank, *case) for case in CASES},
            **{case: _rounded(rank, *case) for case in ROUNDED}}  # fmt: skip


ON_MPI = share("mpi", 2, [Case("hf: mixtral", _train, ("mixtral", False))], timeout=120)
"""mpi's case, in the session's shared MPI world of 2 ranks (helpers/several.py): the models'
code reaches a backend only through ExpertParallel's dispatch and combine and the reducer's
all-reduces, the same eager calls on every backend, so one model in the dynamic mode (whose
all-reduces run while backward runs) proves them on mpi; the other models, the rounding and
the compiled cases run on gloo."""


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    """gloo's world: every model in both modes, the rounding and the compiled cases."""
    return uc.testing.spawn(_world, 2, backend="gloo", timeout=240)


def test_the_dynamic_mode_compiled_with_a_rank_without_rows_equals_eager(reports) -> None:
    for report in reports:
        assert max(report["dynamic compiled"]) < 1e-12, report["dynamic compiled"]


@pytest.mark.parametrize("case", ROUNDED)
def test_the_model_s_rounding_is_bit_equal_in_bfloat16(reports, case) -> None:
    for report in reports:
        assert report[case]["model"] == 0.0
        assert report[case]["combine"] > 0.01  # combine's one rounding is not the model's here


@pytest.mark.parametrize(("name", "static"), CASES)
def test_expert_parallel_training_equals_the_single_process(reports, name: str, static: bool) -> None:
    for report in reports:
        worst = report[name, static]
        assert max(worst.values()) < TOLERANCE.get(name, 1e-12), worst


def test_a_whole_model_compiles_with_fullgraph_in_the_static_mode_once_equal_to_eager(reports) -> None:
    assert [report["compiled"] for report in reports] == [(0.0, 1)] * 2


@pytest.mark.skipif(MPI_REASON is not None, reason=f"mpi: {MPI_REASON}")
def test_training_on_mpi_equals_the_single_process() -> None:
    for worst in SESSION.results(ON_MPI, "hf: mixtral"):
        assert max(worst.values()) < 1e-12, worst
