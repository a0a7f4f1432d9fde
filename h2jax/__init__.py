"""h2jax: train one model across a cluster of mixed accelerators.

    import h2jax
    result = h2jax.run("plans/demo.json", steps=20)

    trainer = h2jax.Trainer(h2jax.load_plan("plans/demo.json"), steps=100)  # your own loop
    metrics = trainer.step(batch)
"""

from h2jax.config import ConfigError, ModelConfig, PRESETS, get_config
from h2jax.plan import Plan, PlanError, load_plan, save_plan

__version__ = "0.1.0"


def run(plan, steps: int = 10, **kwargs):
    """Train a plan (a Plan or a plan-file path); see h2jax.runtime.train.run."""
    from h2jax.runtime.train import run as _run

    return _run(plan, steps, **kwargs)


def __getattr__(name: str):
    # Trainer lives with the runtime; imported on first use so `import h2jax` starts no backend.
    if name in ("Trainer", "StepMetrics"):
        from h2jax.runtime import train

        return getattr(train, name)
    raise AttributeError(f"module 'h2jax' has no attribute {name!r}")


__all__ = ["ConfigError", "StepMetrics", "Trainer", "ModelConfig", "PRESETS", "Plan", "PlanError", "get_config", "load_plan", "run", "save_plan"]
