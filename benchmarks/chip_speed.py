"""Per-chip speed of a stack of transformer layers: XLA attention and fused attention side by side.

For one chip type (a backends/ file) runs `--layers` layers of a model shape, forward and
backward (parameters in the chip's param dtype, math in its compute dtype, as a pipeline stage
runs them), at each micro-batch size and sequence length, once with the explicit XLA attention
and once with the chip's fused kernel (cuDNN's flash kernel on CUDA with bf16/fp16, else the
blocked XLA kernel). Prints ONE JSON object; per case and kernel:

    tokens_per_s     micro_batch * seq_len / median step time
    model_tflops     training FLOPs of the layers (the MFU convention: 3 x (2 x matmul params +
                     4 x s x h x e) per token per layer, the full attention square) / step time
    mfu              model_tflops / the chip file's peak_tflops (dense bf16 on accelerators)
    kernel_tflops    FLOPs as the kernel does them (the planner's cost model: causal tiles skipped
                     by cuDNN, the blocked kernel's recomputed forward) / step time
    peak_bytes       one forward+backward program: arguments + temporaries + fresh outputs
                     (compiled.memory_analysis(), per device)
    kept_bytes       what a separately compiled forward keeps for its backward (a pipeline
                     stage holds this per micro-batch in flight)
    cudnn_flash_in_hlo  whether the compiled program calls cuDNN's fused attention

and per case the bytes the fused kernel saves. Defaults on a CPU chip: the tiny and small
shapes at seq 1024 and 2048; on an accelerator: 1B- and 7B-wide layers at seq 4096.

    python benchmarks/chip_speed.py [--chip cpu] [--shapes tiny,small] [--layers 2]
        [--micro-batches 1,2] [--seq-lens 1024,2048] [--repeats 2]
    python benchmarks/chip_speed.py --chip nvidia-h100 --shapes 7b --seq-lens 4096 --layers 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

# Shapes of the layers measured: presets, and 1B-/7B-wide layers (LLaMA 3.2 1B, LLaMA 2 7B).
WIDE = {
    "1b": dict(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192),
    "7b": dict(vocab_size=32_000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11_008),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def shape(name: str):
    from h2jax.config import ModelConfig, get_config

    return ModelConfig(**WIDE[name]) if name in WIDE else get_config(name, "--shapes")


def layer_flops(cfg, seq_len: int, kernel: str | None) -> float:
    """Training FLOPs per token of one layer: kernel=None is the MFU convention (full square, the
    backward twice the forward); a kernel name counts as the cost model does for that kernel."""
    from h2jax.planner import cost_model as cm

    mm = 2.0 * cm.matmul_params(cfg)
    if kernel is None:
        return 3.0 * (mm + cm.attention_flops_per_token(cfg, seq_len))
    attn = cm.attention_flops_per_token(cfg, seq_len, kernel)
    return 3.0 * mm + (1.0 + cm.ATTENTION_BACKWARD[kernel]) * attn


def measure(chip, cfg, layers: int, micro_batch: int, seq_len: int, kernel: str, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from h2jax.model import StageModel

    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    param_dtype, compute_dtype = dtypes[chip.precision.param_dtype], dtypes[chip.precision.compute_dtype]
    stack = dataclasses.replace(cfg, n_layers=layers + 2)  # layers [1, layers + 1): a middle stage
    graphdef, params = nnx.split(StageModel(
        stack, 1, layers + 1, seed=0, dtype=param_dtype, precision=chip.precision.matmul_precision,
        attention=kernel,
    ))
    params = nnx.to_pure_dict(params)

    def apply(p, x):
        p = jax.tree.map(lambda a: a.astype(compute_dtype), p)
        return nnx.merge(graphdef, p)(x)

    def forward(p, x):
        return jax.vjp(apply, p, x)

    def step(p, x, dy):
        _, vjp = jax.vjp(apply, p, x)
        return vjp(dy)

    x = jax.random.normal(jax.random.key(1), (micro_batch, seq_len, cfg.d_model), compute_dtype)
    dy = jax.random.normal(jax.random.key(2), x.shape, compute_dtype)
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(params, x, dy).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    kept = jax.eval_shape(forward, params, x)[1]  # the vjp closure: a pytree of the residuals
    kept_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(kept))
    jax.block_until_ready(compiled(params, x, dy))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, x, dy))
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    tokens = micro_batch * seq_len
    model_flops = layers * tokens * layer_flops(cfg, seq_len, None)
    kernel_flops = layers * tokens * layer_flops(cfg, seq_len, kernel)
    peak = None
    if mem is not None:
        peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                + max(mem.output_size_in_bytes - mem.alias_size_in_bytes, 0))
    return {
        "kernel": kernel,
        "step_s": seconds,
        "step_s_all": times,
        "compile_s": compile_s,
        "tokens_per_s": tokens / seconds,
        "model_tflops": model_flops / seconds / 1e12,
        "mfu": model_flops / seconds / 1e12 / chip.peak_tflops,
        "kernel_tflops": kernel_flops / seconds / 1e12,
        "peak_bytes": peak,
        "temp_bytes": None if mem is None else mem.temp_size_in_bytes,
        "kept_bytes": kept_bytes,
        "cudnn_flash_in_hlo": "__cudnn$fmha" in compiled.as_text(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chip", default="cpu", help="chip type (a backends/ file name); default cpu")
    ap.add_argument("--shapes", default=None, help="layer shapes: presets (tiny, small, llama-7b, ...) or 1b, 7b")
    ap.add_argument("--layers", type=int, default=2, help="layers in the measured stack (default 2)")
    ap.add_argument("--micro-batches", default=None, help="sequences per step, comma-separated")
    ap.add_argument("--seq-lens", default=None, help="sequence lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps per case (median reported; default 2)")
    args = ap.parse_args()

    from h2jax.backends import select_platforms
    from h2jax.cluster import Kernels, load_chip
    from h2jax.config import ConfigError

    chip = load_chip(args.chip)
    backend = select_platforms([chip.name])[chip.name]
    import jax

    on_cpu = chip.platform == "cpu"
    shapes = (args.shapes or ("tiny,small" if on_cpu else "1b,7b")).split(",")
    micro_batches = _ints(args.micro_batches or "1,2")
    seq_lens = _ints(args.seq_lens or ("1024,2048" if on_cpu else "4096"))
    if args.layers < 1 or args.repeats < 1 or not micro_batches or not seq_lens or min(micro_batches + seq_lens) < 1:
        raise ConfigError("--layers, --repeats, --micro-batches and --seq-lens must be positive")
    devices = jax.devices(backend.jax_platform)
    fused = dataclasses.replace(chip, kernels=Kernels("fused")).attention_kernel
    results = []
    with jax.default_device(devices[0]):
        for name in shapes:
            cfg = shape(name)
            for seq_len in seq_lens:
                for mb in micro_batches:
                    row = {"shape": name, "micro_batch": mb, "seq_len": seq_len}
                    for label, kernel in (("xla", "xla"), ("fused", fused)):
                        row[label] = measure(chip, cfg, args.layers, mb, seq_len, kernel, args.repeats)
                    x, f = row["xla"], row["fused"]
                    if x["peak_bytes"] is not None and f["peak_bytes"] is not None:
                        row["peak_bytes_saved"] = x["peak_bytes"] - f["peak_bytes"]
                    row["kept_bytes_saved"] = x["kept_bytes"] - f["kept_bytes"]
                    row["fused_speedup"] = x["step_s"] / f["step_s"]
                    results.append(row)
    print(json.dumps({
        "benchmark": "chip_speed",
        "chip": chip.name,
        "platform": chip.platform,
        "device_kind": devices[0].device_kind,
        "emulated": chip.is_emulated,
        "peak_tflops": chip.peak_tflops,
        "peak_source": chip.source,
        "param_dtype": chip.precision.param_dtype,
        "compute_dtype": chip.precision.compute_dtype,
        "fused_kernel": fused,
        "layers": args.layers,
        "repeats": args.repeats,
        "jax": jax.__version__,
        "results": results,
    }))


if __name__ == "__main__":
    main()
