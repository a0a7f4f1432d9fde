"""One job, two platforms: stage 0 on a CUDA GPU, stage 1 on the host CPU, checked against
the unpipelined reference within the alignment tolerance (mean relative error of the loss
curve < 1.5%, the H2 paper's criterion; the GPU stage computes in its chip's policy, bf16).

    python examples/mixed_gpu_cpu.py [--steps 20] [--gpu-chip nvidia-h100]

Exits 0 with a SKIPPED message where no CUDA GPU is usable; 1 if the curves do not align.
Verified 2026-11-29 on one NVIDIA H200 (jax 0.11.2, jax-cuda13 plugin; chip file nvidia-h100):
20 steps, mean relative error 0.0028%, PASSED (benchmarks/gpu_check.sh runs it).
"""

from __future__ import annotations

import argparse
import sys

from h2jax.backends import installed_platforms, platform_devices, select_platforms
from h2jax.config import ConfigError
from h2jax.plan import plan_from_dict


def mixed_plan(gpu_chip: str):
    return plan_from_dict({
        "format_version": 1, "model": "tiny", "seq_len": 32, "global_batch": 8, "micro_batch": 2,
        "optimizer": {"name": "adamw", "learning_rate": 3e-3, "clip_norm": 1.0},
        "stages": [
            {"chip": gpu_chip, "mesh": {"data": 1, "tensor": 1}, "layers": [0, 2]},
            {"chip": "cpu", "mesh": {"data": 1, "tensor": 1}, "layers": [2, 4]},
        ],
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu-chip", default="nvidia-h100", help="a chip file with platform = \"cuda\"")
    args = parser.parse_args()
    if "cuda" not in installed_platforms():
        print("SKIPPED: no CUDA plugin installed (pip install \"jax[cuda13]\" on a machine with an NVIDIA GPU)")
        return 0
    plan = mixed_plan(args.gpu_chip)
    try:
        backends = select_platforms([args.gpu_chip, "cpu"])  # before JAX starts: cuda and cpu
        gpus = platform_devices(backends[args.gpu_chip])
    except ConfigError as e:
        print(f"SKIPPED: {e}")
        return 0
    if not gpus:
        print("SKIPPED: the CUDA plugin is installed but sees no GPU")
        return 0

    import jax

    from h2jax.align import TOLERANCE, curve_error
    from h2jax.runtime.reference import ReferenceModel
    from h2jax.runtime.train import Trainer, default_dataset

    dataset = default_dataset(plan)
    trainer = Trainer(plan)
    where = {i: {d.platform for d in ex.mesh.devices.flat} for i, ex in trainer.executors.items()}
    print(f"stage devices: {where}")
    assert where == {0: {"gpu"}, 1: {"cpu"}} or where == {0: {"cuda"}, 1: {"cpu"}}, where
    mixed = [trainer.step(dataset.batch(n, plan.global_batch)).loss for n in range(args.steps)]
    reference = ReferenceModel(plan, device=jax.devices("cpu")[0])  # f32, one CPU device
    want = [reference.step(dataset.batch(n, plan.global_batch)) for n in range(args.steps)]
    err = curve_error("mixed", mixed, want)
    print(f"losses (cuda+cpu): {[round(x, 4) for x in mixed]}")
    print(f"losses (reference): {[round(x, 4) for x in want]}")
    print(f"mean relative error {err.mean_relative_error:.4%} (worst step {err.worst_step}: "
          f"{err.worst_relative_error:.4%}); tolerance {TOLERANCE:.1%}")
    if not err.passed:
        print("FAILED: the cuda+cpu pipeline does not align with the reference")
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
