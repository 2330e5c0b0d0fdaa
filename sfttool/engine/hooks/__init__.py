"""Training hooks with XTuner's names: sample generations, dataset statistics, throughput; early
stopping and the loss plot."""
from .dataset_info_hook import DatasetInfoHook
from .early_stopping_hook import EarlyStoppingHook
from .evaluate_chat_hook import EvaluateChatHook
from .plot_hook import LossPlotHook
from .preemption_hook import PreemptionHook
from .throughput_hook import ThroughputHook
from .varlen_attn_args_hook import VarlenAttnArgsToMessageHubHook

__all__ = ["DatasetInfoHook", "EarlyStoppingHook", "EvaluateChatHook", "LossPlotHook", "PreemptionHook",
           "ThroughputHook", "VarlenAttnArgsToMessageHubHook"]
