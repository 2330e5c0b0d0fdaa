"""sfttool: config-driven supervised fine-tuning of large language models."""

from sfttool import compat as _compat

__version__ = "0.1.0"

# Before any tokenizer can run: forked workers (DataLoader, datasets.map) must never inherit a thread pool
# they would deadlock on, whatever TOKENIZERS_PARALLELISM says (docs/reliability.md).
_compat.tokenizer_fork_safety()
# Before anything imports bitsandbytes (peft does, with sfttool.model): its CPU kernel warning is noise here.
_compat.quiet_bnb_cpu_kernel_warning()
# And before bitsandbytes (or DeepSpeed's optimizers) is imported: their torch.compile calls at import would
# import torch's inductor, seconds in every process.
_compat.compile_on_first_call()
