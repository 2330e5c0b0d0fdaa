"""Sequence parallelism (DeepSpeed-Ulysses): process groups, the row split, the attention function and the
run's set-up; ``sequence`` is XTuner 0.2's import path for its names (docs/long_context.md)."""
