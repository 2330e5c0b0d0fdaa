#!/usr/bin/env bash
# GPU readiness check (< 15 min on one H200, no download): sequence-parallel attention (one rank's
# share of the heads over a whole 8k/32k packed row, flash-attention varlen vs SDPA; see
# benchmarks/sp_attention_check.py), the loss alone (LM head +
# cross-entropy, unchunked vs chunked vs fused kernels when installed), then LoRA and QLoRA steps of a
# Llama-3-8B-shaped model with random weights, bf16, SDPA and flash-attention varlen
# (when installed), packed rows of 2048 and 8192 tokens; prints tokens/s per GPU, MFU
# and peak memory, writes gpu_check.json to $OUT (or benchmarks/results/). Online RL: the rollout
# benchmark (sfttool's generation vs model.generate; the vLLM engine when vllm is installed). Mixture of
# experts: the grouped-GEMM experts kernel against the loop over experts (benchmarks/moe_step.py).
#
#   bash benchmarks/gpu_check.sh                  # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run        # anywhere: tiny shapes on CPU
#   bash benchmarks/gpu_check.sh --arch qwen2.5-7b --lengths 2048
#
# Packages the machine lacks are taken from wheels carried in .whl/ (see
# benchmarks/README.md): they are installed once into $SFTTOOL_SITE (default
# /tmp/sfttool-site) with no index and no dependency resolution.
set -euo pipefail
cd "$(dirname "$0")/.."

py="${PYTHON:-$(command -v python3 || command -v python)}"
site="${SFTTOOL_SITE:-/tmp/sfttool-site}"
if compgen -G ".whl/*.whl" > /dev/null && [ ! -e "$site/.installed" ]; then
    "$py" -m pip install --quiet --no-index --no-deps --target "$site" .whl/*.whl
    touch "$site/.installed"
fi
# This checkout first, then the carried wheels, then whatever the machine has.
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

missing=$("$py" - <<'EOF'
import importlib.util
need = ["torch", "transformers", "accelerate", "peft", "bitsandbytes", "mmengine", "safetensors"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages: $missing" >&2
    echo "gpu_check: carry their wheels in .whl/ (benchmarks/README.md, 'Carrying wheels')" >&2
    exit 2
fi

out_dir="${OUT:-benchmarks/results}"
# Sequence-parallel attention first (seconds; at most 90 s): its failure is reported, the model cases still run.
case " $* " in *" --dry-run "*) sp_args=(--dry-run) ;; *) sp_args=() ;; esac
timeout 90 "$py" benchmarks/sp_attention_check.py --out "$out_dir/sp_attention_check.json" ${sp_args[@]+"${sp_args[@]}"} \
    || echo "gpu_check: the sequence-parallel attention check failed (exit $?); the model cases run anyway" >&2
# Online RL rollouts (benchmarks/rollout.py): sfttool's generation round against model.generate called directly,
# then the vLLM engine (rollout_engine='vllm') when vllm is installed; at most 100 s each, failures reported.
case " $* " in
    *" --dry-run "*) rollout_args=(--model tiny --repeats 1) ;;
    *) rollout_args=(--model qwen2.5-1.5b --prompts 8 --max-completion-length 256 --repeats 2) ;;
esac
timeout 100 "$py" benchmarks/rollout.py "${rollout_args[@]}" --out "$out_dir/rollout_hf.json" \
    || echo "gpu_check: the rollout benchmark failed (exit $?); the model cases run anyway" >&2
if [ "${rollout_args[1]}" != tiny ] && "$py" -c "import vllm" 2>/dev/null; then
    timeout 100 "$py" benchmarks/rollout.py "${rollout_args[@]}" --engine vllm --out "$out_dir/rollout_vllm.json" \
        || echo "gpu_check: the vLLM rollout engine failed (exit $?); the model cases run anyway" >&2
fi
# Mixture of experts (benchmarks/moe_step.py): a LoRA step of two Qwen3-30B-A3B-shaped layers, bf16, one
# 4096-token packed row, with transformers' grouped-GEMM experts kernel ('grouped_mm') against its loop over
# the experts ('eager'), beside the dense model with the same active parameters; at most 150 s.
case " $* " in
    *" --dry-run "*) ;;
    *) timeout 150 "$py" benchmarks/moe_step.py --device cuda --shape qwen3-30b-a3b-2l --methods lora --length 4096 \
           --batch-size 1 --steps 3 --warmup 1 --out "$out_dir/moe_step_gpu.json" \
           || echo "gpu_check: the MoE step benchmark failed (exit $?); the model cases run anyway" >&2 ;;
esac
# Hard stop below 8 minutes; the script itself skips cases that would start after --budget-s.
exec timeout 470 "$py" benchmarks/gpu_check.py --out "$out_dir/gpu_check.json" "$@"
