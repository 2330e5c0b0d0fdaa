"""One rank of the sequence-parallel exactness check (run by torchrun from test_sequence_parallel.py).

    python -m torch.distributed.run --nproc-per-node W sp_worker.py MODEL_DIR OUT_DIR SP

Every rank first computes the reference: one process's loss and gradients on the whole global batch
(every data-parallel group's rows). Then the sequence-parallel run: each group of SP ranks shares its
rows, each rank keeps its slice, the loss normaliser is the train loop's, the gradients are averaged
over all ranks as data parallelism does. Writes both to OUT_DIR/rank<r>.pt.
"""
from __future__ import annotations

import random
import sys

import torch
import torch.distributed as dist

# (attention, loss_reduction, loss_implementation): eager, SDPA and the flash-attention varlen path
CASES = [("eager", "token", "chunked"), ("sdpa", "sample", "unchunked"), ("sdpa", "token", "chunked"),
         ("flash_attention_2", "sample", "chunked")]


def packed_row(lengths: list[int], rng: random.Random) -> tuple[list, list, list]:
    ids, labels, positions = [], [], []
    for n in lengths:
        sample = [rng.randrange(3, 200) for _ in range(n)]
        ids += sample
        labels += [-100] * (n // 3) + sample[n // 3:]  # a prompt, then the trained answer
        positions += list(range(n))
    return ids, labels, positions


def global_batch(rows: int) -> dict:
    """``rows`` packed rows of 13 tokens (the last one 11, padded as the collate pads); samples
    straddle the middle, where sp=2 splits the row."""
    rng = random.Random(7)
    shapes = [[5, 4, 4], [9, 4], [3, 7, 3], [2, 8, 3]]
    batch = [packed_row(shapes[i % len(shapes)], rng) for i in range(rows)]
    batch[-1] = packed_row([6, 5], rng)
    pad = 13 - len(batch[-1][0])
    batch[-1] = (batch[-1][0] + [0] * pad, batch[-1][1] + [-100] * pad, batch[-1][2] + list(range(pad)))
    names = ("input_ids", "labels", "position_ids")
    return {name: torch.tensor([row[i] for row in batch]) for i, name in enumerate(names)}


def reference_varlen_kernel(calls: list):
    """A pure-torch stand-in for flash_attn_varlen_func (each sample alone, causal), recording its arguments."""
    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=True):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, tuple(q.shape), tuple(k.shape)))
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=causal, scale=softmax_scale).transpose(0, 1)
        return out
    return kernel


def loss_and_grads(model, data: dict, normalizer: float) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss = model.compute_loss(dict(data, loss_normalizer=normalizer))["loss"]
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def configure(model, attention: str, reduction: str, implementation: str, sequence_parallel: bool) -> None:
    model.loss_reduction, model.loss_implementation = reduction, implementation
    name = attention if not sequence_parallel else "sequence_parallel_" + attention
    model.llm.config._attn_implementation = "sdpa" if name == "flash_attention_2" else name  # reference: sdpa
    model.flatten_batch = attention == "flash_attention_2" and sequence_parallel


def main(model_dir: str, out_dir: str, sp: int) -> None:
    from sfttool.model import SupervisedFinetune
    from sfttool.model.loss import count_loss_units
    from sfttool.parallel import attention
    from sfttool.parallel.sequence import get_data_parallel_rank, init_sequence_parallel
    from sfttool.parallel.setup import use_sequence_parallel_attention

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    llm = dict(type="transformers.AutoModelForCausalLM.from_pretrained", pretrained_model_name_or_path=model_dir,
               dtype="float32", attn_implementation="sdpa")
    model = SupervisedFinetune(llm=llm, loss_chunk_size=4).train()  # activation checkpointing: recomputed in backward
    batch = global_batch(2 * world // sp)
    reference = {}
    for case in CASES:
        configure(model, *case, sequence_parallel=False)
        units = count_loss_units(batch["labels"], batch["position_ids"], case[1])
        reference[case] = loss_and_grads(model, batch, float(units))

    init_sequence_parallel(sp)
    use_sequence_parallel_attention(model.llm)
    calls: list = []
    attention.flash_varlen_kernel = lambda: reference_varlen_kernel(calls)
    dp = get_data_parallel_rank()
    mine = {k: v[2 * dp:2 * dp + 2] for k, v in batch.items()}  # this data-parallel group's rows
    results = {}
    for case in CASES:
        configure(model, *case, sequence_parallel=True)
        local = torch.tensor(float(model.count_loss_units(mine)), dtype=torch.float64)
        dist.all_reduce(local)
        normalizer = local.item() / sp / world  # the train loop's: each row counted once, over all ranks
        loss, grads = loss_and_grads(model, mine, normalizer)
        for g in grads.values():  # data parallelism: the mean over every rank
            dist.all_reduce(g)
            g /= world
        results[case] = dict(loss=loss, grads=grads, ref_loss=reference[case][0], ref_grads=reference[case][1])
    results["varlen_calls"] = calls
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
