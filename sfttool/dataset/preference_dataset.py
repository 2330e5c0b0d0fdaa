"""XTuner 0.2's module path for preference data (``xtuner.dataset.preference_dataset``), so its configs
migrate by replacing the package name. The code lives in ``sfttool.dataset.preference``."""
from sfttool.dataset.map_fns.preference_map_fns import intel_orca_dpo_map_fn, orpo_dpo_mix_40k_map_fn
from sfttool.dataset.preference import build_preference_dataset

__all__ = ["build_preference_dataset", "intel_orca_dpo_map_fn", "orpo_dpo_mix_40k_map_fn"]
