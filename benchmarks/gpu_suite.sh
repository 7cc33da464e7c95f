#!/usr/bin/env bash
# The GPU measurements docs/benchmarks.md reports, as named steps, each under its own time limit:
#
#   OUT=/tmp/out bash benchmarks/gpu_suite.sh tests dense moe
#
# On a fresh device machine run `setup` first (installs carried wheels from .whl/ and .whl-replay/, then
# this checkout, and unpacks a carried .triton-cache.tgz; benchmarks/gpu_wheels.sh fetches the wheels); end a
# call with `save-cache` to get Triton's compiled kernels back for the next call. Every step writes
# $OUT/<step>.txt (and JSON where the benchmark writes one) and prints its tail. Steps:
#   tests      GPU kernel and engine tests (compiled Triton kernels against their torch references)
#   kernels    Triton vs flashinfer paged decode / prefill against the copy and matmul rates
#   fused      each fused path (KIVI encode, SnapKV window vote, probe attention, RoPE + KV store) vs its torch path
#   sweep      our decode / prefill kernels over a grid of launch configurations (which to make the default)
#   codeckernels  the fp8 / KIVI-4 / KIVI-2 decode kernels beside the dense one at the engine's 32K / 128K
#              batches, over tile sizes, warps, stages and splits (coded time vs the bytes it saves)
#   moekernels the fused MoE kernel at T = 8 / 32 decode tokens (Qwen3-30B-A3B layer) against its routed
#              experts' bytes at the copy rate, over block sizes, warps and stages
#   moeglm     the same for GLM-4.7-Flash's MoE layer (64 experts, top-4, the shared expert in its slot) over a wider
#              grid (16-column tiles, 256-deep, up to 5 stages)
#   dense      Llama-3.1-8B shape decode roofline at bs1@4K, bs8@4K, bs4@32K (single steps overlapped and not),
#              HF transformers in the same run
#   prefill    prefill TFLOP/s of a 32K prompt (and 4 x 8K): triton vs triton+flashinfer
#   dense8     the dense cases with --decode-steps 8 (8 decode steps per schedule, one host sync)
#   dense8hf   the 4K cases with --decode-steps 8, overlapped windows and not, HF transformers in the same run
#   dense8fused  bs1 / bs8 @ 4K and bs4 @ 32K with --decode-steps 8, fused decode linears off then on, HF once
#   decodelinear  the fused decode linears' launch sweep alone (fusedlinears: the sweep, then the engine with it)
#   mlatma     the MLA decode kernel in value halves / through TMA against the gather kernel, alone and in `mla`
#   moesum     the `mla` cases with the experts' top-k sum as its own launch, then inside the down GEMM
#   mla32rows  GLM-4.7-Flash's projections swept at 32 rows into this GPU's table, then the `mla` cases with the
#              halves kernel's default and with AGENTRT_MLA_TMA=0
#   mlancu     Nsight Compute on the MLA split kernels (gather, halves, halves by TMA) at bs8 / bs32 @ 4K
#   decodelinearmla  the same over GLM-4.7-Flash's attention projections and LM head (against cuBLAS); writes the
#              winners into this GPU's tuned table in the checkout (copied to $OUT: commit it from there)
#   router     the DeepSeek-V3 router at 8 / 32 decode rows (GLM-4.7-Flash's gate, the norm inside) over its launch
#              options, against the unfused norm + fp32 GEMM + routing
#   fusedlinears  benchmarks/decode_linear.py (RMSNorm / SiLU-and-mul fused before the decode projections vs
#              our norm + cuBLAS, over launch configurations), then the 4K cases with them in the engine
#   overlap    overlapped decode windows vs not (--overlap-decode both): MoE bs8 / bs32 @ 4K, dense bs4 @ 32K
#   splits     our paged decode kernel over split counts beside flashinfer's (TC on / off)
#   backendtests  every backend-agreement and per-layer-length graph test, and flashinfer's MLA wrapper against
#              the torch backend, in one process (most of a call)
#   mla        GLM-4.7-Flash shape decode roofline at bs8 / bs32 @ 4K (latent attention, MoE)
#   mlapdl     the same with programmatic dependent launch off, then on, in one call
#   mlasnap128k  SnapKV(4096) vs dense on the GLM-4.7-Flash shape at 128K, largest batches, decode only
#   deltadecode  a DeltaNet layer's decode: the in-place kernels against gather + fla's recurrent kernel + store
#   chainturn  a SnapKV chain turn split into prefill attention, vote and compaction (torch.profiler)
#   mlasweep   the Triton MLA decode kernel's launch grid and split counts beside flashinfer's MLA wrapper
#   mlasweepfp8  the same over E4M3 latent rows (which launch the coded tile should default to)
#   mlasweeprows the MLA decode kernel with its products transposed (keys_as_rows: the rows' tile as wgmma's M)
#              against the default orientation, 64-row tiles, bs8 / bs32 @ 4K
#   mlaheads   the MLA decode kernel's gather and halves launches (3 and 5 stages) at 16 heads (DeepSeek-V2-Lite's
#              16-head tile) and 128 (DeepSeek-V3's two 64-head tiles), beside flashinfer's MLA wrapper
#   mlaprefill absorbed vs expanded MLA prefill (one layer's attention at GLM-4.7-Flash's shape)
#   mlaprefill128k  the same for a 128K prompt's 16K-token chunks at 64K and 112K contexts (expanded in blocks)
#   mlafp8     the Triton MLA decode kernel over fp8 latent rows vs bf16 rows (GLM-4.7-Flash shape, bs32 @ 4K)
#   hybrid     Qwen3.6-27B shape (gated DeltaNet hybrid, fla-core) decode at bs8 @ 4K
#   hybridsnap128k  SnapKV(4096) vs dense on the Qwen3.6-27B shape at 128K, largest batches, decode only
#   replayprofile  the 24-session pressure replay of one configuration (CONFIG) with a window of its engine steps
#              under torch.profiler (benchmarks/replay_profile.py): busy / idle GPU time by step kind
#   hostcopies SnapKV chains under the 24-session pressure replay with turn-end host copies on, then off
#   gputests   the GPU cases added since the last `tests` run: expanded MLA prefill, MLA decode, RMSNorm modes,
#              chain loads on a side stream, fla-core and a hybrid chain's turn-end state copy on a side stream,
#              launches stepped down for shared memory (fitting_launch), E4M3 latent rows
#   moe        Qwen3-30B-A3B shape decode roofline (fused MoE), with the host phases of a decode step; then
#              the same with --decode-steps 8
#   profilesteps  whole decode steps under torch.profiler (MoE bs8@4K, dense bs1@4K): device busy / idle
#              time per step, what the host was doing in the longest idle gaps, GPU time per kernel
#   profilenew the same for the hybrid (Qwen3.6-27B bs8 @ 4K) and MLA (GLM-4.7-Flash bs8 @ 4K, bs4 @ 128K) shapes
#   select     Quest / OmniKV vs dense at 128K, matched batch (decode graphs capture the selection)
#   selectwin  the same with --decode-window 8 (8 decode steps per schedule) for all three
#   evict      KVzip / R-KV vs dense at 4K, matched batch 32
#   evictmax   dense and R-KV at 4K, each at its largest batch (one run each)
#   kvzipmax   KVzip the same, up to 300 s (a reconstruction probe per admitted request: a forward over its
#              context, attention in the prefill and received-attention kernels)
#   codec32k   fp8, KIVI-4, Palu vs dense at 32K (each at its largest batch, then at dense's batch)
#   snapcodec32k  SnapKV(4096) and SnapKV(4096) + KIVI-4 vs dense at 32K (largest and matched batch)
#   codec128k, snapcodec128k  the same at 128K
#   codecmatched32k, codecmatched128k  dense at its largest batch, then fp8, KIVI-4 and SnapKV(4096) + KIVI-4 at
#              dense's batch only (--matched-only)
#   snapkivi128k  SnapKV(4096) + KIVI-4 at its largest batch, 128K
#   moe32      the MoE bs32 @ 4K case with 8 decode steps per schedule
# Each benchmark prints one JSON line per finished run, so a step cut by its limit keeps what finished.
#   snapwin    SnapKV(4096) vs dense at 128K, each at its largest batch, with --decode-window 8
#   retro      RetroInfer (cluster-gather kernel) vs dense at 32K, matched batch
#   replay     16 agent sessions x 30 turns: dense + prefix cache, SnapKV + Chain Cache, dense + lag pruning
#   replaypressure  12 sessions x 12 turns with the traces' think times on a 6000-page pool: more KV than the
#              pool holds for the stateless route (its prefix cache must evict what it re-sends) and for dense
#              chains (idle ones move to the host tier), while SnapKV's compacted chains mostly fit:
#              dense + prefix cache, SnapKV + Chain Cache + tiers, dense + Chain Cache + tiers
#   resume32k  benchmarks.chain_resume: a 32K-token chain's next turn (256 new tokens) resumed on the device,
#              loaded from host memory, from its disk file (page cache dropped), or recomputed
#   serving32k  benchmarks.serving: 32K-token prompts, 1024 output tokens, closed loop at the largest
#              concurrency the KV pool sustains, dense / SnapKV(4096) / Quest / OmniKV / SnapKV(4096) + fp8, each in
#              its own process: request throughput, output tok/s, TTFT and TPOT with prefill and admission timed
#   serving128k   the same with 114688-token prompts (the shape's 131072 positions leave room for 16K outputs)
#   serving128klong  114688-token prompts with OUTPUT (default 4096) output tokens, 8 requests, METHODS (default
#              dense) and REPEATS (default 3) from the environment: one method a call. The serving steps take
#              SHAPE (default llama-3.1-8b): SHAPE=glm-4.7-flash / qwen3.6-27b OUTPUT=1024 gives the MLA and
#              hybrid models' 128K-in / 1K-out figures. OUTPUT=16384 does not fit a
#              10-minute call: dense decodes ~6 such requests at once at ~30 ms a step, ~8 minutes a wave
# benchmarks.throughput and sparse_decode report the median of 3 runs (--repeats), so their limits hold three.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
SPARSE="python -m benchmarks.sparse_decode --shape llama-3.1-8b --decode-steps 16"

run() {  # run NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 override=LIMIT_$1
    limit=${!override:-$limit}  # LIMIT_<name>=SECONDS in the environment overrides a run's limit
    shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%FT%TZ)"
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "=== $name rc=$? $(date -u +%FT%TZ)"
    grep -v "capturing\|it/s\]\| PASSED \|PytestBenchmark\|warner(" "$OUT/$name.txt" | tail -n 25
}

sweep_decode_linear() {  # the fused decode linears' launch sweep (steps decodelinear and fusedlinears)
    run decodelinear 440 python -m benchmarks.decode_linear --json "$OUT/decodelinear.json"
}

for step in "$@"; do
    case $step in
    setup)  # the device image lacks the server's packages and flashinfer: wheels carried beside the checkout
        for dir in .whl .whl-replay; do
            ls $dir/*.whl > /dev/null 2>&1 && python -m pip install -q --no-deps $dir/*.whl
        done
        python -m pip install -q --no-deps --no-index --no-build-isolation -e . > "$OUT/setup.txt" 2>&1
        echo "=== setup rc=$?"
        # Triton's compiled kernels from an earlier call (same image and GPU), carried as .triton-cache.tgz
        if [ -f .triton-cache.tgz ]; then mkdir -p ~/.triton && tar xzf .triton-cache.tgz -C ~/.triton; fi ;;
    save-cache)  # Triton's kernel cache for the next call (carry it back as .triton-cache.tgz), if small enough
        tar czf /tmp/triton-cache.tgz -C ~/.triton cache 2>/dev/null \
            && [ "$(stat -c %s /tmp/triton-cache.tgz)" -lt 15000000 ] && cp /tmp/triton-cache.tgz "$OUT/"
        ls -la "$OUT"/triton-cache.tgz 2>/dev/null || echo "no Triton cache saved" ;;
    tests)  # the kernel and engine tests on 8 workers (72 s on an H200, 2026-12-04); the backend tests are `backendtests`
        run tests 300 python -m pytest -v -n 8 --tb=short -rf --timeout 200 -p no:cacheprovider \
            tests/kernels/test_triton_selection.py tests/kernels/test_quant_kernels.py \
            tests/kernels/test_cluster_decode.py tests/kernels/test_moe_router.py tests/kernels/test_triton_kernels.py \
            tests/engine/test_decode_steps.py tests/kernels/test_asym_encode.py tests/kernels/test_fused_paths.py \
            tests/kernels/test_decode_linear.py tests/engine/test_fused_decode_linears.py tests/engine/test_overlap_decode.py \
            tests/kernels/test_mla_decode_kernel.py tests/kernels/test_mla_prefill_kernel.py tests/kernels/test_mla_backend.py \
            tests/kernels/test_fla_gated_delta.py tests/kernels/test_latent_width_kernels.py tests/engine/test_host_copies.py \
            tests/kernels/test_gated_delta_step.py tests/kernels/test_gated_norm.py \
            tests/engine/test_mla_expanded_prefill.py tests/kernels/test_latent_inputs.py \
            tests/kernels/test_grouped_router.py tests/kernels/test_kv_compact.py tests/kernels/test_head_matmul.py \
            tests/kernels/test_arrival_counts.py ;;
    fused)  # the fused paths against the torch code they replace (KIVI encode, SnapKV vote, probe, RoPE+store)
        run fused 150 python -m benchmarks.fused_paths --json "$OUT/fused.json" ;;
    kernels)
        run kernels 200 python benchmarks/attention_kernels.py --json "$OUT/kernels.json" ;;
    moekernels)
        run moekernels 240 python -m benchmarks.moe_kernels --json "$OUT/moekernels.json" ;;
    moeglm)
        run moeglm 300 python -m benchmarks.moe_kernels --shape glm-4.7-flash --grid wide --json "$OUT/moeglm.json" ;;
    codeckernels)
        run codeckernels 300 python -m benchmarks.codec_kernels --json "$OUT/codeckernels.json" ;;
    splits)  # our decode kernel over split counts beside flashinfer (TC on and off), one process
        run splits 240 python benchmarks/attention_kernels.py --splits --json "$OUT/splits.json" ;;
    sweep)
        run sweep 400 python benchmarks/attention_kernels.py --sweep --json "$OUT/sweep.json" ;;
    dense)  # one decode step a schedule, each launched before the last is read and not (one engine), HF once
        run dense 560 python -m benchmarks.throughput --shape llama-3.1-8b --cases 1@4096,8@4096,4@32768 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --overlap-decode both --hf --json "$OUT/dense.json" ;;
    densehf)  # the dense cases with the GPU defaults (8 decode steps a schedule, overlapped, fused decode linears),
        # HF eager and HF static cache + torch.compile in the same run (395 s on an H200, 2026-12-05)
        run densehf 580 python -m benchmarks.throughput --shape llama-3.1-8b --cases 1@4096,8@4096,4@32768 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --decode-steps 8 --hf --json "$OUT/densehf.json" ;;
    prefill)  # a 32K prompt's prefill, Triton's kernel against flashinfer's (triton+flashinfer), one process each
        for backend in triton triton+flashinfer; do
            tag=prefill_${backend//+/_}  # plain file names
            run "$tag" 300 python -m benchmarks.throughput --shape llama-3.1-8b --cases 1@32768,4@8192 \
                --decode-tokens 8 --max-num-batched-tokens 16384 --attention-backend $backend --json "$OUT/$tag.json"
        done ;;
    dense8)  # the same cases with 8 decode steps back to back per schedule (host work off the GPU's path)
        run dense8 400 python -m benchmarks.throughput --shape llama-3.1-8b --cases 1@4096,8@4096,4@32768 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --decode-steps 8 --json "$OUT/dense8.json" ;;
    dense8hf)  # the two 4K cases with 8 decode steps per schedule, overlapped windows and not (one engine), HF
        # transformers in the same run
        run dense8hf 560 python -m benchmarks.throughput --shape llama-3.1-8b --cases 1@4096,8@4096 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --decode-steps 8 --overlap-decode both --hf --json "$OUT/dense8hf.json" ;;
    fusedlinears)  # the fused decode linears over launches beside norm / SiLU + cuBLAS, then the engine at 4K
        # without and with them (each projection at its best launch from the sweep), one process
        sweep_decode_linear
        run fusedlinears 400 python -m benchmarks.throughput --shape llama-3.1-8b --cases 1@4096,8@4096 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --decode-steps 8 --fused-decode-linears both \
            --decode-linear-launches "$OUT/decodelinear.json" --json "$OUT/fusedlinears.json" ;;
    dense8fused)  # the dense cases with 8 decode steps a schedule, without then with the fused decode linears
        # (the H200's tuned table), HF transformers in the same run
        run dense8fused 580 python -m benchmarks.throughput --shape llama-3.1-8b --cases 1@4096,8@4096,4@32768 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --decode-steps 8 --fused-decode-linears both --hf \
            --json "$OUT/dense8fused.json" ;;
    decodelinearmla)  # the same sweep over GLM-4.7-Flash's projections at 1, 8 and 32 rows: fused launches vs cuBLAS
        # (its rows are what tuned/decode_linear_<GPU>.json holds: the engine's fused path takes the winners)
        run decodelinearmla 440 python -m benchmarks.decode_linear --model glm-4.7-flash --rows 1,8,32 \
            --json "$OUT/decodelinearmla.json" --write-table "$(date -u +%F), python -m benchmarks.decode_linear \
--model glm-4.7-flash --write-table (docs/benchmarks.md)"
        cp agentrt_kernels/triton/tuned/decode_linear_*.json "$OUT/" ;;
    router)  # the router's two launches over their launch options at 8 and 32 rows
        run router 200 python -m benchmarks.router_kernels --json "$OUT/router.json" ;;
    decodelinear)  # the launch sweep alone
        sweep_decode_linear ;;
    overlap)  # overlapped decode windows vs not, in one engine each: MoE bs8 / bs32 and dense bs4 @ 32K
        run overlapmoe 400 python -m benchmarks.throughput --shape qwen3-30b-a3b --cases 8@4096,32@4096 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --decode-steps 8 --overlap-decode both --json "$OUT/overlapmoe.json"
        run overlapdense 300 python -m benchmarks.throughput --shape llama-3.1-8b --cases 4@32768 --decode-tokens 64 \
            --max-num-batched-tokens 16384 --decode-steps 8 --overlap-decode both --json "$OUT/overlapdense.json" ;;
    backendtests)  # every backend test in one process (on 8 workers, workers died while others JIT-built
        # flashinfer; one process got through half the file in 260 s with flashinfer's first build: most of a call)
        MAX_JOBS=${MAX_JOBS:-8} run backendtests 540 python -m pytest -v -p no:xdist --tb=short -rf --timeout 200 \
            -p no:cacheprovider tests/kernels/test_gpu_backends.py tests/kernels/test_flashinfer_mla.py ;;
    moe)
        run moe 360 python -m benchmarks.throughput --shape qwen3-30b-a3b --cases 8@4096,32@4096 --decode-tokens 32 \
            --max-num-batched-tokens 16384 --json "$OUT/moe.json"
        run moe8 360 python -m benchmarks.throughput --shape qwen3-30b-a3b --cases 8@4096,32@4096 --decode-tokens 32 \
            --max-num-batched-tokens 16384 --decode-steps 8 --json "$OUT/moe8.json" ;;
    mla)  # GLM-4.7-Flash shape (latent attention, 64 experts): decode roofline at bs8 / bs32 @ 4K (weights read:
        # dense layer, routed and shared experts; plus latent KV), 8 decode steps per schedule (70 s on an H200)
        run mla 560 python -m benchmarks.throughput --shape glm-4.7-flash --cases 8@4096,32@4096 --decode-tokens 128 \
            --max-num-batched-tokens 16384 --decode-steps 8 --json "$OUT/mla.json" ;;
    mlapdl)  # the `mla` cases with programmatic dependent launch off (AGENTRT_PDL=0), then on (the GPU default)
        for pdl in 0 1; do
            export AGENTRT_PDL=$pdl
            run mlapdl$pdl 300 python -m benchmarks.throughput --shape glm-4.7-flash \
                --cases 8@4096,32@4096 --decode-tokens 128 --max-num-batched-tokens 16384 --decode-steps 8 \
                --json "$OUT/mlapdl$pdl.json"
        done
        unset AGENTRT_PDL ;;
    mlatma)  # the MLA decode kernel in value halves (AGENTRT_MLA_TMA=1 / 0 on / off; TMA reads where a tile is one page's rows)
        # against the gather kernel: the kernel alone on 16- and 64-row pages, then the `mla` cases on each
        for page in 16 64; do
            run mlatmasweep$page 120 python -m benchmarks.mla_decode_sweep --cases 8@4096,32@4096 --page-size $page \
                --grid '{"block_h":[32],"block_n":[64],"num_warps":[8],"num_stages":[3,5],"tma":[false,true]}' \
                --splits 8,16,32 --json "$OUT/mlatmasweep$page.json"
        done
        for case in "16 0" "16 1" "64 1" "64 0"; do
            set -- $case
            AGENTRT_MLA_TMA=$2 run mlatma_p$1_t$2 200 python -m benchmarks.throughput --shape glm-4.7-flash \
                --cases 8@4096,32@4096 --decode-tokens 128 --max-num-batched-tokens 16384 --decode-steps 8 \
                --page-size $1 --json "$OUT/mlatma_p$1_t$2.json"
        done ;;
    moesum)  # the `mla` cases with the experts' top-k sum in its own launch, then inside the down GEMM's
        for fold in 0 1; do
            AGENTRT_MOE_SUM_IN_DOWN=$fold run moesum$fold 200 python -m benchmarks.throughput --shape glm-4.7-flash \
                --cases 8@4096,32@4096 --decode-tokens 128 --max-num-batched-tokens 16384 --decode-steps 8 \
                --json "$OUT/moesum$fold.json"
        done ;;
    mla32rows)  # GLM-4.7-Flash's projections swept at 32 rows into this GPU's table (commit it from $OUT), then
        # the `mla` cases with the halves kernel's default (both batches take it) and with the gather kernel throughout
        run mla32rowssweep 300 python -m benchmarks.decode_linear --model glm-4.7-flash --rows 32 \
            --json "$OUT/mla32rowssweep.json" --write-table "$(date -u +%F), python -m benchmarks.decode_linear \
--model glm-4.7-flash --rows 32 --write-table (docs/benchmarks.md)"
        cp agentrt_kernels/triton/tuned/decode_linear_*.json "$OUT/"
        for tma in "" 0; do
            AGENTRT_MLA_TMA=$tma run mla32rows_tma$tma 200 python -m benchmarks.throughput --shape glm-4.7-flash \
                --cases 8@4096,32@4096 --decode-tokens 128 --max-num-batched-tokens 16384 --decode-steps 8 \
                --json "$OUT/mla32rows_tma$tma.json"
        done ;;
    mlancu)  # Nsight Compute on the MLA split kernels, PDL off (a kernel's time without its wait for the one before):
        # the gather and halves kernels on 16-row pages, the halves by TMA on 64-row ones, bs8 and bs32 @ 4K each
        for c in 'gather 16 {"tma":false}' 'halves 16 {"tma":true}' 'tma 64 {"tma":true}'; do
            set -- $c
            AGENTRT_PDL=0 run mlancu_$1 200 /usr/local/cuda/bin/ncu --kernel-name regex:_mla_split --launch-skip 2 \
                --launch-count 4 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
                --section Occupancy python -m benchmarks.mla_decode_sweep --cases 8@4096,32@4096 --page-size $2 \
                --launch-only "$3" --launches 3
        done ;;
    mlasnap128k)  # SnapKV(4096) vs dense on the GLM-4.7-Flash shape at 128K, each at its largest batch (decode only)
        # one request admitted at a time (each holds its 128K latent rows, ~7 GB, until SnapKV compacts it), one
        # timed window each (what a call holds on a card whose weights leave ~15 GB of KV)
        run mlasnap128k 560 python -m benchmarks.sparse_decode --shape glm-4.7-flash --decode-steps 16 \
            --context 128000 --max-batch 128 --admit-group 1 --admit-time-limit 300 --repeats 1 \
            --methods 'dense;snapkv:{"budget":4096}' --json "$OUT/mlasnap128k.json" ;;
    hybrid)  # Qwen3.6-27B shape (3 of 4 layers gated DeltaNet on fla-core's kernels) bs8 @ 4K (150 s on an H200);
        # 128 decode tokens: a timed window holds a one-time cost (docs/benchmarks.md, 2026-12-07) that 32 overweigh
        run hybrid 560 python -m benchmarks.throughput --shape qwen3.6-27b --cases 8@4096 --decode-tokens 128 \
            --max-num-batched-tokens 16384 --json "$OUT/hybrid.json" ;;
    hybridsnap128k)  # SnapKV(4096) vs dense on the Qwen3.6-27B shape at 128K, each at its largest batch (decode only;
        # SnapKV applies to the full-attention layers, each request also holds its linear layers' states). The
        # state slots (one per --max-batch, ~155 MB each) are allocated up front: on an 80 GB card, whose weights
        # leave ~16 GB, 128 of them leave no room for one 128K request (8.4 GB), so there MAX_BATCH defaults to
        # 16, admitted one at a time (16 slots, one 128K prompt being admitted and 16 compacted requests fit)
        mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        max_batch=${MAX_BATCH:-128} group=2
        [ "${mem:-0}" -lt 100000 ] && max_batch=${MAX_BATCH:-16} group=1
        run hybridsnap128k 560 python -m benchmarks.sparse_decode --shape qwen3.6-27b --decode-steps 16 \
            --context 128000 --max-batch "$max_batch" --admit-group $group --admit-time-limit 300 --repeats 1 \
            --methods 'dense;snapkv:{"budget":4096}' --json "$OUT/hybridsnap128k.json" ;;
    profilesteps)  # device busy vs idle time across whole engine steps, and GPU time per kernel, for the two
        # decode cases below their roofline goal on 2026-12-02 (MoE bs8 @ 4K: 0.61, dense bs1 @ 4K: 0.69)
        run profile_moe8 150 python benchmarks/profile_decode.py --shape qwen3-30b-a3b --batch 8 --context 4096 \
            --steps 8 --json "$OUT/profile_moe8.json"
        run profile_dense1 150 python benchmarks/profile_decode.py --shape llama-3.1-8b --batch 1 --context 4096 \
            --steps 8 --json "$OUT/profile_dense1.json"
        # windows of 8 decode steps, overlapped (the default on a GPU): what idle time is left between them
        run profile_dense8w 150 python benchmarks/profile_decode.py --shape llama-3.1-8b --batch 8 --context 4096 \
            --steps 8 --decode-steps 8 --json "$OUT/profile_dense8w.json" ;;
    profilenew)  # GPU time per kernel of the hybrid and MLA decode steps and of MLA decode at 128K (their
        # fractions of the copy rate: docs/benchmarks.md)
        run profile_hybrid8 200 python benchmarks/profile_decode.py --shape qwen3.6-27b --batch 8 --context 4096 \
            --steps 8 --json "$OUT/profile_hybrid8.json"
        run profile_mla8 150 python benchmarks/profile_decode.py --shape glm-4.7-flash --batch 8 --context 4096 \
            --steps 8 --decode-steps 8 --json "$OUT/profile_mla8.json"
        run profile_mla128k 200 python benchmarks/profile_decode.py --shape glm-4.7-flash --batch 4 --context 128000 \
            --steps 8 --json "$OUT/profile_mla128k.json" ;;
    select)
        run select 300 $SPARSE --context 128000 --max-batch 16 \
            --methods 'dense;quest:{"token_budget":4096};omnikv:{"token_budget":4096}' --json "$OUT/select.json" ;;
    selectwin)  # the same with 8 decode steps per schedule for all three
        run selectwin 300 $SPARSE --context 128000 --max-batch 16 --decode-window 8 \
            --methods 'dense;quest:{"token_budget":4096};omnikv:{"token_budget":4096}' --json "$OUT/selectwin.json" ;;
    evict)
        run evict_matched 200 $SPARSE --context 4096 --max-batch 32 --admit-group 16 \
            --methods 'dense;kvzip:{"budget":1024};rkv:{"budget":1024,"buffer":128}' --json "$OUT/evict_matched.json" ;;
    evictmax | kvzipmax)  # largest batch at 4K, one run per method; KVzip's admission probes every request
        specs=(dense 'rkv:{"budget":1024,"buffer":128}'); limit=120
        [ "$step" = kvzipmax ] && specs=('kvzip:{"budget":1024}') && limit=300
        for spec in "${specs[@]}"; do
            name=${spec%%:*}_largest
            run "$name" $limit $SPARSE --context 4096 --max-batch 512 --admit-group 64 --methods "$spec" \
                --json "$OUT/$name.json"
        done ;;
    codec32k | codec128k)
        context=32768; [ "$step" = codec128k ] && context=128000
        run "$step" 500 $SPARSE --context $context --max-batch 256 --page-size 32 --admit-group 16 --match-batch \
            --methods 'dense;dense+fp8;dense+kivi:{"bits":4};dense+palu' --json "$OUT/$step.json" ;;
    snapcodec32k | snapcodec128k)
        context=32768; [ "$step" = snapcodec128k ] && context=128000
        run "$step" 500 $SPARSE --context $context --max-batch 256 --page-size 32 --admit-group 16 --match-batch \
            --methods 'dense;snapkv:{"budget":4096};snapkv:{"budget":4096}+kivi:{"bits":4}' --json "$OUT/$step.json" ;;
    snapwin)  # SnapKV(4096) vs dense at 128K, largest batch, 8 decode steps per schedule for both
        run snapwin 500 $SPARSE --context 128000 --max-batch 256 --admit-group 16 --decode-window 8 \
            --methods 'dense;snapkv:{"budget":4096}' --json "$OUT/snapwin.json" ;;
    codecmatched32k | codecmatched128k)  # dense at its largest batch, then fp8 / KIVI-4 / SnapKV + KIVI-4 at it
        context=32768; [ "$step" = codecmatched128k ] && context=128000
        run "$step" 420 $SPARSE --context $context --max-batch 256 --page-size 32 --admit-group 16 --matched-only \
            --methods 'dense;dense+kivi:{"bits":4};snapkv:{"budget":4096}+kivi:{"bits":4};dense+fp8' \
            --json "$OUT/$step.json" ;;
    snapkivi128k)  # SnapKV(4096) + KIVI-4 alone at its largest batch, 128K (compare with codecmatched128k's dense);
        # 2026-12-02: ~2.6 s of admission a request before the coded reference's larger blocks, numpy slot
        # ranges and the fused vote over decoded keys -- give it a call of its own
        run "$step" 560 $SPARSE --context 128000 --max-batch 256 --page-size 32 --admit-group 16 --admit-time-limit 400 \
            --methods 'snapkv:{"budget":4096}+kivi:{"bits":4}' --json "$OUT/$step.json" ;;
    moe32)  # the MoE bs32 case alone, 8 decode steps per schedule
        run moe32 300 python -m benchmarks.throughput --shape qwen3-30b-a3b --cases 32@4096 --decode-tokens 32 \
            --max-num-batched-tokens 16384 --decode-steps 8 --json "$OUT/moe32.json" ;;
    retro)
        run retro 300 $SPARSE --context 32768 --max-batch 8 \
            --methods 'dense;retroinfer:{}' --json "$OUT/retro.json" ;;
    replay)
        run replay 560 python -c 'import sys; from agentrt.cli import main; sys.exit(main())' replay run \
            --shape llama-3.1-8b --load-format dummy --sessions 16 --turns 30,30 --think-scale 0 \
            --max-num-batched-tokens 8192 --configs dense-prefix,snapkv-chain,dense-chain-lag \
            --snapkv-config '{"budget": 4096}' --out "$OUT/$step" ;;
    replaypressure)  # more KV than the pool holds: 12 sessions x 12 turns (~26K tokens each at the end, 311K in
        # all) over a 6000-page pool (96K tokens), with the traces' think times; the tiers' host copy is 64 GiB.
        # Larger loads one configuration a call on the same warm machine (CONFIGS=..., SESSIONS, TURNS, PAGES),
        # joined by `agentrt replay report <dir>/partial.jsonl ...`; ENGINE_OPTIONS='{"chain_async_loads": true}'
        # passes EngineConfig fields to every configuration; REPEATS runs rounds of all configurations (medians)
        run replaypressure 560 python -c 'import sys; from agentrt.cli import main; sys.exit(main())' replay run \
            --shape llama-3.1-8b --load-format dummy --sessions "${SESSIONS:-12}" --turns "${TURNS:-12,12}" \
            --num-pages "${PAGES:-6000}" --think-scale 1 --max-num-batched-tokens 8192 --repeats "${REPEATS:-1}" \
            --configs "${CONFIGS:-dense-prefix,snapkv-chain-tiers,dense-chain-tiers}" \
            --engine-options "${ENGINE_OPTIONS:-{\}}" --snapkv-config '{"budget": 4096}' --out "$OUT/$step" ;;
    replayprofile)  # the pressure replay (24 sessions) of one configuration (CONFIG, default snapkv-chain-tiers) with a
        # window of its engine step() calls (from FIRST, default 400; STEPS, default 100: the SnapKV run makes ~1660
        # calls, one decode step a call) under torch.profiler: device busy and idle time by step kind, the host ops
        # in the gaps, GPU time by kernel
        run replayprofile 400 python -m benchmarks.replay_profile --first-step "${FIRST:-400}" --steps "${STEPS:-100}" \
            --json "$OUT/replayprofile.json" -- --shape llama-3.1-8b --load-format dummy --sessions 24 --turns 12,12 \
            --num-pages 6000 --think-scale 1 --max-num-batched-tokens 8192 --configs "${CONFIG:-snapkv-chain-tiers}" \
            --snapkv-config '{"budget": 4096}' --out "$OUT/replayprofile" ;;
    hostcopies)  # SnapKV chains under replaypressure's 24-session load with turn-end host copies on, then off, in
        # one call (each its own run directory and table; ~2 minutes each)
        for copies in true false; do
            run hostcopies_$copies 240 python -c 'import sys; from agentrt.cli import main; sys.exit(main())' \
                replay run --shape llama-3.1-8b --load-format dummy --sessions 24 --turns 12,12 --num-pages 6000 \
                --think-scale 1 --max-num-batched-tokens 8192 --configs snapkv-chain-tiers \
                --snapkv-config '{"budget": 4096}' --engine-options "{\"chain_host_copies\": $copies}" \
                --out "$OUT/hostcopies_$copies"
        done ;;
    gputests)  # the GPU cases added since the last `tests` run: expanded MLA prefill, the MLA decode launch, RMSNorm,
        # launches stepped down for shared memory, E4M3 latent rows
        run gputests 380 python -m pytest -v -n 4 --tb=short -rf --timeout 200 -p no:cacheprovider \
            tests/engine/test_mla_expanded_prefill.py tests/kernels/test_mla_prefill_bench.py \
            tests/kernels/test_mla_decode_kernel.py tests/kernels/test_triton_kernels.py tests/engine/test_async_loads.py \
            tests/kernels/test_latent_inputs.py tests/kernels/test_grouped_router.py tests/kernels/test_kv_compact.py \
            tests/engine/test_mla_gpu_parity.py tests/kernels/test_triton_selection.py \
            tests/engine/test_fused_decode_linears.py tests/kernels/test_fitting_launch.py tests/engine/test_mla_fp8.py
        # fla-core's tests in a process of their own: a worker crashed in them while four shared the card
        run gputestsfla 150 python -m pytest -v --tb=short -rf --timeout 120 -p no:cacheprovider \
            tests/kernels/test_fla_gated_delta.py ;;
    deltadecode)  # one DeltaNet layer's decode step: the in-place kernels against gather + fla's recurrent + store
        run deltadecode 200 python -m benchmarks.gated_delta_decode --json "$OUT/deltadecode.json" ;;
    chainturn)  # a SnapKV chain turn (16K history compacted to 4096, 2048 new tokens) split into prefill attention,
        # vote and compaction under torch.profiler
        run chainturn 240 python -m benchmarks.chain_turn_profile --shape llama-3.1-8b --history 16384 \
            --new-tokens 2048 --json "$OUT/chainturn.json" ;;
    mlasweep)  # the Triton MLA decode kernel over launch configurations and split counts, beside flashinfer's MLA
        # (the three fastest launches each over split counts; ~100 s on an H100 with a warm Triton cache)
        run mlasweep 400 python -m benchmarks.mla_decode_sweep --cases 8@4096,32@4096 \
            --grid '{"block_h": [32, 64], "block_n": [16, 32, 64], "num_warps": [4, 8], "num_stages": [2, 3]}' \
            --splits 8,16,24,32,48,64 --json "$OUT/mlasweep.json" ;;
    mlasweeprows)  # the products transposed (wgmma on the rows' tile) beside the heads-as-rows launches
        run mlasweeprows 400 python -m benchmarks.mla_decode_sweep --cases 8@4096,32@4096 \
            --grid '{"block_h": [32], "block_n": [64], "num_warps": [4, 8], "num_stages": [2, 3, 4], "keys_as_rows": [false, true]}' \
            --splits 8,16,24,32 --json "$OUT/mlasweeprows.json" ;;
    mlaheads)  # the 16- and 64-head tiles (GLM-4.7-Flash's 20 heads take the 32-head tile, step `mla32rows`)
        run mlaheads16 250 python -m benchmarks.mla_decode_sweep --heads 16 --cases 8@4096,32@4096,8@32768 \
            --grid '{"block_h":[16],"block_n":[32,64],"num_warps":[4,8],"num_stages":[2,3,5],"tma":[false,true]}' \
            --splits 8,16,33 --json "$OUT/mlaheads16.json"
        run mlaheads128 250 python -m benchmarks.mla_decode_sweep --heads 128 --cases 8@4096,32@4096,8@32768 \
            --grid '{"block_h":[64],"block_n":[16,32],"num_warps":[8],"num_stages":[3,5],"tma":[false,true]}' \
            --splits 4,8,16 --json "$OUT/mlaheads128.json" ;;
    mlasweepfp8)  # the same over E4M3 latent rows (kv_storage fp8), beside bf16 rows at their default launch
        run mlasweepfp8 400 python -m benchmarks.mla_decode_sweep --coded --json "$OUT/mlasweepfp8.json" ;;
    mlaprefill)  # absorbed vs expanded MLA prefill (one layer's attention, GLM-4.7-Flash shape), chunks 512-8K
        run mlaprefill 200 python -m benchmarks.mla_prefill --json "$OUT/mlaprefill.json" ;;
    mlaprefill128k)  # the same for the 16K-token chunks of a 128K prompt: contexts past one 1 GiB block of expansion
        run mlaprefill128k 300 python -m benchmarks.mla_prefill --chunks 16384 --contexts 65536,114688 \
            --json "$OUT/mlaprefill128k.json" ;;
    mlafp8)  # the Triton MLA decode kernel over fp8 latent rows against bf16 rows, GLM-4.7-Flash shape, 4K
        run mlafp8 300 python -m benchmarks.sparse_decode --shape glm-4.7-flash --decode-steps 16 --context 4096 --max-batch 32 --admit-group 32 \
            --methods 'dense;dense+fp8' --repeats 3 --json "$OUT/mlafp8.json" ;;
    resume32k)
        run resume32k 300 python -m benchmarks.chain_resume --shape llama-3.1-8b --context 32768 --new-tokens 256 \
            --drop-page-cache --json "$OUT/resume32k.json" ;;
    serving32k | serving128k)
        input=32768; [ "$step" = serving128k ] && input=114688
        run "$step" 580 python -m benchmarks.serving --shape "${SHAPE:-llama-3.1-8b}" --input-len $input --output-lens 1024 \
            --num-requests 32 --max-num-batched-tokens 16384 --json "$OUT/$step.json" ;;
    serving128klong)  # one method a call: METHODS='snapkv:{"budget":4096}' OUT=... bash benchmarks/gpu_suite.sh ...
        # (REQUESTS: how many 128K requests, 8 unless set)
        # (--max-batch 8: no more run at once than the 8 requests; a hybrid allocates a state slot per max-batch)
        run "$step" 580 python -m benchmarks.serving --shape "${SHAPE:-llama-3.1-8b}" --input-len 114688 \
            --output-lens "${OUTPUT:-4096}" --num-requests "${REQUESTS:-8}" --max-batch 8 --max-num-batched-tokens 16384 \
            --methods "${METHODS:-dense}" --repeats "${REPEATS:-3}" --json "$OUT/$step.json" ;;
    *)
        echo "unknown step $step" >&2
        exit 2 ;;
    esac
done
