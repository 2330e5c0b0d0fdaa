"""Runtime settings every built-in config shares: hooks that need no
per-config value, environment, logging. A config adds its own `checkpoint`
hook (it depends on `save_steps`) and `randomness` (it depends on `seed`).

Imported with `with read_base(): from ._base_.runtime import *`. Re-assigning a
name in the config replaces it entirely (mmengine does not merge dicts).
"""
from mmengine.hooks import (DistSamplerSeedHook, IterTimerHook, LoggerHook,
                            ParamSchedulerHook)

# Hooks merged into `default_hooks` by each config: dict(**base_hooks, checkpoint=...).
base_hooks = dict(
    timer=dict(type=IterTimerHook),                      # per-iteration time
    logger=dict(type=LoggerHook, log_metric_by_epoch=False, interval=10),  # log every 10 iterations
    param_scheduler=dict(type=ParamSchedulerHook),       # steps the lr schedule
    sampler_seed=dict(type=DistSamplerSeedHook),         # reseeds the sampler every epoch
)

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    # nccl on GPUs; sfttool falls back to gloo with a warning on a CPU-only machine.
    dist_cfg=dict(backend='nccl'),
)

visualizer = None        # e.g. dict(type=Visualizer, vis_backends=[dict(type=TensorboardVisBackend)])
log_level = 'INFO'
load_from = None         # a checkpoint to start from (weights only)
resume = False           # `sfttool train --resume` sets this
log_processor = dict(by_epoch=False)   # log by iteration, the unit the schedule uses
