#!/usr/bin/env bash
# Every GPU measurement behind benchmarks/results, in one command, on a bare CUDA machine.
#
#   bash benchmarks/gpu_session.sh OUTDIR [PART ...]
#       PART: env tests bench calibrate steps replay (the default set), or any of
#             holdout graphs pd mooncake profile fp8 fp8bench hybrid (GPU-LIST.md items 1-4, each alone)
#
# - tests:     every `cuda`-marked test (each kernel against its torch twin at real shapes)
# - bench:     benchmarks/bench_gpu.py, fp16 at block size 16 and bf16 at block size 32
# - calibrate: `kvsim calibrate --device cuda` (the profile and every measurement behind it)
# - steps:     whole synthetic forward steps (gpu.forward_step): Llama-3-8B, and a Llama-3-70B TP-2 rank
# - replay:    `kvsim run --record-ops` of the default workload and of the first 2,000 Mooncake
#              conversation requests (swap preemption, online defragmenter), each replayed with
#              `kvsim gpu-replay --device cuda`, every step verified
# - holdout:   fresh forward steps the calibration never saw (`gpu.forward_step --grid holdout`):
#              Llama-3-8B, a Llama-3-70B TP-2 rank, Qwen3-30B-A3B (MoE); `python -m gpu.accuracy
#              holdout` fits on one half and scores the other, on any machine
# - graphs:    bench_gpu.py's write and decode sections, eager and under CUDA graphs
# - fp8bench:  bench_gpu.py's fp8 section: decode attention on an FP8 cache against the same kernel on
#              the fp16 cache of the same values, eager and under CUDA graphs (batches 1-64, 1k-16k tokens)
# - pd:        bench_gpu.py's P/D transfer (blocks GPU -> pinned host -> GPU) against the simulator's price
# - mooncake:  the first 2,000 Mooncake conversation requests recorded and replayed whole with
#              `--check touched` (each step reads back only the entries an op changed) and decode
#              attention compared on one layer for 2 decodes a step (MOONCAKE_SAMPLE): run it alone in a
#              call (REPLAY_TIMEOUT, 540 s)
# - profile:   where the Mooncake replay's time goes on the GPU machine: py-spy (a wheel in .whl/)
#              samples the first PROFILE_S (60) seconds of the `mooncake` part's replay
# - fp8:       the default workload's run replayed with an FP8 cache (e4m3, K scale 0.5, V scale 2) and in
#              fp16, Llama-3-8B's geometry, every step read whole, decode attention checked on one layer:
#              0 mismatches and each kind's time, FP8 beside fp16 (GPU-LIST item 4)
# - hybrid:    gpt-oss-20b's and gemma-3-27b's KV-cache groups (first 80 Mooncake requests),
#              recorded and replayed with every step read whole and decode attention per window
# A bare machine with torch and triton but no simpy installs the wheels in .whl/ (see
# benchmarks/results/README.md). MOONCAKE names the trace (default ../shared/traces/...).
# HOLDOUT (model:tp:kernel ...) and TESTS_TIMEOUT narrow the holdout and tests parts.
# QUICK=1 shrinks everything to run on a CPU under Triton's interpreter (a smoke test of this script).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_session.sh OUTDIR [PART ...]}
shift
parts=${*:-env tests bench calibrate steps replay}
mkdir -p "$out"
if ! python3 -c "import simpy" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvsim-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvsim-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# the source folders import as kvsim.* only once installed (pyproject's package-dir): a bare machine
# needs the editable install, without dependencies (torch and triton are there, simpy came above)
python3 -c "import kvsim.gpu, kvsim.sim" 2>/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
quick=${QUICK:-0}
device=cuda
[ "$quick" = 1 ] && device=cpu
kvsim() { python3 -m sim.cli.app "$@"; }
say() { echo "== $(date +%T) $*"; }
mooncake=${MOONCAKE:-../shared/traces/mooncake/conversation_trace.jsonl}

for part in $parts; do
    start=$SECONDS
    case $part in
    env)
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
        python3 -c "
import json, platform, torch, triton
cuda = torch.cuda.is_available()
print(json.dumps({'device': torch.cuda.get_device_name(0) if cuda else 'cpu', 'torch': torch.__version__,
                  'triton': triton.__version__, 'cuda': torch.version.cuda, 'python': platform.python_version()}))
" | tee "$out/env.json"
        ;;
    tests)
        say "cuda tests"
        timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest tests/gpu -m cuda -p no:cacheprovider -rs 2>&1 | tee "$out/cuda_tests.log" | tail -15
        ;;
    bench)
        q=(); [ "$quick" = 1 ] && q=(--quick --allow-cpu)
        say "bench fp16 block 16"
        timeout 200 python3 benchmarks/bench_gpu.py "${q[@]}" --dtype float16 --block-size 16 \
            --json "$out/bench_fp16_b16.json" 2>&1 | tee "$out/bench_fp16_b16.log"
        say "bench bf16 block 32"
        timeout 200 python3 benchmarks/bench_gpu.py "${q[@]}" --dtype bfloat16 --block-size 32 \
            --json "$out/bench_bf16_b32.json" 2>&1 | tee "$out/bench_bf16_b32.log"
        ;;
    calibrate)
        say "calibrate"
        timeout 300 python3 -m sim.cli.app calibrate --device $device --out "$out/calibration.json" \
            --rows "$out/calibration_rows.json" 2>&1 | tee "$out/calibrate.log" | grep -v "^\["
        ;;
    steps)
        if [ "$quick" = 1 ]; then
            timeout 120 python3 -m gpu.forward_step --quick --out "$out/steps_quick.json" 2>&1 | tail -3
        else
            say "forward steps llama-3-8b"
            timeout 200 python3 -m gpu.forward_step --model llama-3-8b --tp 1 --out "$out/steps_llama-3-8b_tp1.json" \
                2>&1 | tee "$out/steps_llama-3-8b_tp1.log"
            say "forward steps llama-3-70b tp2"
            timeout 200 python3 -m gpu.forward_step --model llama-3-70b --tp 2 --out "$out/steps_llama-3-70b_tp2.json" \
                2>&1 | tee "$out/steps_llama-3-70b_tp2.log"
        fi
        ;;
    replay)
        runs=$out/runs
        mkdir -p "$runs"
        if [ "$quick" = 1 ]; then
            printf '{"timestamp": %d, "input_length": 40, "output_length": 3, "hash_ids": [0]}\n' 0 0 1 \
                > "$runs/mooncake.jsonl"
            head -3 tests/golden/workloads/multi-turn.jsonl > "$runs/small.jsonl"
            common=(--num-gpu-blocks 16 --num-cpu-blocks 64 --defrag-threshold 2)
            geometry_default=(--layers 1 --kv-heads 1 --head-dim 16 --q-per-kv 2)
            geometry_mooncake=("${geometry_default[@]}")
            default_src=("$runs/small.jsonl" --num-gpu-blocks 24 --num-cpu-blocks 64 --defrag-threshold 2)
        else
            head -2000 "$mooncake" > "$runs/mooncake.jsonl"
            common=(--num-gpu-blocks 20000 --num-cpu-blocks 20000 --defrag-threshold 256)
            geometry_default=(--layers 32 --kv-heads 8 --head-dim 128 --q-per-kv 4)  # Llama-3-8B, all layers
            # ~11G token reads to verify: a narrower geometry (real head dim) keeps it inside one run
            read -ra geometry_mooncake <<< "${MOONCAKE_GEOMETRY:---layers 4 --kv-heads 1 --head-dim 128 --q-per-kv 4}"
            default_src=(--num-gpu-blocks 300 --num-cpu-blocks 2048 --defrag-threshold 32)
        fi
        say "record default"
        kvsim run "${default_src[@]}" --preemption swap --record-ops --no-plots --out "$runs/default" | tail -12
        say "replay default"
        timeout 300 python3 -m sim.cli.app gpu-replay "$runs/default" --device $device "${geometry_default[@]}" \
            ${DEFAULT_REPLAY_ARGS:-} --save "$runs/replay_default.json"
        echo "rc $?"
        say "record mooncake"
        kvsim run "$runs/mooncake.jsonl" "${common[@]}" --preemption swap --record-ops --no-plots \
            --out "$runs/mooncake" | tail -12
        say "replay mooncake"
        timeout 420 python3 -m sim.cli.app gpu-replay "$runs/mooncake" --device $device "${geometry_mooncake[@]}" \
            --save "$runs/replay_mooncake.json"
        echo "rc $?"
        mkdir -p "$out/replay"
        for r in default mooncake; do
            [ -f "$runs/replay_$r.json" ] || continue
            cp "$runs/replay_$r.json" "$runs/$r/config.json" "$out/replay/" 2>/dev/null
            mv "$out/replay/config.json" "$out/replay/config_$r.json" 2>/dev/null
            cp "$runs/$r/summary.json" "$out/replay/summary_$r.json" 2>/dev/null
        done
        rm -rf "$runs"/default "$runs"/mooncake "$runs"/*.jsonl
        ;;
    holdout)
        if [ "$quick" = 1 ]; then
            timeout 120 python3 -m gpu.forward_step --quick --moe --out "$out/holdout_quick.json" 2>&1 | tail -3
        else
            # the MoE twice: its experts as one grouped GEMM (the default) and as the padded bmm
            for mt in ${HOLDOUT:-llama-3-8b:1:grouped llama-3-70b:2:grouped qwen3-30b-a3b:1:grouped qwen3-30b-a3b:1:bmm}; do
                IFS=: read -r m tp kernel <<< "$mt"
                name=holdout_${m}_tp${tp}; [ "$kernel" = bmm ] && name=${name}_bmm
                say "holdout steps $m tp $tp ($kernel experts)"
                timeout 200 python3 -m gpu.forward_step --model "$m" --tp "$tp" --grid holdout --moe-kernel "$kernel" \
                    --out "$out/$name.json" 2>&1 | tee "$out/$name.log" | tail -4
            done
        fi
        ;;
    graphs|pd|fp8bench)
        q=(); [ "$quick" = 1 ] && q=(--quick --allow-cpu)
        only=write,decode; [ "$part" = pd ] && only=pd; [ "$part" = fp8bench ] && only=fp8
        say "bench $only fp16 block 16"
        timeout 200 python3 benchmarks/bench_gpu.py "${q[@]}" --only "$only" --dtype float16 --block-size 16 \
            --json "$out/bench_${part}_fp16_b16.json" 2>&1 | tee "$out/bench_${part}_fp16_b16.log"
        ;;
    fp8)
        runs=$out/runs_fp8
        mkdir -p "$runs"
        src=(--num-gpu-blocks 300 --num-cpu-blocks 2048 --defrag-threshold 32)
        geometry=(--layers 32 --kv-heads 8 --head-dim 128 --q-per-kv 4)
        if [ "$quick" = 1 ]; then
            head -3 tests/golden/workloads/multi-turn.jsonl > "$runs/small.jsonl"
            src=("$runs/small.jsonl" --num-gpu-blocks 24 --num-cpu-blocks 64 --defrag-threshold 2)
            geometry=(--layers 1 --kv-heads 1 --head-dim 16 --q-per-kv 2)
        fi
        say "record fp8"
        kvsim run "${src[@]}" --preemption swap --record-ops --no-plots --out "$runs/run" | grep -E "engine steps"
        for dt in fp8:0.5,2 float16:1; do
            IFS=: read -r dtype scale <<< "$dt"
            say "replay $dtype"
            timeout 300 python3 -m sim.cli.app gpu-replay "$runs/run" --device $device "${geometry[@]}" --dtype "$dtype" \
                --kv-scale "$scale" --attention-layers 1 --save "$out/replay_fp8_$dtype.json" 2>&1 | grep -v "^step "
            echo "rc ${PIPESTATUS[0]}"
        done
        rm -rf "$runs"
        ;;
    profile)
        runs=$out/runs_profile
        mkdir -p "$runs"
        n=2000; [ "$quick" = 1 ] && n=40
        head -$n "$mooncake" > "$runs/trace.jsonl"
        blocks=20000; [ "$quick" = 1 ] && blocks=400
        say "record profile"
        kvsim run "$runs/trace.jsonl" --num-gpu-blocks $blocks --num-cpu-blocks $blocks --defrag-threshold 256 \
            --preemption swap --record-ops --no-plots --out "$runs/run" | grep -E "engine steps"
        geometry=(--layers 4 --kv-heads 1 --head-dim 128 --q-per-kv 4)
        [ "$quick" = 1 ] && geometry=(--layers 1 --kv-heads 1 --head-dim 16 --q-per-kv 2)
        say "profile replay (${PROFILE_S:-60} s)"
        spy=$(command -v py-spy || echo /tmp/kvsim-site/bin/py-spy)
        if [ ! -x "$spy" ]; then
            echo "profile: no py-spy (pip download py-spy into .whl/ and carry it): skipped"
            rm -rf "$runs"
            continue
        fi
        timeout $(( ${PROFILE_S:-60} + 60 )) "$spy" record -r 100 -d "${PROFILE_S:-60}" -f raw -o "$out/replay_profile.txt" -- \
            python3 -m sim.cli.app gpu-replay "$runs/run" --device $device "${geometry[@]}" --check touched \
            --attention-layers "${MOONCAKE_ATTENTION:-1}" --attention-sample "${MOONCAKE_SAMPLE:-2}" \
            2>&1 | grep "^step " | tail -2
        python3 benchmarks/spy_top.py "$out/replay_profile.txt" --top 30 | tee "$out/replay_profile_top.txt"
        rm -rf "$runs"
        ;;
    mooncake|hybrid)
        runs=$out/runs_$part
        mkdir -p "$runs"
        if [ "$part" = mooncake ]; then
            n=2000; [ "$quick" = 1 ] && n=40
            head -$n "$mooncake" > "$runs/trace.jsonl"
            if [ "$quick" = 1 ]; then
                cases=("default:--num-gpu-blocks 400 --num-cpu-blocks 400 --defrag-threshold 16 --preemption swap")
                geometry=(--layers 1 --kv-heads 1 --head-dim 16 --q-per-kv 2)
            else
                cases=("default:--num-gpu-blocks 20000 --num-cpu-blocks 20000 --defrag-threshold 256 --preemption swap")
                geometry=(--layers 4 --kv-heads 1 --head-dim 128 --q-per-kv 4)
            fi
            # decode attention compared on one layer (MOONCAKE_ATTENTION) for at most MOONCAKE_SAMPLE of a
            # step's ~20 decodes: the dense reference over each compared decode's whole context (~15k
            # tokens) held the replay to 44 steps a second on the H100 (fourth session's profile)
            check=(--check touched --attention-layers "${MOONCAKE_ATTENTION:-1}" --attention-sample "${MOONCAKE_SAMPLE:-2}")
        else
            n=80; [ "$quick" = 1 ] && n=6
            head -$n "$mooncake" > "$runs/trace.jsonl"
            gb=(3000 8000); [ "$quick" = 1 ] && gb=(800 3000)  # 2 and 1 of the 80 prompts do not fit
            cases=("gpt-oss-20b:--model gpt-oss-20b --num-gpu-blocks ${gb[0]}"
                   "gemma-3-27b:--model gemma-3-27b --num-gpu-blocks ${gb[1]}")
            geometry=(--layers 2 --kv-heads 2 --head-dim 64 --q-per-kv 4)
            [ "$quick" = 1 ] && geometry=(--layers 1 --kv-heads 1 --head-dim 16 --q-per-kv 2)
            check=(--check full --attention-layers 1)
        fi
        for c in "${cases[@]}"; do
            name=${c%%:*}
            read -ra opts <<< "${c#*:}"
            say "record $part $name"
            kvsim run "$runs/trace.jsonl" "${opts[@]}" --record-ops --no-plots --out "$runs/$name" \
                | grep -E "engine steps|evictions|preemptions|swapped|defrag moves|hit rate, tokens"
            say "replay $part $name"
            rt=300; [ "$part" = mooncake ] && rt=${REPLAY_TIMEOUT:-540}
            timeout "$rt" python3 -m sim.cli.app gpu-replay "$runs/$name" --device $device "${geometry[@]}" "${check[@]}" \
                --save "$out/replay_${part}_$name.json" 2>&1 | tee "$out/replay_${part}_$name.log" | grep -v "^step "
            echo "rc ${PIPESTATUS[0]}"  # the log keeps the progress lines: how far a cut-off replay got
            cp "$runs/$name/config.json" "$out/config_${part}_$name.json"
            cp "$runs/$name/summary.json" "$out/summary_${part}_$name.json"
        done
        rm -rf "$runs"
        ;;
    *) echo "unknown part $part (env tests bench calibrate steps replay holdout graphs pd mooncake profile fp8 fp8bench hybrid)"; exit 2 ;;
    esac
    say "$part took $((SECONDS - start)) s"
done
