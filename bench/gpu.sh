#!/usr/bin/env bash
# Every GPU measurement of the project, in stages, on one machine:
#   bash bench/gpu.sh OUT STAGE...
# Stages: tests ckpt load load-warm coldsweep kernels attention startprofile engine serve-warm
#         serve-add-cold naive-warm naive-cold scaleup fresh-node restructure-serve restructure-engine
#         tp-rank tp-serve paged paged-start profile lookahead lookahead-http wide http-options http-clients capacity
#         http-where engine-knobs prefill-kernels engine-ab
# OUT receives the logs and result files. The 7B random checkpoint and its packed copy are
# made once under /tmp/coldstart-bench and reused by every stage.
set -o pipefail
out=${1:?usage: bench/gpu.sh OUT STAGE...}; shift
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
W=/tmp/coldstart-bench
# Triton's kernel cache: empty at the first stage that compiles the 7B's kernels, so that
# stage's first start includes the compile; every later stage finds them cached
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/coldstart-triton-cache}
# the serving side as it was before its restructure, for the restructure-* stages: a plain
# checkout (git archive f91d0c1 | tar -x -C .baseline)
B=${BASELINE:-$PWD/.baseline}
# serve_config.gpu.yaml's engine (paged, 128 sequences of up to 4096 positions, 2048-token prefill
# chunks): as bench/engine.py's arguments, and as bench/throughput.py's --engine
E="--max-seq-len 4096 --no-hf --max-slots 128 --kv-cache paged --prefill-chunk 2048"
GPU_ENGINE='{"kv_cache": "paged", "max_slots": 128, "max_seq_len": 4096, "prefill_chunk": 2048}'
# engine_alone CONCURRENCY: that engine alone at CONCURRENCY (a,b,...): its tokens/s at each and the
# work of its 128-concurrent run
engine_alone() {
  python3 bench/engine.py $W/packed $E --concurrency $1 --out "$out/engine-paged.json" 2>&1 \
    | grep -E "^(tokens_per_s_b(${1//,/|})|work_b128) " | sed 's/^/engine /'
}
# engine_ab RUNS PROFILE PATTERN: that engine alone at 1, 64 and 128 concurrent, BASELINE (a plain
# checkout of the commit before a change) beside this tree, alternating, RUNS times each (the first
# run of each with --profile where PROFILE is 1); the lines of its output that match PATTERN
engine_ab() {
  local r=0 run side d p log
  for run in $(seq $1); do for side in before after; do
    d=$PWD; [ $side = before ] && d=$B
    p=""; [ "$2" = 1 ] && [ $run = 1 ] && p=--profile
    log=$W/engine-$side-$run.log
    (cd "$d" && PYTHONPATH=$d:$PYTHONPATH python3 bench/engine.py $W/packed $E --concurrency 1,64,128 $p \
      --out "$out/engine-$side-$run.json") > $log 2>&1 || { r=1; tail -20 $log; }
    grep -E "$3" $log | sed "s/^/$side $run /"
  done; done
  return $r
}
rc=0
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)   python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$out/gpu-tests.log" | tail -15 ;;
    ckpt)    python3 -c "import sys; sys.path.insert(0, '.'); from bench.load import ensure_checkpoint; from pathlib import Path; print(ensure_checkpoint(Path('$W'), 'llama-7b')[2])" ;;
    load)    python3 bench/load.py --out "$out" --no-sweep 2>&1 | tail -40 ;;
    load-warm) python3 bench/load.py --out "$out" --warm-only --repeats 5 2>&1 | tail -3 ;;
    coldsweep) python3 bench/load.py --out "$out" --cold-sweep-only 2>&1 | tail -30 ;;
    kernels) python3 bench/kernel_sweep.py --out "$out/kernel-sweep.json" 2>&1 | tail -40 ;;
    attention) python3 bench/kernel_sweep.py --only attention --out "$out/attention-sweep.json" 2>&1 | tail -14 ;;
    startprofile) # the replica's start under cProfile (main thread), as on a node that ran the model
             # before: a first start keeps the kernels' verdicts and fills the caches
             python3 bench/start_profile.py $W/packed 2>&1 | tail -1
             python3 bench/start_profile.py $W/packed --top 80 --out "$out/start-profile.json" 2>&1 | tail -4 ;;
    engine)  python3 bench/engine.py $W/packed --max-seq-len 4096 --out "$out/engine.json" 2>&1 | tail -40 ;;
    serve-warm|serve-add-cold) # the report in two device calls: every kind with a warm page cache
             # (five rounds: a host's Ray worker start drifts by seconds within a run), then on the same
             # machine with a cold one (three rounds), added to the first call's report
             if [ $stage = serve-warm ]; then a="--caches warm --repeat 5"; else a="--caches cold --merge $W/serve-partial.json"; fi
             # (SERVE_EXTRA: more arguments, e.g. --kinds ... or --variant NAME=JSON without spaces)
             python3 bench/serve.py --out "$out" --report "$out" $a ${SERVE_EXTRA:-} > "$out/$stage.log" 2>&1; r=$?
             grep -E "added->RUNNING|^- " "$out/$stage.log"; (exit $r) ;;
    naive-warm|naive-cold) # the article's naive path (minutes per start: one device call each)
             python3 bench/serve.py --out "$out" --report "$out" --naive --kinds naive --caches ${stage#naive-} \
               --merge $W/serve-partial.json > "$out/serve-$stage.log" 2>&1; r=$?
             grep -E "added->RUNNING|^\\|" "$out/serve-$stage.log"; (exit $r) ;;
    scaleup) python3 bench/serve.py --out "$out" --scale-up-only 2>&1 | tail -40 ;;
    fresh-node) # a new node's first replica: before each deploy Triton's cache (and the verdicts and
             # bytecode kept beside it) emptied, the project's written bytecode removed and the page
             # cache dropped; coldstart with the kernels shipped in the packed model (`coldstart
             # kernels`, run first), without them, and the minimal replica, three rounds; merged into
             # the serve-warm stage's report where one ran on this machine. First the installed
             # packages' bytecode is compiled, as the image's build does (this machine's packages
             # carry none: without it every fresh start compiles torch, Triton and Ray from source)
             python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
               ${PYTHONPATH//:/ } > /dev/null 2>&1
             m=""; [ -f $W/serve-partial.json ] && m="--merge $W/serve-partial.json"
             python3 bench/serve.py --out "$out" --report "$out" --kinds ${FRESH_KINDS:-minimal,coldstart,coldstart-nokernels} \
               --caches fresh --repeat ${FRESH_REPEAT:-3} $m ${SERVE_EXTRA:-} > "$out/fresh-node.log" 2>&1; r=$?
             grep -E "added->RUNNING|^- new node" "$out/fresh-node.log"; (exit $r) ;;
    restructure-serve) # a replica's start in Ray before the restructure and after it, each beside the
             # minimal replica in its own run (three warm rounds); after: also with the collector's pause
             # left out (the first run of this stage also left out the prime and the GIL switch
             # interval, both removed since: docs/measurements.md)
             (cd "$B" && PYTHONPATH=$B:$PYTHONPATH python3 bench/serve.py --out "$out/before" --kinds minimal,coldstart \
               --caches warm --repeat 3) > "$out/serve-before.log" 2>&1; r1=$?
             grep -E "added->RUNNING" "$out/serve-before.log" | sed 's/^/before /'
             python3 bench/serve.py --out "$out/after" --kinds minimal,coldstart --caches warm --repeat 3 \
               --variant gcon='{"env": {"COLDSTART_PAUSE_GC": "0"}}' > "$out/serve-after.log" 2>&1; r2=$?
             grep -E "added->RUNNING" "$out/serve-after.log" | sed 's/^/after  /'; (exit $((r1 | r2))) ;;
    restructure-engine) # the engine (batch-1 decode, 16 concurrent) and the warm load, before and after
             (cd "$B" && PYTHONPATH=$B:$PYTHONPATH python3 bench/engine.py $W/packed --max-seq-len 4096 --no-hf \
               --out "$out/engine-before.json") > "$out/engine-before.log" 2>&1; r1=$?
             python3 bench/engine.py $W/packed --max-seq-len 4096 --no-hf --out "$out/engine-after.json" \
               > "$out/engine-after.log" 2>&1; r2=$?
             grep -hE "^(decode_ms_per_token_b1|tokens_per_s_b(1|16)|capture_warmup_s) " "$out/engine-before.log" | sed "s/^/before /"
             grep -hE "^(decode_ms_per_token_b1|tokens_per_s_b(1|16)|capture_warmup_s) " "$out/engine-after.log" | sed "s/^/after  /"
             python3 bench/load.py --out "$out/before" --warm-only --repeats 5 --tree "$B" 2>&1 | tail -1
             python3 bench/load.py --out "$out/after" --warm-only --repeats 5 2>&1 | tail -1; (exit $((r1 | r2))) ;;
    tp-rank) # one GPU: rank 0 of a 70B-shaped TP=4 split pack (TP_LAYERS of its 80 layers, to fit the
             # disk), loaded warm and cold; the ranks' channel per decode call; and a whole rank's batch-1
             # decode step, the all-reduce left out
             python3 bench/tp.py rank-load --out "$out" --layers ${TP_LAYERS:-20} 2>&1 | tail -12
             python3 bench/tp.py channel --out "$out" 2>&1 | tail -12  # lockstep's cost per decode call, on this host's cores
             rm -rf $W/llama3-70b-tp4-*  # (tens of GB: the next stages need the disk)
             python3 bench/engine.py --random llama3-70b --tp-rank 4 --max-seq-len 4096 --no-hf \
               --out "$out/engine-tp4-rank.json" 2>&1 | grep -E "^(weight_gb|decode_ms_per_token_b1|tokens_per_s_b(1|16)) " ;;
    tp-serve) # several GPUs: a 13B-shaped TP=2 replica, and where there are 4 GPUs a 70B-shaped TP=4 one
             n=$(python3 -c "import torch; print(torch.cuda.device_count())")
             python3 bench/tp.py serve --out "$out" --shape llama2-13b --tp 2 2>&1 | tail -8; r=$?
             # (TP_LAYERS: the 70B with fewer of its 80 layers, where the disk cannot hold its checkpoint and pack)
             if [ "$n" -ge 4 ]; then python3 bench/tp.py serve --out "$out" --shape llama3-70b --tp 4 \
                 ${TP_LAYERS:+--layers $TP_LAYERS} 2>&1 | tail -8
               r=$((r | $?)); fi; (exit $r) ;;
    paged)   # the paged KV cache beside the static one, the engine alone: static with 16 slots (the
             # static default's figure) and with 128 of 1024 positions (what fits), paged as
             # serve_config.gpu.yaml has it (128 of 4096, 2048-token prefill chunks, the reserve the
             # engine derives), prefix reuse on and off behind a shared system prompt, a mixed load
             # beyond the cache; then the paged replica through Ray Serve's HTTP front at 64 and 128
             # concurrent (128 in, 128 out; eight files in all, what a device run brings back)
             python3 bench/engine.py $W/packed --max-seq-len 4096 --no-hf --max-slots 16 --concurrency 1,16 \
               --out "$out/engine-static-16.json" 2>&1 | grep -E "^(decode_ms_per_token_b1|tokens_per_s_b[0-9]+) " | sed 's/^/static16  /'
             python3 bench/engine.py $W/packed --max-seq-len 1024 --no-hf --max-slots 128 --concurrency 32,64,128 \
               --out "$out/engine-static-128.json" 2>&1 | grep -E "^tokens_per_s_b[0-9]+ " | sed 's/^/static128 /'
             python3 bench/engine.py $W/packed $E --concurrency 1,16,32,64,128 --out "$out/engine-paged-128.json" 2>&1 \
               | grep -E "^(decode_ms_per_token_b1|tokens_per_s_b[0-9]+|work_b(64|128)|capture_warmup_s|reserve_gib|prefill_peak(_reserved)?_gib) " \
               | sed 's/^/paged128  /'
             for pc in "" --no-prefix-cache; do  # 64 chats behind one 1024-token system prompt
               python3 bench/engine.py $W/packed $E $pc --shared-prefix 1024 --concurrency 64 \
                 --out "$out/engine-paged-shared${pc:+-off}.json" 2>&1 \
                 | grep -E "^tokens_per_s_b64 " | sed "s/^/shared1024${pc:+ off} /"; done
             # the same 64 behind a system prompt the cache has not seen (one computes it, the others share it)
             python3 bench/engine.py $W/packed $E --shared-prefix 1024 --new-prefix --concurrency 64 \
               --out "$out/engine-paged-shared-new.json" 2>&1 | grep -E "^tokens_per_s_b64 " | sed "s/^/shared1024 new /"
             # a mixed load more than the cache holds at once: 256 prompts of 32-3000 tokens (preemptions,
             # no request lost)
             python3 bench/engine.py $W/packed ${E/--max-slots 128/--max-slots 256} --prompt-lens 32,3000 --concurrency 256 \
               --out "$out/engine-paged-mixed.json" 2>&1 | grep -E "^tokens_per_s_b256 |preemptions|prefill_peak" | sed 's/^/mixed256  /'
             # (each burst's line: the engine's steps, shared prefills and busy time in it, and the
             # requests' time outside the engine, beside the engine run's work_b64/128 above)
             python3 bench/throughput.py --packed $W/packed --out "$out" --concurrency 64,128 \
               --engine "$GPU_ENGINE" 2>&1 \
               | grep -E "concurrent:|tokens_per_s_c" | sed "s/^/http /" ;;
    paged-start) # the replica's start in Ray with the paged engine of serve_config.gpu.yaml beside the
             # static one of 16 slots, three warm rounds each
             python3 bench/serve.py --out "$out/paged-start" --kinds minimal,coldstart --caches warm --repeat 3 \
               --variant paged='{"engine":{"kv_cache":"paged","max_slots":128,"prefill_chunk":2048}}' \
               > "$out/paged-start.log" 2>&1; r=$?
             grep -E "added->RUNNING" "$out/paged-start.log"; (exit $r) ;;
    profile) # where a step's time goes at 128 concurrent: the paged attention beside the static one
             # (kernels alone), then the engine's decode steps' device time against their wall time
             # and the loop thread's busiest functions, static and paged, and paged with longer
             # prefill chunks
             python3 bench/kernel_sweep.py --only paged --out "$out/paged-attention-sweep.json" 2>&1 | grep -E "^paged"
             for v in "static 1024 512" "paged 4096 512" "paged 4096 2048"; do set -- $v
               python3 bench/engine.py $W/packed --max-seq-len $2 --no-hf --max-slots 128 --kv-cache $1 \
                 --prefill-chunk $3 --concurrency 128 --profile --out "$out/profile-$1-$3.json" 2>&1 \
                 | grep -E "^(profile |tokens_per_s_b128 |  *[0-9/]+ +[0-9.]+ +[0-9.]+ +[0-9.]+)" | head -24 \
                 | sed "s/^/$1-$3 /"; done ;;
    http-options) # the paged engine of serve_config.gpu.yaml alone, then through Ray Serve's HTTP front with
             # Ray Serve's defaults and with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (its replicas' own HTTP servers, user
             # code on the replica's event loop, request logs buffered), each in its own Ray instance
             engine_alone 64,128
             for env in "" RAY_SERVE_THROUGHPUT_OPTIMIZED=1; do
               python3 bench/throughput.py --packed $W/packed --out "$out" --concurrency 64,128 ${env:+--env $env} \
                 --engine "$GPU_ENGINE" 2>&1 \
                 | grep -E "concurrent:|tokens_per_s_c" | sed "s/^/http${env:+ $env} /"; done ;;
    http-clients) # http-options at 128 concurrent with the requests sent by 8 client processes from one instant
             # (bench/throughput.py --clients 8): Ray Serve's throughput-optimized mode first, then its defaults
             engine_alone 128
             for env in RAY_SERVE_THROUGHPUT_OPTIMIZED=1 ""; do
               python3 bench/throughput.py --packed $W/packed --out "$out" --concurrency 128 --rounds 2 --clients 8 \
                 ${env:+--env $env} --engine "$GPU_ENGINE" \
                 2>&1 | grep -E "concurrent:" | sed "s/^/http${env:+ $env} /"; done ;;
    http-where) # where a burst through Ray Serve's HTTP front loses time against the engine alone: the paged
             # engine of serve_config.gpu.yaml alone at 128 concurrent (its busy time split into prefill and
             # decode), then through the HTTP front (8 client processes) four bursts (and so with each of
             # HTTP_ENVS, NAME=VALUE words, in the environment Ray starts in), then two more with the replica's
             # /stats sampled every 20 ms (when the whole burst was in the engine); each in its own Ray instance.
             # HTTP_SWITCH_MS=N adds a variant, twice, alternating with the defaults: Python's switch interval at
             # N ms in every Ray process (a sitecustomize on their PYTHONPATH)
             engine_alone 128
             envs=${HTTP_ENVS:-}
             if [ -n "${HTTP_SWITCH_MS:-}" ]; then
               mkdir -p $W/switch && echo "import sys; sys.setswitchinterval($HTTP_SWITCH_MS / 1000)" > $W/switch/sitecustomize.py
               envs="$envs PYTHONPATH=$W/switch:$PYTHONPATH '' PYTHONPATH=$W/switch:$PYTHONPATH"; fi
             i=0; for env in "" $envs; do env=${env#\'\'}; i=$((i + 1))
               python3 bench/throughput.py --packed $W/packed --out "$out/http-$i" --concurrency 128 --clients 8 --rounds 4 \
                 ${env:+--env $env} --engine "$GPU_ENGINE" 2>&1 | grep -E "concurrent:" | awk -v l="http ${env:-defaults}" '{print l, $0}'
             done
             python3 bench/throughput.py --packed $W/packed --out "$out/sampled" --concurrency 128 --clients 8 --rounds 2 \
               --sample-s 0.02 --engine "$GPU_ENGINE" 2>&1 | grep -E "concurrent:" | sed "s/^/http sampled /" ;;
    engine-knobs) # the paged engine of serve_config.gpu.yaml at 64 and 128 concurrent, then with 32-position
             # KV blocks, then with 4096-token prefill chunks (32 fresh 128-token prompts a forward)
             for v in "" "--kv-block-size 32" "--prefill-chunk 4096"; do
               python3 bench/engine.py $W/packed $E $v --concurrency 64,128 --out "$out/engine${v// /}.json" 2>&1 \
                 | grep -E "^(tokens_per_s_b(64|128)|work_b128) " | sed "s/^/engine${v:+ $v} /"; done ;;
    capacity) # what the capacity policy reads on a GPU: the paged replica of serve_config.gpu.yaml through
             # Ray Serve's HTTP front, 128 requests of 3,000-token prompts at once (more than its cache holds),
             # its /stats sampled every 0.5 s (capacity share, running, waiting, free blocks)
             python3 bench/throughput.py --packed $W/packed --out "$out" --concurrency 128 --rounds 1 --prompt-len 3000 \
               --sample-s 0.5 --engine "$GPU_ENGINE" \
               2>&1 | grep -E "concurrent:" ;;
    engine-ab) # the paged engine of serve_config.gpu.yaml at 1, 64 and 128 concurrent, BASELINE (a plain checkout
             # of the commit before a change) beside this tree, alternating, AB_RUNS (default 1) times each
             engine_ab ${AB_RUNS:-1} 0 "^(tokens_per_s_b(64|128)|decode_ms_per_token_b1|ttft_ms_b1|work_b128) " ;;
    prefill-kernels) # a shared prefill's device time by kernel: 16 fresh 128-token prompts in one forward (the
             # engine's 2048-token chunk), then 32 (a 4096-token one)
             for rows in 16 32; do python3 bench/prefill_kernels.py $W/packed --rows $rows \
               --out "$out/prefill-kernels-$rows.json" 2>&1 | grep -vE "USDT|^\[" | head -22; done ;;
    wide)    # a 128-row decode step's parts: the projections through cuBLAS, the paged attention at the
             # engine benchmark's lengths (defaults and the attention sweep's configs)
             python3 bench/kernel_sweep.py --only wide --out "$out/wide-sweep.json" 2>&1 | grep -E "^wide" ;;
    lookahead|lookahead-http) # the engine's loop with each step launched before the last one's tokens
             # are read, beside the loop before it (BASELINE: a plain checkout of the commit before it), with the
             # paged engine of serve_config.gpu.yaml: the engine alone at 64 and 128 concurrent (two runs of
             # each side, alternating; the first with its decode steps' device time against their wall time),
             # or (lookahead-http) through Ray Serve's HTTP front, each side in its own Ray instance
             G="^(tokens_per_s_b(1|64|128)|work_b128|profile (tokens_per_s|wall_ms_per_step|decode_device_ms_per_step|decode_device_share|prefill_device_share)) "
             r=0
             if [ $stage = lookahead ]; then engine_ab 2 1 "$G" || r=1
             else for side in before after; do
               d=$PWD; [ $side = before ] && d=$B
               (cd "$d" && PYTHONPATH=$d:$PYTHONPATH python3 bench/throughput.py --packed $W/packed --out "$out/http-$side" \
                 --concurrency 64,128 --engine "$GPU_ENGINE") 2>&1 \
                 | grep -E "concurrent:|tokens_per_s_c" | sed "s/^/$side /" || r=1
             done; fi; (exit $r) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  r=$?; [ $r -ne 0 ] && { echo "=== $stage failed: rc=$r"; rc=$r; }
done
echo "=== done $(date +%T)"
exit $rc
