"""XTuner 0.2's ``xtuner.parallel`` module path, so configs that import from it load (see ``sequence``)."""
