"""``GRPOLoop``: the train loop of online RL (``GRPO``), TrainLoop's iterations over generation rounds.

    train_cfg = dict(type=GRPOLoop, max_epochs=1, num_iterations=1, micro_batch_size=8)

The data loader gives prompts, ``train_dataloader.batch_size`` per process per round. A round
(``sfttool.engine.rollouts``) samples ``num_generations`` completions of each, scores them and packs
them into micro-batches of ``micro_batch_size`` completions; the loop then passes over those
micro-batches ``num_iterations`` times (μ). An iteration is one micro-batch, as in ``TrainLoop``,
whose machinery is kept: the optimizer steps every ``accumulative_counts`` micro-batches, the loss of
every micro-batch is divided by its step's loss units summed over the step and the processes, and
``--resume`` continues at the exact iteration.

A round is a whole number of optimizer steps. When it spans more than one iteration, a checkpoint can
fall inside it: the round (its micro-batches, log-probs included) is then kept in the message hub,
which every checkpoint holds, and a resumed run trains on it instead of sampling anew with weights
that have moved since. Sampling itself is seeded per completion (``sfttool.model.rollout``).

The step's metrics are exact: sums and counts over its micro-batches and processes (the loss as
every run's, ``sfttool.model.step_metrics``; the round's figures by ``StepMetrics``), logged on its
last micro-batch: ``reward``, ``reward_std``, ``rewards/<name>/mean``
and ``/std``, ``frac_reward_zero_std``, ``completions/mean_length``, ``completions/clipped_ratio``
(truncated completions), ``clip_ratio/low_mean``, ``/high_mean``, ``/region_mean`` and ``kl``.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import torch
from mmengine.dist import all_gather_object, all_reduce, get_rank, is_main_process
from mmengine.logging import print_log

from sfttool import compat
from sfttool.config import ConfigError
from sfttool.engine.rollouts import Round, RoundSpec, build_round, format_group, write_groups
from sfttool.engine.runner import TrainLoop, _ResumableBatches, unwrap_model
from sfttool.engine.spec import accumulative_counts
from sfttool.engine.tracking import add_text
from sfttool.model.grpo import STATS_PREFIX
from sfttool.registry import BUILDER

ROUND_KEY = "grpo_round"  # the message hub's entry holding the current round of every process


def round_iterations(prompts: int, num_generations: int, micro_batch_size: int, num_iterations: int,
                     accumulative_counts: int) -> int:
    """Iterations (micro-batches) per generation round, or a ConfigError saying which setting to change.

    >>> round_iterations(4, 8, 8, 2, 2)   # 32 completions = 4 micro-batches, passed over twice
    8
    """
    completions = prompts * num_generations
    if micro_batch_size < 1 or completions % micro_batch_size:
        raise ConfigError(f"train_cfg.micro_batch_size={micro_batch_size}: a generation round of {prompts} prompts x "
                          f"{num_generations} completions = {completions} completions per process is not a whole "
                          f"number of micro-batches; set micro_batch_size to a divisor of {completions}")
    micro_batches = completions // micro_batch_size
    if micro_batches % accumulative_counts:
        raise ConfigError(f"optim_wrapper.accumulative_counts={accumulative_counts}: a generation round has "
                          f"{micro_batches} micro-batches of {micro_batch_size} completions, not a whole number of "
                          f"optimizer steps; set accumulative_counts to a divisor of {micro_batches} (or change "
                          "train_dataloader.batch_size, the prompts per round)")
    if not isinstance(num_iterations, int) or num_iterations < 1:
        raise ConfigError(f"train_cfg.num_iterations must be a positive integer (μ), got {num_iterations!r}")
    return micro_batches * num_iterations


def check_loop_config(cfg: Any) -> None:
    """Before anything is built: a GRPOLoop's round is a whole number of micro-batches and optimizer steps."""
    round_iterations(*loop_settings(cfg))


def loop_settings(cfg: Any) -> tuple[int, int, int, int, int]:
    """``(prompts per round, num_generations, micro_batch_size, num_iterations, accumulative_counts)`` of a config."""
    prompts = int(cfg.train_dataloader.get("batch_size", 1))
    generations = int((cfg.get("model") or {}).get("num_generations", 8))
    loop = cfg.train_cfg
    micro = loop.get("micro_batch_size") or prompts * generations
    return prompts, generations, int(micro), loop.get("num_iterations", 1), int(accumulative_counts(cfg))


class RolloutBatches:
    """The loop's endless micro-batches: a round's micro-batches ``num_iterations`` times, then the next
    round from the next batch of prompts. Started at iteration ``start``, it continues the round that
    iteration falls in from the message hub, or starts the round it begins."""

    def __init__(self, loop: "GRPOLoop", start: int):
        self.loop = loop
        self.next_round, self.position = divmod(start, loop.iterations_per_round)
        self.round = loop.saved_round(self.next_round) if self.position else None
        self.next_round += self.round is not None
        self.prompts = _ResumableBatches(loop.dataloader, self.next_round)

    @property
    def epoch(self) -> int:
        return self.round.epoch if self.round is not None else self.prompts.epoch

    @property
    def batches_into_epoch(self) -> int:
        return self.prompts.batches_into_epoch

    def __next__(self) -> dict:
        if self.round is None or self.position >= self.loop.iterations_per_round:
            rows = next(self.prompts)["prompts"]
            self.round = self.loop.new_round(rows, self.prompts.epoch, self.next_round)
            self.next_round, self.position = self.next_round + 1, 0
        micro_batches = self.round.micro_batches
        batch = micro_batches[self.position % len(micro_batches)]
        self.position += 1
        return {"data": dict(batch), "data_samples": None}


class StepMetrics:
    """The optimizer step's metrics from sums and counts over its micro-batches and processes."""

    BASE = ("completions", "reward", "group_std", "zero_std", "length", "truncated", "tokens", "clipped_low",
            "clipped_high", "kl")

    def __init__(self, reward_names: list[str], with_kl: bool):
        self.names, self.with_kl = reward_names, with_kl
        self.sums = torch.zeros(len(self.BASE) + 3 * len(reward_names), dtype=torch.float64)

    def add(self, data: dict, stats: dict) -> None:
        parts = data["reward_parts"].double().cpu()  # [S, functions], NaN where a function did not apply
        values = [len(data["rewards"]), data["rewards"].double().sum(), data["group_std"].double().sum(),
                  (data["group_std"] == 0).sum(), data["completion_lengths"].double().sum(), data["truncated"].sum(),
                  stats.get("tokens", 0), stats.get("clipped_low", 0), stats.get("clipped_high", 0),
                  stats.get("kl", 0)]
        applies = ~parts.isnan()
        for j in range(len(self.names)):
            column = parts[:, j][applies[:, j]]
            values += [len(column), column.sum(), (column ** 2).sum()]
        self.sums += torch.tensor([float(v) for v in values], dtype=torch.float64)

    def finish(self) -> dict[str, float]:
        """All-reduce the sums, reset, and return the step's metrics."""
        sums, self.sums = self.sums, torch.zeros_like(self.sums)
        all_reduce(sums, op="sum")
        s = dict(zip(self.BASE, sums.tolist()))
        n, tokens = max(s["completions"], 1.0), max(s["tokens"], 1.0)
        out = {"reward": s["reward"] / n, "reward_std": s["group_std"] / n, "frac_reward_zero_std": s["zero_std"] / n,
               "completions/mean_length": s["length"] / n, "completions/clipped_ratio": s["truncated"] / n,
               "clip_ratio/low_mean": s["clipped_low"] / tokens, "clip_ratio/high_mean": s["clipped_high"] / tokens,
               "clip_ratio/region_mean": (s["clipped_low"] + s["clipped_high"]) / tokens}
        if self.with_kl:
            out["kl"] = s["kl"] / tokens
        for j, name in enumerate(self.names):
            count, total, squares = sums[len(self.BASE) + 3 * j:len(self.BASE) + 3 * j + 3].tolist()
            if count:
                out[f"rewards/{name}/mean"] = total / count
                out[f"rewards/{name}/std"] = math.sqrt(max(squares - total * total / count, 0.0) / (count - 1)) \
                    if count > 1 else 0.0
        return out


@BUILDER.register_module()
class GRPOLoop(TrainLoop):
    """TrainLoop over generation rounds (see the module docstring).

    Args (besides TrainLoop's ``max_epochs`` / ``max_iters``; an epoch is a pass over the prompts):
        num_iterations: μ, passes over each round's micro-batches.
        micro_batch_size: completions per micro-batch (forward + backward) per process; None: the round.
        log_completions_steps: every this many optimizer steps, the round starting there is logged (its
            first ``num_logged_prompts`` prompts with every completion, reward and advantage) and written
            to ``work_dir/completions/step_<n>.jsonl``; None logs only the first round.
        dry_run: set by ``sfttool train --dry-run``: one group is generated, scored and shown.
    """

    accepts_dry_run = True

    def __init__(self, runner, dataloader, max_iters: int | None = None, max_epochs: int | float | None = None,
                 num_iterations: int = 1, micro_batch_size: int | None = None, log_completions_steps: int | None = None,
                 num_logged_prompts: int = 2, dry_run: bool = False, **kwargs) -> None:
        if isinstance(dataloader, dict):  # rounds are whole: a last, short batch of prompts is not a round
            dataloader = dict(dataloader, drop_last=True)
        super().__init__(runner, dataloader, max_iters=max_iters, max_epochs=max_epochs, **kwargs)
        self.model = unwrap_model(runner.model)
        if not callable(getattr(self.model, "generate_completions", None)):
            raise ConfigError(f"train_cfg.type=GRPOLoop trains a model that samples and scores completions "
                              f"(model.type=GRPO), not {type(self.model).__name__}; use TrainLoop")
        prompts, _, _, _, accumulation = loop_settings(runner.cfg)
        prompts = int(self.dataloader.batch_size or prompts)
        self.micro_batch_size = int(micro_batch_size or prompts * self.model.num_generations)
        self.iterations_per_round = round_iterations(prompts, self.model.num_generations, self.micro_batch_size,
                                                     num_iterations, accumulation)
        self.steps_per_round = self.iterations_per_round // accumulation
        self.num_iterations, self.dry_run = num_iterations, dry_run
        self.log_completions_steps, self.num_logged_prompts = log_completions_steps, num_logged_prompts
        if max_epochs is not None:  # as the runner's schedule counts it (assemble.total_iters)
            self._max_iters = int(math.ceil(max_epochs * len(self.dataloader) * self.iterations_per_round))
        self.metrics = StepMetrics([r.name for r in self.model.rewards], self.model.beta > 0)

    @staticmethod
    def iterations_per_epoch(cfg: Any, prompts: int) -> int:
        """Iterations of an epoch of ``prompts`` prompts per process: its whole rounds' (a last batch with fewer
        prompts than a round is left out of the epoch, as TRL leaves it). The runner's schedule in epochs
        converts with it."""
        per_round = loop_settings(cfg)[0]
        if prompts < per_round:
            raise ConfigError(f"train_dataloader.batch_size={per_round} prompts per generation round, but each "
                              f"process has {prompts} prompts: lower the batch size or give more prompts")
        return prompts // per_round * round_iterations(*loop_settings(cfg))

    def _batches(self) -> RolloutBatches:
        return RolloutBatches(self, self._iter)

    # -- rounds -----------------------------------------------------------

    def new_round(self, rows: list[dict], epoch: int, index: int):
        """Generate and score a round of ``rows``; keep it for a resume when a checkpoint can fall inside it."""
        if self.dry_run:
            rows = rows[:1]  # one group: the dry run shows it, then trains one micro-batch on it
        need_old = self.num_iterations > 1 or self.steps_per_round > 1
        spec = RoundSpec(index, epoch, self.runner.seed, self.micro_batch_size, need_old, _zero3(self.runner.model))
        round_ = build_round(self.model, rows, spec)
        if self.iterations_per_round > 1:  # plain data: checkpoints are read back with weights_only
            self.runner.message_hub.update_info(ROUND_KEY, all_gather_object(asdict(round_)))
        self.log_groups(round_, index * self.steps_per_round)
        return round_

    def saved_round(self, index: int):
        saved = self.runner.message_hub.get_info(ROUND_KEY)
        round_ = Round(**saved[get_rank()]) if saved else None
        if round_ is None or round_.index != index:
            raise ConfigError(f"the checkpoint falls inside generation round {index} but does not hold that round "
                              "(it was saved by another version of sfttool?); resume from a checkpoint at the "
                              "start of a round")
        return round_

    def log_groups(self, round_, step: int) -> None:
        every = self.log_completions_steps
        if not is_main_process() or not (step == 0 or self.dry_run or (every and step % every == 0)):
            return
        names = [r.name for r in self.model.rewards]
        groups = round_.groups[:self.num_logged_prompts]
        text = "\n\n".join(format_group(g, names) for g in groups)
        message = f"Completions sampled for optimizer step {step + 1} (rewards: {', '.join(names)}):\n{text}"
        if self.dry_run:  # what a dry run is for: shown on the quiet terminal too
            compat.inform(message)
        else:
            print_log(message, logger="current")
        if not self.dry_run:
            write_groups(self.runner.work_dir, step + 1, groups)
            add_text(getattr(self.runner, "visualizer", None), "completions", text, step + 1)

    # -- iterations -------------------------------------------------------

    def _next_batch(self) -> dict:
        if not self.dry_run:
            return super()._next_batch()
        batch = next(self.dataloader_iterator)  # a dry run trains on one micro-batch alone
        self._set_loss_normalizer([batch], 1)
        return batch

    def add_to_step(self, data_batch: dict, outputs: dict) -> None:
        """TrainLoop's, and the round's figures (``StepMetrics``) of the micro-batch."""
        stats = {key[len(STATS_PREFIX):]: float(outputs.pop(key)) for key in list(outputs)
                 if key.startswith(STATS_PREFIX)}
        self.metrics.add(data_batch["data"], stats)
        super().add_to_step(data_batch, outputs)

    def step_values(self) -> dict:
        """The step's loss as every run's, with the round's figures beside it."""
        return {**super().step_values(), **self.metrics.finish()}


def _zero3(wrapped: Any) -> bool:
    engine = getattr(wrapped, "model", None)
    partitioned = getattr(engine, "zero_optimization_partition_weights", None)
    return bool(callable(partitioned) and partitioned())
