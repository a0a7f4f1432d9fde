"""Two MPI processes, two platforms: rank 0 trains stage 0 on a CUDA GPU, rank 1 trains stage 1
on the host CPU, through the MPI transport (path from --path, default $H2JAX_MPI_PATH, else
auto). After training, rank 1 (the CPU rank) runs the unpipelined reference (f32, one CPU
device) on the same data, and rank 0 prints each rank's platform and transport report, both
loss curves, the per-step times and the mean relative error against the alignment tolerance
(1.5%, as examples/mixed_gpu_cpu.py), then PASSED or FAILED.

    mpiexec -n 2 python3 benchmarks/gpu_check_mpi.py [--steps 20] [--gpu-chip nvidia-h100] [--path auto]

`--gpu-chip cpu-bf16` runs the same flow with both ranks on the CPU (a smoke test of this
script on a machine without a GPU). Every rank exits with the same code: 0 when aligned.
benchmarks/gpu_check.sh launches it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import h2jax
from h2jax.plan import plan_from_dict
from h2jax.runtime import ranks
from h2jax.transport import mpi


def mixed_plan(gpu_chip: str):
    """examples/mixed_gpu_cpu.py's plan, one MPI process per stage."""
    return plan_from_dict({
        "format_version": 1, "model": "tiny", "seq_len": 32, "global_batch": 8, "micro_batch": 2,
        "optimizer": {"name": "adamw", "learning_rate": 3e-3, "clip_norm": 1.0},
        "stages": [
            {"chip": gpu_chip, "mesh": {"data": 1, "tensor": 1}, "layers": [0, 2], "processes": 1},
            {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4], "processes": 1},
        ],
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu-chip", default="nvidia-h100")
    parser.add_argument("--path", default=os.environ.get("H2JAX_MPI_PATH", "auto"),
                        choices=mpi.PATHS)
    args = parser.parse_args()
    plan = mixed_plan(args.gpu_chip)
    role = ranks.configure_process_for_plan(plan)  # before JAX starts: this rank's platform only

    import jax
    from mpi4py import MPI

    from h2jax.align import TOLERANCE, curve_error
    from h2jax.runtime.reference import ReferenceModel
    from h2jax.runtime.train import default_dataset

    comm = MPI.COMM_WORLD
    result = h2jax.run(plan, args.steps, mpi_path=args.path)
    me = {
        "rank": comm.rank, "stage": role.stage, "chip": plan.stages[role.stage].chip,
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()],
        "transport": result.transport, "step_times_ms": [round(t * 1e3, 2) for t in result.step_times_s],
    }
    reference = None
    if role.stage == plan.n_stages - 1:  # the CPU rank: f32 reference on one CPU device
        dataset = default_dataset(plan)
        model = ReferenceModel(plan, device=jax.devices("cpu")[0])
        reference = [model.step(dataset.batch(n, plan.global_batch)) for n in range(args.steps)]
    reports = comm.gather((me, reference), root=0)
    code = 0
    if comm.rank == 0:
        want = next(r for _, r in reports if r is not None)
        for report, _ in reports:
            print(f"rank {report['rank']}: " + json.dumps(report))
        err = curve_error("mpi", result.losses, want)
        print(f"losses (mpi, {args.gpu_chip}+cpu): {[round(x, 4) for x in result.losses]}")
        print(f"losses (reference): {[round(x, 4) for x in want]}")
        print(f"median step time after the first: {result.step_time_s * 1e3:.1f} ms "
              f"({result.tokens_per_s:,.0f} tokens/s)")
        print(f"mean relative error {err.mean_relative_error:.4%} (worst step {err.worst_step}: "
              f"{err.worst_relative_error:.4%}); tolerance {TOLERANCE:.1%}")
        if err.passed:
            print("PASSED")
        else:
            print(f"FAILED: the {args.gpu_chip}+cpu pipeline over MPI does not align with the reference")
            code = 1
    code = comm.bcast(code, root=0)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
