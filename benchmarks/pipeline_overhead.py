"""Pure runtime overhead of the pipeline: tokens/s of the unpipelined jit, of a 1-stage plan
and of 4-stage 1F1B plans, same model, same global batch, measured side by side in one run.

The 4-stage plan with differing meshes (data 2 / tensor 2, alternating) runs twice: with the
asynchronous device-to-device hand-off between local meshes (the default) and with the old
synchronous one forced (`LocalTransport(handoff="sync")`: a whole-array device_put that
waits for the producer and goes through the host). A traced step of each reports the most
stages that computed at one instant.

Prints one JSON object. Goal: the 1-stage plan within 5% of the jit.
    python benchmarks/pipeline_overhead.py [--steps 12] [--model small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the three runs this many times")
    args = ap.parse_args()

    import jax

    from h2jax.config import get_config
    from h2jax.data import TokenDataset, stdlib_corpus
    from h2jax.plan import plan_from_dict
    from h2jax.runtime.reference import ReferenceModel
    from h2jax.runtime.tracing import StepTracer, overlapping_stages
    from h2jax.runtime.train import Trainer
    from h2jax.transport.local import LocalTransport

    cfg = get_config(args.model)
    n = cfg.n_layers
    bounds = [0, n // 4, n // 2, 3 * n // 4, n]

    def plan(stages, micro_batch):
        return plan_from_dict({
            "format_version": 1, "model": args.model, "seq_len": args.seq_len,
            "global_batch": args.global_batch, "micro_batch": micro_batch, "schedule": "1f1b",
            "stages": stages,
        })

    one = plan([{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [0, n]}], args.global_batch)
    four = plan([{"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": bounds[i:i + 2]} for i in range(4)],
                args.global_batch // 4)
    meshes = [(2, 1), (1, 2), (2, 1), (1, 2)]
    mixed = plan([{"chip": "cpu", "mesh": {"data": d, "tensor": t}, "layers": bounds[i:i + 2]}
                  for i, (d, t) in enumerate(meshes)], args.global_batch // 4)
    data = TokenDataset(stdlib_corpus(), args.seq_len, seed=0)
    runners = {
        "unpipelined_jit": ReferenceModel(one, jax.devices()[0]).step,
        "one_stage_plan": Trainer(one, devices=jax.devices()[:1]).step,
        "four_stage_1f1b": Trainer(four).step,
        "four_stage_mixed_meshes_async_handoff": Trainer(mixed, LocalTransport("async")).step,
        "four_stage_mixed_meshes_sync_handoff": Trainer(mixed, LocalTransport("sync")).step,
    }
    import time

    times: dict[str, list[float]] = {k: [] for k in runners}
    for name, step in runners.items():  # warm-up: compile
        step(data.batch(0, args.global_batch))
    for r in range(args.rounds):  # interleave, so machine noise hits all three alike
        for name, step in runners.items():
            for s in range(args.steps):
                batch = data.batch(1 + s, args.global_batch)
                t0 = time.perf_counter()
                step(batch)
                times[name].append(time.perf_counter() - t0)
    overlap = {}
    for handoff in ("async", "sync"):
        tracer = StepTracer()
        trainer = Trainer(mixed, LocalTransport(handoff), tracer=tracer)
        for s in range(3):
            trainer.step(data.batch(s, args.global_batch))
        tracer.drain()
        overlap[handoff] = overlapping_stages(tracer.relative_events(0.0))
        trainer.close()
    tokens = args.global_batch * args.seq_len
    tps = {k: tokens / float(np.median(v)) for k, v in times.items()}
    print(json.dumps({
        "benchmark": "pipeline_overhead",
        "model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch,
        "devices": {"unpipelined_jit": 1, "one_stage_plan": 1, "four_stage_1f1b": 4,
                    "four_stage_mixed_meshes_async_handoff": 8, "four_stage_mixed_meshes_sync_handoff": 8},
        "host_cores": os.cpu_count(),
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "one_stage_over_jit": round(tps["one_stage_plan"] / tps["unpipelined_jit"], 4),
        "four_stage_over_jit": round(tps["four_stage_1f1b"] / tps["unpipelined_jit"], 4),
        "async_over_sync_handoff": round(
            tps["four_stage_mixed_meshes_async_handoff"] / tps["four_stage_mixed_meshes_sync_handoff"], 4),
        "most_stages_computing_at_once": overlap,
        "goal_one_stage_within_5pct": tps["one_stage_plan"] / tps["unpipelined_jit"] >= 0.95,
    }))


if __name__ == "__main__":
    sys.exit(main())
