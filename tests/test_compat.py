"""Contracts of ``sfttool.compat``'s mmengine workarounds: for each, the upstream behaviour it works
around, observed in a fresh interpreter where sfttool has patched nothing (when upstream changes, its
test fails and says which workaround to revisit), and the workaround doing its job here."""
from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sfttool import compat

# Run without importing sfttool: what mmengine 0.10 does on its own.
UPSTREAM = r'''
import inspect, io, json
import torch
import mmengine.config.config as mm_config
import mmengine.utils.package_utils as package_utils
from mmengine.config import Config
seen = {}
try:
    package_utils.get_installed_path("mmengine"); seen["package_lookup"] = "works"
except Exception as exc:
    seen["package_lookup"] = type(exc).__name__
seen["import_transformer_looked_up_per_load"] = "ImportTransformer(" in inspect.getsource(Config._parse_lazy_import)
namespace = {"__name__": "not_an_importable_module"}
exec(compile("def my_map_fn(row):\n    return row\n", "my_cfg.py", "exec"), namespace)
local = namespace["my_map_fn"]
try:
    Config(dict(fn=local)).pretty_text; seen["local_function_dump"] = "works"
except SyntaxError:
    seen["local_function_dump"] = "SyntaxError"
calls, format_code = [], mm_config.FormatCode
mm_config.FormatCode = lambda *a, **k: (calls.append(1), format_code(*a, **k))[1]
same = Config(dict(a=1)); same.pretty_text; same.pretty_text
seen["formats_per_pretty_text"] = len(calls)
from mmengine.logging.history_buffer import HistoryBuffer
seen["history_buffer_state"] = sorted(HistoryBuffer().__getstate__())
saved = io.BytesIO(); torch.save({"buffer": HistoryBuffer()}, saved); saved.seek(0)
try:
    torch.load(saved, weights_only=True); seen["weights_only_load"] = "works"
except Exception as exc:
    seen["weights_only_load"] = type(exc).__name__
from mmengine.registry import OPTIM_WRAPPERS
import mmengine.optim
seen["deepspeed_wrapper_with_optim"] = OPTIM_WRAPPERS.get("DeepSpeedOptimWrapper") is not None
import mmengine._strategy.deepspeed as mm_deepspeed
seen["deepspeed_wrapper_with_strategy"] = OPTIM_WRAPPERS.get("DeepSpeedOptimWrapper") is not None
try:
    mm_deepspeed.register_deepspeed_optimizers(); seen["deepspeed_optimizers"] = "works"
except ImportError:
    seen["deepspeed_optimizers"] = "ImportError"
seen["strategy_registers_optimizers"] = "register_deepspeed_optimizers()" in inspect.getsource(
    mm_deepspeed.DeepSpeedStrategy.__init__)
from mmengine.logging import MessageHub, MMLogger
seen["same_name_same_hub"] = MessageHub.get_instance("probe") is MessageHub.get_instance("probe")
seen["logger_terminal_handlers"] = [type(h).__name__ for h in MMLogger.get_instance("probe").handlers]
from mmengine._strategy.base import BaseStrategy
from mmengine.runner import Runner
seen["run_folder_to_the_second"] = ["'%Y%m%d_%H%M%S'" in inspect.getsource(f)
                                    for f in (Runner.setup_env, BaseStrategy._setup_env)]
import mmengine.dist.utils as dist_utils
seen["init_dist_sets_cuda_device"] = "torch.cuda.set_device" in inspect.getsource(dist_utils._init_dist_pytorch)
seen["ddp_device_ids"] = "device_ids=[int(os.environ['LOCAL_RANK'])]" in inspect.getsource(Runner.wrap_model)
from mmengine.optim import AmpOptimWrapper
try:
    AmpOptimWrapper(optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    seen["amp_without_gpu"] = "works"
except Exception as exc:
    seen["amp_without_gpu"] = type(exc).__name__
print(json.dumps(seen))
'''


@pytest.fixture(scope="module")
def upstream() -> dict:
    result = subprocess.run([sys.executable, "-c", UPSTREAM], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _local_function():
    """A map fn as a config's own file defines it: no importable module holds it."""
    namespace = {"__name__": "not_an_importable_module"}
    exec(compile("def my_map_fn(row):\n    return row\n", "my_cfg.py", "exec"), namespace)
    return namespace["my_map_fn"]


def test_package_lookup(upstream):
    """``read_base()`` absolute imports: mmengine's lookup needs pkg_resources, which setuptools dropped."""
    import mmengine.config.config as mm_config

    assert upstream["package_lookup"] == "ModuleNotFoundError"
    compat.patch_mmengine_package_lookup()
    assert (Path(mm_config.get_installed_path("sfttool")) / "configs").is_dir()
    assert mm_config.is_installed("sfttool") and not mm_config.is_installed("no_such_package_here")


def test_substituted_assignments(upstream, tmp_path):
    """``--cfg-options NAME=VALUE``: mmengine hands each parsed file to the ``ImportTransformer`` it looks up
    per load, the one place to change an assignment before it runs."""
    import ast

    import mmengine.config.config as mm_config
    from mmengine.config import Config

    assert upstream["import_transformer_looked_up_per_load"]
    path = tmp_path / "c.py"
    path.write_text("lr = 2e-4\nopt = dict(lr=lr)\n")
    original = mm_config.ImportTransformer
    with compat.substituted_assignments({(path.resolve(), 1): ast.parse("5e-5", mode="eval").body}):
        cfg = Config.fromfile(str(path), lazy_import=True)
    assert cfg.opt["lr"] == 5e-5 and mm_config.ImportTransformer is original


def test_local_functions_in_a_dumped_config(upstream):
    from mmengine.config import Config

    assert upstream["local_function_dump"] == "SyntaxError"
    compat.patch_mmengine_dump_local_functions()
    assert Config(dict(fn=_local_function())).pretty_text == "fn = 'my_map_fn (defined in my_cfg.py)'\n"


def test_config_formatting_is_cached(upstream):
    """mmengine formats the whole config with yapf on every ``pretty_text``, through its module's ``FormatCode``."""
    from mmengine.config import Config

    assert upstream["formats_per_pretty_text"] == 2
    compat.cache_mmengine_config_formatting()
    compat._yapf_format.cache_clear()
    same = Config(dict(a=1, b="unique to this test"))
    assert same.pretty_text == same.pretty_text and compat._yapf_format.cache_info()[:2] == (1, 1)


def test_history_buffer_and_weights_only_loading(upstream):
    """A checkpoint's message hub holds HistoryBuffers, which ``torch.load(weights_only=True)`` refuses, and
    their pickled state carries a table of functions that would need ``getattr`` on the allow-list."""
    from mmengine.logging.history_buffer import HistoryBuffer

    assert upstream["weights_only_load"] == "UnpicklingError"
    assert "statistics_methods" in upstream["history_buffer_state"]
    compat.allow_mmengine_checkpoint_globals()
    compat.patch_history_buffer_pickling()
    buffer = HistoryBuffer()
    buffer.update(1.5)
    saved = io.BytesIO()
    torch.save({"buffer": buffer}, saved)
    saved.seek(0)
    assert "statistics_methods" not in buffer.__getstate__()
    assert torch.load(saved, weights_only=True)["buffer"].mean() == 1.5


def test_deepspeed_optimizers_and_wrapper(upstream):
    """mmengine's DeepSpeed strategy registers 1-bit optimizers deepspeed removed; its wrapper's name is
    registered only with its private strategy package."""
    import mmengine._strategy.deepspeed as mm_deepspeed
    from mmengine.registry import OPTIM_WRAPPERS

    assert upstream["deepspeed_optimizers"] == "ImportError" and upstream["strategy_registers_optimizers"]
    assert not upstream["deepspeed_wrapper_with_optim"] and upstream["deepspeed_wrapper_with_strategy"]
    compat.patch_mmengine_deepspeed_optimizers()
    assert "DeepSpeedCPUAdam" in mm_deepspeed.register_deepspeed_optimizers()
    compat.register_mmengine_deepspeed_wrapper()
    assert OPTIM_WRAPPERS.get("DeepSpeedOptimWrapper") is mm_deepspeed.DeepSpeedOptimWrapper


def test_run_names_and_run_folders(upstream, tmp_path):
    """A second run of a process within the same second would get the first run's message hub (same name)
    and log folder (named to the second)."""
    assert upstream["same_name_same_hub"] and upstream["run_folder_to_the_second"] == [True, True]
    first, second = compat.numbered_run_name("cfg"), compat.numbered_run_name("cfg")
    assert first != second and second.startswith("cfg_run")
    (tmp_path / "20261201_120000").mkdir()
    assert compat._first_free_run_folder(str(tmp_path), "20261201_120000") == "20261201_120000_2"
    assert compat._first_free_run_folder(str(tmp_path), "20261201_120001") == "20261201_120001"


def test_quiet_terminal(upstream):
    """MMLogger's terminal handler is a plain StreamHandler (a FileHandler is a subclass): the console filter
    goes on exactly that one."""
    from mmengine.logging import MMLogger

    assert upstream["logger_terminal_handlers"] == ["StreamHandler"]
    with compat.quiet_console(verbose=False):
        logger = MMLogger.get_instance("compat_quiet_terminal")
    terminal = [h for h in logger.handlers if type(h) is logging.StreamHandler]
    assert len(terminal) == 1 and compat._CONSOLE in terminal[0].filters
    assert all(noise in terminal[0].filters for noise in compat.MMENGINE_NOISE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallbacks apply to machines without a GPU")
def test_cpu_fallbacks(upstream):
    """Without a GPU mmengine's init_dist sets a CUDA device, its DDP wrapper passes device_ids, and
    AmpOptimWrapper refuses to start."""
    assert upstream["init_dist_sets_cuda_device"] and upstream["ddp_device_ids"]
    assert upstream["amp_without_gpu"] == "AssertionError"
    assert compat.cpu_ddp_wrapper_cfg(None)["device_ids"] is None
    fallback = compat.cpu_optim_wrapper_type(dict(type="AmpOptimWrapper", dtype="bfloat16", loss_scale="dynamic"))
    assert fallback == dict(type="OptimWrapper")


def test_an_image_text_processor_saves_loads_and_expands_images_without_torchvision(tmp_path, tiny_tokenizer_dir):
    """Qwen2.5-VL's processor has a video processor, whose classes need torchvision; without it the
    processor still builds, saves, loads and expands each image into its merged patches."""
    from transformers import AutoProcessor

    from sfttool import assets

    folder = assets.build_tiny_vlm(tmp_path / "vlm", tiny_tokenizer_dir, "qwen2_5_vl")
    compat.processors_without_torchvision()
    processor = AutoProcessor.from_pretrained(folder)
    image = assets.write_png(tmp_path / "a.png", 56, 56)
    messages = [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": "Hi"}]}]
    out = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 56 x 56 pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((out["input_ids"] == pad).sum()) == 4
    assert tuple(out["pixel_values"].shape) == (16, 3 * 2 * 14 * 14)


TEMPLATES = Path(__file__).resolve().parent / "assets" / "templates"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add.", "content": "4."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "12 C", "name": None},
        {"role": "assistant", "reasoning": "Under another name.", "content": "12 C in Oslo."},
        {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome."}]


def _outcome(render):
    try:
        return "text", render()
    except Exception as exc:  # a template may refuse a prefix: both must refuse it alike
        return "error", f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("jinja, family", [("Qwen-Qwen3-0.6B.jinja", "qwen"),
                                           ("Qwen-Qwen2.5-7B-Instruct.jinja", "qwen"),
                                           ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3")])
def test_chat_prefix_renders_equal_apply_chat_template(tmp_path, jinja, family):
    """transformers 5.x's apply_chat_template rebuilds every message on each call; the prefix renderer
    rebuilds them once: the same text for every prefix, with and without the generation prompt, with tools,
    reasoning (under both its names), a None field and a template argument. When transformers moves its
    helpers the renderer is None (the encoder then calls apply_chat_template) and this fails."""
    from transformers import AutoTokenizer

    from sfttool import assets
    from sfttool.dataset.chat_format import ChatFormat

    tokenizer = AutoTokenizer.from_pretrained(assets.build_chat_tokenizer(tmp_path, family,
                                                                          (TEMPLATES / jinja).read_text()))
    refused = []
    for tools, kwargs in [(None, {}), ([WEATHER], {"enable_thinking": False})]:
        fast = compat.chat_prefix_renderer(tokenizer, CHAT, tools, **kwargs)
        assert fast is not None
        for k in range(len(CHAT) + 1):
            for generation in (False, True):
                expected = _outcome(lambda: tokenizer.apply_chat_template(
                    CHAT[:k], tools=tools, tokenize=False, add_generation_prompt=generation, **kwargs))
                assert _outcome(lambda: fast(k, generation)) == expected, (k, generation, tools)
                refused += [k] if expected[0] == "error" else []
    # Refused alike: the empty conversation (apply_chat_template's own check) and, for Llama-3.1 with tools,
    # the system prompt alone (its template's); every longer prefix rendered.
    assert refused.count(0) == 4 and max(refused) <= 1
    assert compat.chat_prefix_renderer(tokenizer, CHAT, [len]) is None  # a function as a tool: transformers' path
    assert compat.chat_prefix_renderer(ChatFormat({}), CHAT) is None


# Run without importing sfttool, then with it: which imports bring in torch's inductor.
IMPORTS_INDUCTOR = r'''
import importlib, json, sys
if sys.argv[1] == "sfttool":
    import sfttool
import torch
compile_before = torch.compile
seen = {}
for name in ("bitsandbytes", "deepspeed.runtime.zero.muon.original_muon"):
    importlib.import_module(name)
    seen[name] = "torch._inductor.compile_fx" in sys.modules
seen["torch.compile kept"] = torch.compile is compile_before
print(json.dumps(seen))
'''


@pytest.mark.parametrize("first", ["upstream", "sfttool"])
def test_imports_that_call_torch_compile_leave_inductor_unimported(first):
    """bitsandbytes and DeepSpeed's Muon optimizer call torch.compile as they are imported, which imports
    torch's inductor (1.6 s of CPU per process); with sfttool imported first, they compile on first call."""
    result = subprocess.run([sys.executable, "-c", IMPORTS_INDUCTOR, first], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(compat.COMPILING_AT_IMPORT) <= seen.keys()
    if first == "upstream":  # when this fails, the workaround may be unneeded: compat.compile_on_first_call
        assert seen["bitsandbytes"], seen
    else:
        assert not any(seen[name] for name in compat.COMPILING_AT_IMPORT), seen
    assert seen["torch.compile kept"]


def test_a_function_compiled_at_import_compiles_on_its_first_call():
    def double(x):
        return x * 2

    module = torch.nn.Linear(2, 2)
    with compat._compiling_on_first_call():
        later = torch.compile(double, backend="eager")
        decorated = torch.compile(backend="eager")(double)
        broken = torch.compile(double, backend="no_such_backend")  # torch.compile refuses it when called
        compiled_module = torch.compile(module, backend="eager")
    x = torch.arange(3.0)
    assert later.__wrapped__ is double and later.__name__ == "double"
    assert torch.equal(later(x), x * 2) and torch.equal(decorated(x), x * 2)
    assert torch.equal(broken(x), x * 2)  # the plain function, as bitsandbytes falls back to it
    assert isinstance(compiled_module, torch._dynamo.eval_frame.OptimizedModule)
    with pytest.raises(Exception):
        torch.compile(double, backend="no_such_backend")(x)  # outside the block: torch.compile itself


@pytest.mark.skipif(torch.cuda.is_available(), reason="the op is skipped on DeepSpeed's CPU accelerator only")
def test_deepspeed_builds_no_shared_memory_op_on_cpu():
    """DeepSpeed's communication backend compiles a C++ op on CPU (30-60 s at first use) that only its
    inference all-reduce uses."""
    import importlib
    import inspect

    ds_torch = importlib.import_module("deepspeed.comm.torch")
    assert "self.shm_comm_op = build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__)
    assert "shm_comm_op" not in inspect.getsource(ds_torch.TorchBackend).replace(
        inspect.getsource(ds_torch.TorchBackend.__init__), "")  # used nowhere else
    compat.no_deepspeed_cpu_shm_op()
    assert ds_torch.build_shm_op() is None
