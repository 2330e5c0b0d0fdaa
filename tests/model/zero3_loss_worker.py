"""One rank of the ZeRO-3 loss check (run by torchrun from test_chunked_loss.py).

    python -m torch.distributed.run --nproc-per-node 2 zero3_loss_worker.py MODEL_DIR OUT_DIR

A full fine-tune of the tiny model under DeepSpeed ZeRO-3 (every parameter
partitioned, none persisted): two steps with the chunked loss, one with the
unchunked loss (SGD at lr 0, so the weights stay put). Writes each step's loss,
full gradients and how many times the LM head's weight was gathered to
OUT_DIR/rank<r>.pt.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from conftest import collate, make_samples, pack  # noqa: E402

CHUNK = 5


def count_head_gathers(model, counter: list[int]) -> None:
    """DeepSpeed gathers through any parameter's all_gather / all_gather_coalesced
    with a list of parameters: count the lists that hold the head's weight."""
    head = model.llm.get_output_embeddings().weight

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            params = kwargs.get(key) if key in kwargs else (args[0] if args else None)
            if params is not None and any(p is head for p in params):
                counter[0] += 1
            return fn(*args, **kwargs)
        return wrapped

    for p in model.parameters():
        p.all_gather = counting(p.all_gather, "param_list")
        p.all_gather_coalesced = counting(p.all_gather_coalesced, "params")


def main(model_dir: str, out_dir: str) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from sfttool import compat
    from sfttool.model import SupervisedFinetune

    compat.apply_training()  # as `sfttool train` does: no 30-60 s JIT build of DeepSpeed's CPU shm op among them
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    llm = dict(type="transformers.AutoModelForCausalLM.from_pretrained", pretrained_model_name_or_path=model_dir,
               dtype="float32", attn_implementation="sdpa")
    model = SupervisedFinetune(llm=llm, use_activation_checkpointing=False, loss_chunk_size=CHUNK)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                      config=config)
    samples = make_samples(4, seed=50 + rank, lengths=(6, 15))
    data = collate([pack(samples[:3]), pack(samples[3:])])
    counter = [0]
    count_head_gathers(model, counter)
    results = {}
    # Chunked twice first: DeepSpeed prefetches what its trace of the previous step
    # used, so a step after an unchunked one would also fetch the head module's weight.
    for step, implementation in enumerate(("chunked", "chunked", "unchunked")):
        model.loss_implementation = implementation
        counter[0] = 0
        loss = engine(data, mode="loss")["loss"]
        engine.backward(loss)
        grads = {n: safe_get_full_grad(p).detach().clone() for n, p in model.named_parameters()}
        results[step] = {"implementation": implementation, "loss": loss.detach().clone(), "grads": grads,
                         "head_gathers": counter[0]}
        engine.step()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
