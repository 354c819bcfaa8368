"""Paddle's own MoELayer (paddle.incubate.distributed.models.moe) on CPUs through
unicoll.paddle_moe.routed(), on 2 ranks of gloo and mpi, with each of its gates (naive top-2;
GShard top-2 with its capacity and random routing, made to drop slots; Switch top-1): the
layer's output and the gradients of its input, its gate and its experts equal a dense
computation of the same routing on one process (every expert on every rank, no transfer).
And the five MoE kernels Paddle runs only on GPUs, computed for CPU tensors, against the
examples Paddle documents them with."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import unicoll as uc
from helpers.cpu_backends import BACKENDS, MPI_REASON
from helpers.several import SESSION, Case, share

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("paddle") is None, reason="paddle is not installed (pip install 'unicoll[paddle]')"
)
"""(Paddle is imported by the ranks and inside the tests: this process stays free of it at
collection.)"""

GATES = {"naive": 2, "gshard": 2, "switch": 1}
"""Each gate type the layer builds from its config, and its top_k."""

EXPERTS, HIDDEN, TOKENS = 2, 4, 16
TOLERANCE = 1e-5
"""float32: Paddle's gates need it, and the layer gathers its rows through float32 anyway."""


def _expert(paddle):
    class Expert(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = paddle.nn.Linear(HIDDEN, 2 * HIDDEN), paddle.nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x):
            return self.down(paddle.tanh(self.up(x)))

    return Expert


def _one_gate(rank: int, gate_type: str) -> tuple[list[int], int]:
    """Paddle's layer with ``gate_type`` on this rank's tokens, checked against the dense
    computation of the routing its gate chose; returns the kept slots per expert over the
    ranks and this rank's dropped slots."""
    import paddle
    from paddle.incubate.distributed.models.moe import MoELayer

    import unicoll.paddle_moe as upm

    world, k = uc.get_world_size(), GATES[gate_type]
    total = EXPERTS * world
    Expert = _expert(paddle)
    paddle.seed(0)
    experts = [Expert() for _ in range(total)]  # every rank builds every expert, keeps its own
    paddle.seed(0)
    dense = [Expert() for _ in range(total)]
    mine = slice(rank * EXPERTS, (rank + 1) * EXPERTS)
    with upm.routed():
        layer = MoELayer(HIDDEN, paddle.nn.LayerList(experts[mine]), gate={"type": gate_type, "top_k": k},
                         moe_group=upm.MoEGroup())  # fmt: skip
        if gate_type == "gshard":  # most tokens pick expert 0: its capacity drops slots
            layer.gate.gate.bias.set_value(paddle.to_tensor([3.0] + [0.0] * (total - 1), dtype="float32"))
        if gate_type == "switch":
            layer.eval()  # no noise on the scores: the dense gate computes them again
        chosen = {}
        gate_forward = layer.gate.forward

        def recording(x):
            value, idx = gate_forward(x)
            chosen["idx"] = idx.numpy().reshape(-1, k)
            return value, idx

        layer.gate.forward = recording
        paddle.seed(10 + rank)
        x = paddle.randn([1, TOKENS, HIDDEN])
        x.stop_gradient = False
        weights = paddle.randn([TOKENS, HIDDEN])
        out = layer(x * 1.0)  # the layer reshapes its input in place: not a leaf
        (out.reshape([TOKENS, HIDDEN]) * weights).sum().backward()

    gate = paddle.nn.Linear(HIDDEN, total)
    gate.weight.set_value(layer.gate.gate.weight)
    gate.bias.set_value(layer.gate.gate.bias)
    xd = paddle.to_tensor(x.numpy().reshape(TOKENS, HIDDEN))
    xd.stop_gradient = False
    scores = gate(xd)
    if gate_type == "switch":
        scores = paddle.nn.functional.softmax(scores, axis=-1)
    value = paddle.topk(scores, k=k, axis=-1, largest=True, sorted=False)[0]
    idx = chosen["idx"]
    outputs = [expert(xd) for expert in dense]
    expected = paddle.zeros([TOKENS, HIDDEN])
    for j in range(k):
        for e in range(total):
            picked = paddle.to_tensor((idx[:, j] == e).astype("float32").reshape(-1, 1))
            expected = expected + value[:, j : j + 1] * picked * outputs[e]
    (expected * weights).sum().backward()

    def close(actual, wanted, what):
        np.testing.assert_allclose(actual, wanted, rtol=TOLERANCE, atol=TOLERANCE, err_msg=f"{gate_type}: {what}")

    close(out.numpy().reshape(TOKENS, HIDDEN), expected.numpy(), "output")
    close(x.grad.numpy().reshape(TOKENS, HIDDEN), xd.grad.numpy(), "input gradient")
    close(layer.gate.gate.weight.grad.numpy(), gate.weight.grad.numpy(), "gate gradient")

    def grads(modules):
        return [
            np.zeros(p.shape, "float32") if p.grad is None else p.grad.numpy() for m in modules for p in m.parameters()
        ]

    summed = [uc.all_reduce(g) for g in grads(dense)]  # each rank's tokens' part, over the ranks
    per_expert = len(summed) // total
    for got, wanted in zip(grads(experts[mine]), summed[mine.start * per_expert : mine.stop * per_expert]):
        close(got, wanted, "expert gradient")
    kept = uc.all_reduce(np.bincount(idx[idx >= 0], minlength=total))
    return kept.tolist(), int((idx < 0).sum())


def _layer(rank: int) -> dict:
    return {gate_type: _one_gate(rank, gate_type) for gate_type in GATES}


LAYERS = {
    backend: share(backend, 2, [Case("paddle_moe: layer", _layer)])
    for backend in ("gloo", "mpi")
    if backend == "gloo" or MPI_REASON is None
}
"""The layer runs in the session's shared worlds of 2 (helpers/several.py): a world fewer on each backend."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_paddle_moe_layer_equals_dense(backend):
    results = SESSION.results(LAYERS[backend], "paddle_moe: layer")
    for gate_type, (kept, _) in results[0].items():
        assert all(r[gate_type][0] == kept for r in results), gate_type  # the ranks agree on the counts
    kept, _ = results[0]["gshard"]
    capacity = int(np.ceil(1.2 * TOKENS))  # GShard's training capacity: 1.2 per token of a rank
    assert kept[0] == capacity and max(kept) <= capacity
    assert sum(r["gshard"][1] for r in results) > 0  # slots were dropped
    assert sum(results[0]["naive"][0]) == 2 * 2 * TOKENS and sum(results[0]["switch"][0]) == 2 * TOKENS


def test_kernels_match_paddles_documented_examples():
    import unicoll.paddle_moe as upm

    numbers = np.array([[0, 2], [0, 2]])
    assert upm.number_count(numbers, 6).tolist() == [2, 0, 2, 0, 0, 0]
    assert upm.assign_pos(numbers, np.cumsum([2, 0, 2, 0])).tolist() == [2, 0, 3, 1]
    assert upm.limit_by_capacity(np.array([1, 2, 2, 8, 3, 6]), np.array([5, 5, 5]), 2).tolist() == [1, 2, 2, 4, 3, 3]
    gate = np.array([1, 3, 3, 3, 3, 2, 1, 1])
    pruned = upm.prune_gate_by_capacity(gate, np.array([0, 3, 1, 3, 0, 0, 0, 0]))
    assert pruned.tolist() == [1, 3, 3, 3, -1, 2, 1, 1]
    routed = upm.random_routing(np.array([[0, 1], [2, 3]]), np.array([[0.6, 0.4], [0.9, 0.1]]), np.array([0.5, 0.5]))
    assert routed.tolist() == [[0, 1], [2, -1]]  # 2 * 0.4 >= 0.5 keeps; 2 * 0.1 < 0.5 drops


def test_kernels_skip_dropped_slots_and_bad_counts():
    import unicoll.paddle_moe as upm

    numbers = np.array([[1, -1], [1, 0]])
    assert upm.number_count(numbers, 3).tolist() == [1, 2, 0]
    assert upm.assign_pos(numbers, np.cumsum([1, 2, 0])).tolist() == [3, 2, 0]
    assert upm.prune_gate_by_capacity(numbers, np.array([1, 1, 0])).tolist() == [[1, -1], [-1, 0]]
    with pytest.raises(
        ValueError, match=r"assign_pos: cum_count: expected a last entry of 3 \(the kept slots\), got 4"
    ):
        upm.assign_pos(numbers, np.cumsum([1, 3, 0]))


def _gathers(rank: int) -> tuple:
    import paddle
    import paddle.incubate.distributed.models.moe.moe_layer as moe_layer

    import unicoll.paddle_moe as upm

    rows, pos = paddle.to_tensor([[1.0, 2.0], [10.0, 20.0]]), paddle.to_tensor([0, 0])
    paddles = moe_layer._local_gather
    before = paddles(rows, pos, 1).numpy().tolist()
    with upm.routed():
        routed = moe_layer._local_gather(rows, pos, 1).numpy().tolist()
        try:
            moe_layer.global_scatter(rows, pos, pos, group=object())
            refusal = None
        except TypeError as error:
            refusal = str(error)
    return before, routed, refusal, moe_layer._local_gather is paddles


def test_routed_restores_paddle_and_sums_what_paddle_overwrites():
    """Paddle's own local gather keeps one of two rows sent to one place, which is how its
    layer loses all but one slot's input gradient for top_k > 1; the routed one sums them.
    A Paddle group is refused by name; leaving routed() gives Paddle its own names back."""
    [(before, routed, refusal, restored)] = uc.testing.spawn(_gathers, 1, backend="gloo", timeout=60)
    assert before in ([[1.0, 2.0]], [[10.0, 20.0]])
    assert routed == [[11.0, 22.0]]
    assert refusal.startswith("global_scatter: group: expected None, a unicoll.paddle_moe.MoEGroup or a unicoll Group")
    assert refusal.endswith("got object")
    assert restored
