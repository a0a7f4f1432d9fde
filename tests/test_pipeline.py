"""Pipelined equals unpipelined: the foundation's correctness number.

Losses are compared under AdamW and parameters under SGD: AdamW divides each update by the
root of its second moment, so a last-bit difference in a near-zero gradient (summation
order differs between 1 and 4 devices) becomes a visible difference in that parameter —
a property of the optimizer, not of the pipeline. Tolerances are f32, rtol 1e-5.
"""

import functools
import json

import numpy as np
import pytest

from h2jax.data import TokenDataset
from h2jax.plan import plan_from_dict
from h2jax.runtime.train import run

STEPS = 3
SIX_LAYERS = {"vocab_size": 256, "d_model": 64, "n_layers": 6, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128}
OPTIMIZERS = {
    # clip_norm well below the gradient norm (~0.7 here), so clipping is active every step
    "sgd": {"name": "sgd", "learning_rate": 0.5, "clip_norm": 0.3},
    "adamw": {"name": "adamw", "learning_rate": 0.01, "weight_decay": 0.1, "clip_norm": 0.3},
}


def stage(data, tensor, layers, recompute="none"):
    return {"chip": "cpu", "mesh": {"data": data, "tensor": tensor}, "layers": layers, "recompute": recompute}


CASES = {
    "one-stage": ("tiny", [stage(1, 1, [0, 4])]),
    "two-stage-d2t1-d1t2": ("tiny", [stage(2, 1, [0, 2]), stage(1, 2, [2, 4])]),
    "two-stage-recompute-full": ("tiny", [stage(1, 2, [0, 3], "full"), stage(2, 1, [3, 4], "full")]),
    "four-stage-uneven": (
        SIX_LAYERS,
        [stage(1, 1, [0, 1]), stage(2, 1, [1, 3], "selective"), stage(1, 2, [3, 4], "full"), stage(2, 1, [4, 6])],
    ),
}
# Interleaved 1F1B (virtual_stages 2): each stage holds two layer chunks; chunk c of stage i
# is virtual stage c * n_stages + i. Meshes data 2 / tensor 2 / mixed, recompute off, full
# and selective.
EIGHT_LAYERS = {**SIX_LAYERS, "n_layers": 8}
INTERLEAVED_CASES = {
    "two-stage-interleaved-d2t1-d1t2": ("tiny", [stage(2, 1, [[0, 1], [2, 3]]), stage(1, 2, [[1, 2], [3, 4]])]),
    "two-stage-interleaved-recompute-full": (
        "tiny", [stage(1, 2, [[0, 1], [2, 3]], "full"), stage(2, 1, [[1, 2], [3, 4]], "full")]),
    "four-stage-interleaved-mixed": (
        EIGHT_LAYERS,
        [stage(1, 1, [[0, 1], [4, 5]]), stage(2, 1, [[1, 2], [5, 6]], "selective"),
         stage(1, 2, [[2, 3], [6, 7]], "full"), stage(2, 1, [[3, 4], [7, 8]])],
    ),
    # Empty chunks, as the planner makes when a stage has fewer layers than chunks: the
    # embedding alone ([0, 0] of stage 0), nothing at all ([4, 4] before the last chunk), the
    # head alone ([4, 4], the last chunk).
    "two-stage-interleaved-empty-chunks": (
        "tiny", [stage(2, 1, [[0, 0], [1, 2], [4, 4]]), stage(1, 2, [[0, 1], [2, 4], [4, 4]], "full")]),
}


def make_plan(model, stages, schedule, optimizer):
    chunked = isinstance(stages[0]["layers"][0], list)  # interleaved: a list of chunks per stage
    return plan_from_dict({
        "format_version": 1, "model": model, "seq_len": 16, "global_batch": 8, "micro_batch": 2,
        "schedule": schedule, "seed": 0, "stages": stages,
        **({"virtual_stages": len(stages[0]["layers"])} if chunked else {}),
        "optimizer": OPTIMIZERS[optimizer] if isinstance(optimizer, str) else optimizer,
    })


@functools.lru_cache(maxsize=None)
def reference(model_json, optimizer, token_path):
    model = json.loads(model_json)
    plan = make_plan(model, [stage(1, 1, [0, plan_layers(model)])], "1f1b", optimizer)
    return run(plan, STEPS, dataset=TokenDataset(token_path, 16), unpipelined=True, return_params=True)


def plan_layers(model):
    return 4 if model == "tiny" else model["n_layers"]


# Parameters under SGD for every case and schedule; AdamW losses on the 4-stage case, which
# holds every stage kind (first, middle, last; each recompute policy; tensor and data > 1).
# Every schedule the runtime executes (ZB-H1's split backward included) on every case, with
# SGD, whose update exposes any gradient difference. AdamW once per schedule family: the
# update runs after the schedule has accumulated the gradients SGD already checked.
SCHEDULES = ("1f1b", "gpipe", "zb-h1")
RUNS = [(case, schedule, "sgd") for case in CASES for schedule in SCHEDULES] + [
    ("four-stage-uneven", "zb-h1", "adamw")
] + [(case, "interleaved-1f1b", "sgd") for case in INTERLEAVED_CASES] + [
    (case, "interleaved-1f1b", "adamw") for case in ("two-stage-interleaved-d2t1-d1t2", "four-stage-interleaved-mixed")
]


@pytest.mark.parametrize("case, schedule, optimizer", RUNS)
def test_pipelined_equals_unpipelined(case, schedule, optimizer, token_file):
    model, stages = {**CASES, **INTERLEAVED_CASES}[case]
    plan = make_plan(model, stages, schedule, optimizer)
    got = run(plan, STEPS, dataset=TokenDataset(token_file, 16), return_params=True)
    want = reference(json.dumps(model), optimizer, str(token_file))

    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose(got.grad_norms, want.grad_norms, rtol=1e-5)
    assert min(got.grad_norms) > OPTIMIZERS[optimizer]["clip_norm"]  # clipping was active
    assert len(set(np.round(got.losses, 6))) == STEPS  # the parameters moved
    if optimizer == "sgd":
        assert got.params.keys() == want.params.keys()
        for name in want.params:
            np.testing.assert_allclose(got.params[name], want.params[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("zero1", [True, False])
def test_optimizer_state_is_split_over_data_under_zero1(zero1):
    """ZeRO-1 (plan.optimizer.shard_over_data): a data=2 stage's AdamW moments are split over
    `data`, its parameters are not; each device holds half of every split moment."""
    import jax

    from h2jax.runtime.devices import assign_devices
    from h2jax.runtime.stage import StageExecutor

    plan = make_plan("tiny", [stage(2, 1, [0, 4])], "1f1b", {**OPTIMIZERS["adamw"], "shard_over_data": zero1})
    ex = StageExecutor(plan, 0, assign_devices(plan)[0])
    moments = [x for x in jax.tree.leaves(ex.opt_state) if x.ndim >= 1]
    params = jax.tree.leaves(ex.params)
    assert all("data" not in str(p.sharding.spec) for p in params)
    split = [x for x in moments if "data" in str(x.sharding.spec)]
    if zero1:
        assert len(split) == len(moments)  # every moment of the tiny model has an even dimension
        x = split[0]
        assert x.addressable_shards[0].data.size * 2 == x.size
    else:
        assert not split


def _compute_order(events, stage):
    """A stage's computes in the order they ran, the last stage's fused F+B split in two."""
    names = [e.name for e in sorted((e for e in events if e.stage == stage and e.lane == "compute"
                                     and e.name not in ("optimizer", "dp reduce")), key=lambda e: e.start_s)]
    return [part for n in names for part in n.split("+")]


def _action(name):
    """'F3' -> Action(F, 3); 'B2c1' (chunk 1 under interleaved 1F1B) -> Action(B, 2, 1)."""
    from h2jax import schedules

    micro, _, chunk = name[1:].partition("c")
    return schedules.Action(name[0], int(micro), int(chunk or 0))


@pytest.mark.parametrize("schedule", SCHEDULES + ("interleaved-1f1b",))
def test_measured_action_order_is_the_simulated_one(schedule, token_file, tmp_path):
    """Each stage runs its computes in the order the simulator replays (the registry's list),
    and the activations it holds at its peak are the registry's rule (interleaved 1F1B: per
    (micro-batch, chunk), on the 4-stage plan with two chunks per stage)."""
    from h2jax import schedules
    from h2jax.planner import cost_model
    from h2jax.sim import simulate
    from h2jax.trace import read_trace

    model, stages = INTERLEAVED_CASES["four-stage-interleaved-mixed"] if schedule == "interleaved-1f1b" else (
        CASES["four-stage-uneven"])
    plan = make_plan(model, stages, schedule, "sgd")
    p, m, v = plan.n_stages, plan.n_micro, plan.virtual_stages
    path = tmp_path / "run.json"
    run(plan, 1, dataset=TokenDataset(token_file, 16), trace=str(path))
    measured = read_trace(path)
    costs = cost_model.stage_costs(plan, None)
    simulated = simulate(costs, m, schedule, virtual_stages=v, record=True).events
    rule = schedules.get_schedule(schedule)
    for i in range(p):
        order = _compute_order(measured, i)
        assert order == _compute_order(simulated, i)
        ran = [_action(name) for name in order]
        assert [(a.kind, a.micro, a.chunk) for a in ran] == rule.order(i, p, m, v)
        assert schedules.max_in_flight(ran) == rule.in_flight(i, p, m, v)
        assert schedules.max_deferred(ran) == rule.deferred(i, p, m, v)


def test_interleaved_checkpoint_holds_every_chunk(token_file, tmp_path):
    """A checkpoint of an interleaved run (written per global layer) holds every chunk of
    every stage: a one-stage plan of the same model restores exactly its parameters and AdamW
    state, and one more step on each gives the same loss; restored back onto the interleaved
    plan, the parameters are the same again."""
    from h2jax.runtime.train import Trainer

    model, stages = INTERLEAVED_CASES["two-stage-interleaved-d2t1-d1t2"]
    data = TokenDataset(token_file, 16)
    interleaved = Trainer(make_plan(model, stages, "interleaved-1f1b", "adamw"), steps=4)
    for k in range(2):
        interleaved.step(data.batch(k, 8))
    interleaved.save(tmp_path / "ckpt")
    single = Trainer(make_plan(model, [stage(1, 1, [0, 4])], "1f1b", "adamw"), steps=4)
    single.restore(tmp_path / "ckpt")
    got, want = single.parameters(), interleaved.parameters()
    assert sorted({k.split("/")[0] for k in want}) == ["embed", "head"] + [f"layer_{i:03d}" for i in range(4)]
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    loss_single = single.step(data.batch(2, 8)).loss
    loss_interleaved = interleaved.step(data.batch(2, 8)).loss
    np.testing.assert_allclose(loss_interleaved, loss_single, rtol=1e-5)

    again = Trainer(make_plan(model, stages, "interleaved-1f1b", "adamw"), steps=4)
    again.restore(tmp_path / "ckpt")
    restored = again.parameters()
    for name in want:
        np.testing.assert_array_equal(restored[name], want[name], err_msg=name)
