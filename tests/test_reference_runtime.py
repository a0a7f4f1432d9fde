"""Runtime figures checked against references that share no code with them.

- gradient clipping against optax.clip_by_global_norm (the pipelined run and the unpipelined
  reference both call h2jax.runtime.optim.clip, so comparing them cannot catch a bug in it);
- the memory check's persistent figure against the bytes of the arrays a stage allocated;
- an emulated chip's busy time against slowdown x its measured compute (CPU seconds of the
  worker threads per device: not dispatch, waiting or shared cores), on an injected clock;
- the profiler: the stage it times holds one layer, on a model where two would also be a
  valid stage, and its figures are the (injected) clock's, stretched by the chip's slowdown.

No test here reads the wall clock: the clocks are fakes that advance only when told to.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from h2jax.cluster import load_chip
from h2jax.config import PRESETS
from h2jax.plan import plan_from_dict
from h2jax.runtime import emulation
from h2jax.runtime.optim import apply_clipped_update, clip, squared_norm
from h2jax.transport.base import ACT, Tag

# ------------------------------------------------------------------------------ clipping


def grads_tree(scale: float) -> dict:
    rng = np.random.default_rng(0)
    return {
        "a": jnp.asarray(rng.normal(0, scale, (3, 4)), jnp.float32),
        "b": {"c": jnp.asarray(rng.normal(0, scale, (5,)), jnp.float32),
              "d": jnp.asarray(rng.normal(0, scale, (2, 2, 2)), jnp.float32)},
    }


def optax_clipped(grads, max_norm):
    tx = optax.clip_by_global_norm(max_norm)
    clipped, _ = tx.update(grads, tx.init(grads))
    return clipped


@pytest.mark.parametrize("scale", [0.01, 0.3, 5.0])
@pytest.mark.parametrize("max_norm", [0.5, 1.0])
def test_clip_equals_optax_clip_by_global_norm(scale, max_norm):
    grads = grads_tree(scale)
    norm = optax.tree.norm(grads)
    assert float(jnp.sqrt(squared_norm(grads))) == pytest.approx(float(norm), rel=1e-6)
    got, want = clip(grads, norm, max_norm), optax_clipped(grads, max_norm)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    clipped_norm = float(optax.tree.norm(got))
    assert clipped_norm == pytest.approx(min(float(norm), max_norm), rel=1e-5)


def test_clip_uses_the_norm_over_all_stages():
    """Two 'stages' each hold part of the gradient; each clips by the global norm (the square
    root of the stages' summed squared norms), as optax clips the whole tree."""
    grads = grads_tree(0.4)
    stage0, stage1 = {"a": grads["a"]}, {"b": grads["b"]}
    global_norm = jnp.sqrt(squared_norm(stage0) + squared_norm(stage1))
    want = optax_clipped(grads, 0.7)
    np.testing.assert_allclose(np.asarray(clip(stage0, global_norm, 0.7)["a"]), np.asarray(want["a"]), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(clip(stage1, global_norm, 0.7)), jax.tree.leaves(want["b"])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_clip_norm_none_leaves_gradients_alone():
    grads = grads_tree(5.0)
    assert clip(grads, optax.tree.norm(grads), None) is grads


def test_clipped_sgd_update_equals_optax_chain():
    """One update through apply_clipped_update equals optax's own clip-then-SGD chain."""
    grads, params = grads_tree(2.0), jax.tree.map(lambda g: jnp.ones_like(g), grads_tree(1.0))
    tx = optax.sgd(0.1)
    new, _ = apply_clipped_update(tx, params, tx.init(params), grads, optax.tree.norm(grads), 0.8)
    chain = optax.chain(optax.clip_by_global_norm(0.8), optax.sgd(0.1))
    updates, _ = chain.update(grads, chain.init(params), params)
    want = optax.apply_updates(params, updates)
    for g, w in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


# ------------------------------------------------------------------------------ memory check


def per_device_array_bytes(tree, device) -> int:
    """Bytes of the shards of `tree`'s arrays that live on `device`."""
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


@pytest.mark.parametrize("shard_over_data", [True, False])
def test_memory_check_counts_params_grads_and_optimizer_state(shard_over_data):
    """persistent_bytes equals what one device really holds: parameters, f32 gradient
    accumulators (one per data rank: a leading axis split over data) and AdamW's two moments
    (split over data under ZeRO-1); at the update the step's reduced gradients (the moments'
    layout) take the accumulators' place."""
    from h2jax.runtime.stage import StageExecutor

    plan = plan_from_dict({
        "format_version": 1, "model": "tiny", "seq_len": 16, "global_batch": 8, "micro_batch": 2,
        "optimizer": {"name": "adamw", "learning_rate": 0.01, "shard_over_data": shard_over_data},
        "stages": [{"chip": "cpu", "mesh": {"data": 2, "tensor": 2}, "layers": [0, 2]},
                   {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4]}],
    })
    ex = StageExecutor(plan, 0, jax.devices()[:4])
    device = ex.mesh.devices.flat[0]
    params = per_device_array_bytes(ex.params, device)
    grads = per_device_array_bytes(ex.grad_acc, device)
    opt = per_device_array_bytes(ex.opt_state, device)
    # AdamW keeps two f32 moments per parameter (plus a step count): about twice the
    # parameters, halved over data=2 under ZeRO-1.
    moments = 2 * params // (2 if shard_over_data else 1)
    assert moments <= opt <= moments + 64
    # A rank's accumulator is the size of its parameters; the reduced gradients, the update's
    # argument, are split over data like the moments under ZeRO-1, whole without it.
    assert grads == params * 4 // jnp.dtype(ex.param_dtype).itemsize  # not one per rank on every device
    reduced = sum(4 * int(np.prod(sh.shard_shape(a.shape[1:])))
                  for a, sh in zip(jax.tree.leaves(ex.grad_acc), jax.tree.leaves(ex.grad_sharding)))
    assert reduced == grads // (2 if shard_over_data else 1)
    # Parameters, moments and the global norm (one f32 scalar), and the accumulators or, in
    # their place at the update, the reduced gradients (the accumulators are dropped once
    # reduced and made again after the update).
    assert ex.memory.persistent_bytes == params + grads + opt + 4
    assert ex.memory.needed_bytes >= ex.memory.persistent_bytes + ex.memory.in_flight * ex.memory.per_micro_batch_bytes


# ------------------------------------------------------------------------------ emulated chips


class FakeTime:
    """A clock that moves only when told. `now` is the wall clock, `cpu` this process's CPU
    time (every thread), `own` the calling thread's. A sleep returns at once; `tick` makes
    every wall or process-CPU reading `tick` after the last."""

    def __init__(self, start: float = 100.0, tick: float = 0.0):
        self.now, self.tick, self.slept = start, tick, []
        self.cpu = self.own = 0.0

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    def process_time(self) -> float:
        self.cpu += self.tick
        return self.cpu

    def thread_time(self) -> float:
        return self.own

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def advance(self, seconds: float):
        """A compute on one device: the worker threads are busy `seconds` of wall and CPU."""
        return self.work(seconds)

    def work(self, cpu: float, wall: float | None = None, dispatch: float = 0.0, out=None):
        """An executable call: the calling thread dispatches for `dispatch` s (its own CPU)
        and returns; waiting for the result, worker threads use `cpu` CPU-seconds over `wall`
        s of wall clock (more than `cpu` on a shared host or while an input is in flight,
        less when several devices compute at once)."""
        self.now += dispatch
        self.own += dispatch
        self.cpu += dispatch
        return Pending(self, cpu, cpu if wall is None else wall, out)


class Pending:
    """A fake executable's result: `jax.block_until_ready` runs its compute on the fake clock;
    it lives on the devices of `out` (a jax.Array), else on one."""

    def __init__(self, clock: FakeTime, cpu: float, wall: float, out=None):
        self.clock, self.cpu, self.wall, self.out = clock, cpu, wall, out
        if out is not None:
            self.sharding = out.sharding

    def block_until_ready(self):
        self.clock.now += self.wall
        self.clock.cpu += self.cpu
        self.wall = self.cpu = 0.0
        return self


@pytest.fixture
def fake_time(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(emulation, "time", types.SimpleNamespace(
        perf_counter=clock.perf_counter, sleep=clock.sleep, process_time=clock.process_time,
        thread_time=clock.thread_time))
    return clock


def test_emulated_compute_is_busy_slowdown_times_measured(fake_time):
    clock = emulation.StageClock(slowdown=4.0, defer=True)
    clock.run(fake_time.advance, 0.25)  # the host computes for 0.25 s
    assert (clock.measured_s, clock.busy_s, clock.free_at) == (0.25, 1.0, 101.0)
    assert fake_time.slept == []  # deferred: a multi-stage process waits at the end of a step
    clock.run(fake_time.advance, 0.5)  # dispatched at 100.25, starts when the chip is free (101)
    assert (clock.measured_s, clock.busy_s, clock.free_at) == (0.75, 3.0, 103.0)
    assert clock.last_interval == (101.0, 103.0)
    clock.wait()
    assert fake_time.now == 103.0 and fake_time.slept == [pytest.approx(103.0 - 100.75)]


def test_emulation_stretches_compute_not_dispatch_nor_contention(fake_time):
    """Only the worker threads' CPU seconds are stretched: the calling thread's Python
    dispatch is not, nor the wall time a compute spent off the cores (another process held
    them, or its input was still in flight)."""
    clock = emulation.StageClock(slowdown=8.0, defer=True)
    clock.run(lambda: fake_time.work(0.25, dispatch=0.5))
    # dispatched at 100.5 (host time, unstretched), then 8 x 0.25 s of chip time
    assert (clock.measured_s, clock.busy_s) == (0.25, 2.0) and clock.last_interval == (100.5, 102.5)
    clock.run(lambda: fake_time.work(0.25, wall=1.0))  # a third of the wall time on a core
    assert (clock.measured_s, clock.busy_s) == (0.5, 4.0) and clock.free_at == 104.5
    assert clock.host_lag_s == 0.0  # the chip was busy when the host dispatched again


def test_the_host_running_every_stage_does_not_hold_a_chip_back(fake_time):
    """One host dispatches several stages' computes in turn; each chip it emulates has a host
    of its own. A late dispatch is counted as host lag, not on the chip's timeline, except
    for the first compute after a synchronization (and always in a one-stage process)."""
    clock = emulation.StageClock(slowdown=8.0, defer=True)
    clock.run(lambda: fake_time.work(0.25, dispatch=0.5))  # the first: from its dispatch at 100.5
    assert clock.last_interval == (100.5, 102.5) and clock.host_lag_s == 0.0
    fake_time.now = 105.0  # the host was busy with other stages: it dispatches at 105.25
    clock.run(lambda: fake_time.work(0.25, dispatch=0.25))
    assert clock.last_interval == (102.5, 104.5) and clock.host_lag_s == 105.25 - 102.5
    clock.wait()  # a synchronization (the host reads a result): the next compute is the host's
    clock.run(lambda: fake_time.work(0.25, dispatch=0.25))  # dispatched at 105.75
    assert clock.last_interval == (105.75, 107.75) and clock.host_lag_s == 2.75 + (105.75 - 104.5)
    alone = emulation.StageClock(slowdown=8.0, defer=False)  # its own host: always from its dispatch
    alone.run(lambda: fake_time.work(0.25))  # dispatched at 106, sleeps until its chip is done (108)
    fake_time.now += 1.0
    alone.run(lambda: fake_time.work(0.25))
    assert alone.last_interval == (109.0, 111.0) and alone.host_lag_s == 1.0
    # the same compute on an idle host: the same busy time
    idle = emulation.StageClock(slowdown=8.0, defer=True)
    idle.run(lambda: fake_time.work(0.25))
    assert idle.busy_s == 2.0


def test_emulated_devices_of_one_stage_do_not_share_the_hosts_cores(fake_time):
    """A stage's D*T devices take turns on this host's cores; the chips they emulate each
    have their own: the busy time is the CPU seconds per device, whatever the wall clock."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    on_four = jax.device_put(np.zeros((4, 4), np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "tensor")))
    assert emulation.local_devices(on_four) == 4 and emulation.local_devices((np.float32(1.0),)) == 1
    clock = emulation.StageClock(slowdown=2.0, defer=True)
    # 4 devices x 0.5 CPU-s each on two cores: 1 s of wall clock
    assert clock.run(lambda: fake_time.work(2.0, wall=1.0, out=on_four)).out is on_four
    assert (clock.measured_s, clock.busy_s) == (0.5, 1.0)
    one = emulation.StageClock(slowdown=2.0, defer=True)
    one.run(lambda: fake_time.work(0.5))  # one device alone does the same per-device work
    assert one.busy_s == clock.busy_s


def test_a_real_chip_beside_emulated_ones_is_timed_by_the_wall_clock(fake_time):
    clock = emulation.StageClock(slowdown=1.0, defer=True, emulated=False)
    clock.run(lambda: fake_time.work(0.25, wall=1.0, dispatch=0.5))
    assert (clock.measured_s, clock.busy_s, clock.last_interval) == (1.5, 1.5, (100.0, 101.5))


def test_emulated_compute_waits_for_its_input_and_sleeps_when_alone(fake_time):
    clock = emulation.StageClock(slowdown=3.0, defer=False)
    clock.arrive(107.0)  # the input reaches the chip at 107
    clock.run(fake_time.advance, 1.0)
    assert clock.free_at == 107.0 + 3.0 and clock.busy_s == 3.0 and clock.measured_s == 1.0
    assert fake_time.now == 110.0  # one stage per process: it sleeps right after the compute
    clock.run(fake_time.advance, 1.0)  # the input time is consumed: starts when dispatched
    assert clock.free_at == 110.0 + 3.0 and fake_time.now == 113.0


class Mailbox:
    """The inner transport: hands values over by tag (what moves them is tested elsewhere)."""

    def __init__(self):
        self.box = {}

    def send(self, tag, value):
        self.box[tag] = value

    def recv(self, tag):
        return self.box.pop(tag)


def test_a_message_between_local_stages_carries_the_senders_clock(fake_time):
    clocks = {0: emulation.StageClock(16.0, defer=True), 1: emulation.StageClock(8.0, defer=True)}
    transport = emulation.ClockedTransport(Mailbox(), clocks)
    clocks[0].run(fake_time.advance, 0.5)  # stage 0's chip is busy until 100 + 8 = 108
    transport.send(Tag(ACT, 0, 0), jnp.zeros(2))
    transport.recv(Tag(ACT, 0, 0))
    clocks[1].run(fake_time.advance, 0.25)  # starts on arrival at 108, busy 2 s
    assert clocks[1].free_at == 108.0 + 2.0 and clocks[1].busy_s == 2.0
    assert fake_time.slept == []


def test_every_compute_of_an_emulated_pipeline_is_stretched_by_its_chips_slowdown(monkeypatch, token_file):
    """A whole training step on a ticking fake clock: each compute's worker threads use one
    tick of CPU time over the stage's two devices, so each stage's busy time is its chip
    file's slowdown x ticks / 2 x its forward/backward/update calls."""
    from h2jax.data import TokenDataset
    from h2jax.runtime.train import Trainer
    from tests.test_emulation import mixed_plan

    plan = mixed_plan()  # emu-slow (16x) then emu-mid (8x): compiled by test_emulation.py too
    trainer = Trainer(plan)
    fake = FakeTime(tick=0.001)
    monkeypatch.setattr(emulation, "time", types.SimpleNamespace(
        perf_counter=fake.perf_counter, sleep=fake.sleep, process_time=fake.process_time, thread_time=fake.thread_time))
    calls: dict[int, int] = {}  # id(clock) -> computes it ran
    original = emulation.StageClock.run

    def counting(self, fn, *args, **kwargs):
        calls[id(self)] = calls.get(id(self), 0) + 1
        return original(self, fn, *args, **kwargs)

    monkeypatch.setattr(emulation.StageClock, "run", counting)
    for clock in trainer.clocks.values():
        clock.measured_s = clock.busy_s = 0.0
    trainer.step(TokenDataset(token_file, 16).batch(0, plan.global_batch))
    for i, clock in trainer.clocks.items():
        slowdown = load_chip(plan.stages[i].chip).emulate.slowdown
        n = calls[id(clock)]
        assert n >= plan.n_micro + 1  # at least a forward per micro-batch and the update
        assert plan.stages[i].mesh.size == 2  # data=2 on stage 0, tensor=2 on stage 1
        assert clock.measured_s == pytest.approx(n * 0.001 / 2, rel=1e-9)
        assert clock.busy_s == pytest.approx(slowdown * clock.measured_s, rel=1e-9)
    assert fake.now >= max(c.free_at for c in trainer.clocks.values())  # the step waited for the chips


# ------------------------------------------------------------------------------ profiler


def test_profiler_times_exactly_one_layer(monkeypatch):
    """The profiled stage must be one layer: on tiny (4 layers) a 2-layer middle stage is a
    valid plan too, so only counting what was built and timed catches the difference."""
    import h2jax.profiler as profiler
    from h2jax.runtime import stage as stage_module

    built = []

    class Spy(stage_module.StageExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(stage_module, "StageExecutor", Spy)
    fake = FakeTime(tick=0.002)
    monkeypatch.setattr(profiler, "time", types.SimpleNamespace(perf_counter=fake.perf_counter, strftime=lambda f: "t"))
    # an emulated chip is timed as the emulation times it: worker CPU seconds (one tick a run)
    monkeypatch.setattr(emulation, "time", types.SimpleNamespace(
        perf_counter=fake.perf_counter, process_time=fake.process_time, thread_time=fake.thread_time))
    monkeypatch.setattr(profiler, "MIN_SAMPLE_S", 0.0)  # one call a sample (calls_per_sample is tested alone)
    cfg = PRESETS["tiny"]
    profile, raw = profiler.profile_chips(["emu-mid"], "tiny", 16, (1,), (2,), repeats=3, warmup=1)
    (ex,) = built
    params = jax.tree.leaves(ex.params)
    assert sum(p.size for p in params) == cfg.layer_param_count()
    assert ex.graphdef is not None and not ex.is_first and not ex.is_last
    (m,) = raw["emu-mid"]
    assert (m.tensor, m.micro_batch, m.tokens) == (1, 2, 32)
    # every timed run reads the ticking clock twice: one tick per run, whatever the host did
    assert m.forward_s == pytest.approx(0.002) and m.backward_s == pytest.approx(0.002)
    (entry,) = profile.entries("emu-mid", 1, "none")
    slowdown = load_chip("emu-mid").emulate.slowdown
    assert entry.forward_s == pytest.approx(0.002 * slowdown) and entry.backward_s == pytest.approx(0.002 * slowdown)
