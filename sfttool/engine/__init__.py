"""The engine: train loop, runner set-up, DeepSpeed presets, launching, hooks.

``sfttool.engine.runner.TrainLoop`` and ``sfttool.engine.hooks.*`` keep XTuner's paths.
"""
