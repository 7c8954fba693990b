#!/usr/bin/env bash
# Every GPU measurement of the project, in stages, on one machine:
#   bash bench/gpu.sh OUT tests ckpt load coldsweep coldimport kernels attention starts profile startprofile startprofile-kept firstlaunch firstlaunch-load prime serve-prime prime-order kvalloc firstprefill firstanatomy engine startenv serve serve-warm serve-add-cold serve-early serve-floors serve-cold naive-warm naive-cold scaleup serve-beside-load serve-cold-trickle startsplit
# OUT receives the logs and result files. The 7B random checkpoint and its packed
# copy are made once under /tmp/coldstart-bench and reused by every stage.
set -o pipefail
out=${1:?usage: bench/gpu.sh OUT STAGE...}; shift
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
W=/tmp/coldstart-bench
# Triton's kernel cache: empty at the first stage that compiles the 7B's kernels, so that
# stage's capture_s includes the compile; every later stage finds them cached
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/coldstart-triton-cache}
rc=0
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)   python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_loader.py tests/test_engine.py tests/test_server.py \
               tests/test_model.py tests/test_doctor.py tests/test_kernels.py tests/test_runtime.py tests/test_prime.py tests/test_early.py 2>&1 | tee "$out/gpu-tests.log" ;;
    ckpt)    python3 -c "import sys; sys.path.insert(0, '.'); from bench.load import ensure_checkpoint; from pathlib import Path; print(ensure_checkpoint(Path('$W'), 'llama-7b')[2])" ;;
    load)    python3 bench/load.py --out "$out" --no-sweep 2>&1 | tail -40 ;;
    kernels) python3 bench/kernel_sweep.py --out "$out/kernel-sweep.json" 2>&1 | tail -40 ;;
    attention) # the decode attention's paths and block sizes against the matmuls, every row read to its
             # own position, at its bucket's length and with one graph per batch size's whole-cache bound
             python3 bench/kernel_sweep.py --only attention --out "$out/attention-sweep.json" 2>&1 | tail -14 ;;
    starts)  # the replica's start in one process (bench/start_profile.py, its engine's start only under
             # cProfile), kernels kept: three starts' engine steps (first launches, graphs, the prime)
             python3 bench/start_profile.py $W/packed --scope engine-start > /dev/null 2>&1  # (compiles on a new node)
             for i in 1 2 3; do
               python3 bench/start_profile.py $W/packed --scope engine-start --out "$out/starts-$i.json" > /dev/null 2>&1
               python3 -c "import json, sys; d = json.load(open(sys.argv[1])); e = d['engine_stats']; p = d['phases_s']
print({k: p.get(k) for k in ('engine', 'engine_model', 'engine_graphs', 'read_copy')},
      {k: e.get(k) for k in ('graphs', 'capture_s', 'first_launch_s', 'first_launch_ms', 'first_prefill_s', 'prime_s')})" \
                 "$out/starts-$i.json"
             done ;;
    coldsweep) python3 bench/load.py --out "$out" --cold-sweep-only 2>&1 | tail -30 ;;
    profile) bash "$0" "$out" ckpt &&
             python3 bench/profile_decode.py $W/packed --out "$out/decode-profile.json" &&
             COLDSTART_TRITON=0 python3 bench/profile_decode.py $W/packed --out "$out/decode-profile-torch.json" &&
             COLDSTART_GEMV=torch COLDSTART_DECODE_ATTENTION=torch python3 bench/profile_decode.py $W/packed \
               --out "$out/decode-profile-fused-only.json" ;;
    engine)  python3 bench/engine.py $W/packed --max-seq-len 4096 --out "$out/engine.json" 2>&1 | tail -40 ;;
    serve)   python3 bench/serve.py --out "$out" --report "$out" > "$out/serve.log" 2>&1; r=$?
             grep -E "added->RUNNING|^\\|" "$out/serve.log"; (exit $r) ;;
    serve-warm|serve-add-cold) # the serve stage in two device calls: every kind with a warm page
             # cache, then (on the same machine) with a cold one, added to the first call's report
             # (warm: five rounds, ~460 s, since a host's Ray worker start drifts by seconds within a
             # run; cold: three, which already take ~370 s of the call's 600)
             if [ $stage = serve-warm ]; then a="--caches warm --repeat 5"; else a="--caches cold --merge $W/serve-partial.json"; fi
             # (SERVE_EXTRA: more arguments, e.g. --variant NAME=JSON without spaces)
             python3 bench/serve.py --out "$out" --report "$out" $a ${SERVE_EXTRA:-} > "$out/$stage.log" 2>&1; r=$?
             grep -E "added->RUNNING|^- " "$out/$stage.log"; (exit $r) ;;
    serve-early) # the replica's start with each of its newest steps left out in turn, warm page cache, three
             # rounds: coldstart-late without the worker setup hook's imports (deployments.early),
             # coldstart-eager capturing every graph before it serves (engine.lazy_graphs false),
             # beside minimal-cached and minimal-early (torch imported from the same hook)
             python3 bench/serve.py --out "$out" --kinds minimal-cached,minimal-early,coldstart,coldstart-late \
               --caches warm --repeat 3 --variant eager='{"engine": {"lazy_graphs": false}}' \
               > "$out/serve-early.log" 2>&1; r=$?
             grep -E "added->RUNNING|^- " "$out/serve-early.log"; (exit $r) ;;
    serve-floors) # coldstart beside both minimal replicas, warm page cache, five deploys each
             python3 bench/serve.py --out "$out" --kinds minimal,minimal-cached,coldstart --caches warm --repeat 5 \
               > "$out/serve-floors.log" 2>&1; r=$?
             grep -E "added->RUNNING|^- " "$out/serve-floors.log"; (exit $r) ;;
    serve-cold) # minimal and coldstart with a cold page cache only, with this run's own disk figure
             python3 bench/serve.py --out "$out" --kinds minimal,minimal-cached,coldstart --caches cold > "$out/serve-cold.log" 2>&1; r=$?
             grep -E "added->RUNNING|^\\|" "$out/serve-cold.log"; (exit $r) ;;
    naive-warm|naive-cold) # the article's naive path (minutes per start: one device call each),
             # added to the serve stage's report
             python3 bench/serve.py --out "$out" --report "$out" --naive --kinds naive --caches ${stage#naive-} \
               --merge $W/serve-partial.json > "$out/serve-$stage.log" 2>&1; r=$?
             grep -E "added->RUNNING|^\\|" "$out/serve-$stage.log"; (exit $r) ;;
    startprofile) # the replica's start under cProfile (main thread), with and without the overlapped build
             python3 bench/start_profile.py $W/packed --out "$out/start-profile.json" --pstats "$out/start-profile.pstats" 2>&1 | tail -20
             COLDSTART_BUILD_DURING_LOAD=0 python3 bench/start_profile.py $W/packed \
               --out "$out/start-profile-sequential.json" 2>&1 | tail -20 ;;
    startprofile-kept) # the start under cProfile as on a node that ran the model before: a first start
             # keeps the kernels' verdicts and fills the caches, the second is the one profiled
             python3 bench/start_profile.py $W/packed 2>&1 | tail -1
             python3 bench/start_profile.py $W/packed --top 80 --out "$out/start-profile-kept.json" 2>&1 | tail -4
             python3 bench/start_profile.py $W/packed --scope engine-start --top 120 \
               --out "$out/start-profile-kept-engine.json" 2>&1 | tail -22 ;;
    firstlaunch) # the engine's first eager decode launches (batch 1: 0.3-0.4 s, batch 2: 0.25 s, the
             # others 25-60 ms) under torch.profiler, as on a node that ran the model before; then the
             # same start with CUDA's modules loaded when the context is made instead of at first use
             python3 bench/start_profile.py $W/packed 2>&1 | tail -1
             python3 bench/start_profile.py $W/packed --profiler torch --top 60 --out "$out/first-launch-torch-profile.json" \
               2>&1 | grep -v METRIC | tail -28
             CUDA_MODULE_LOADING=EAGER python3 bench/start_profile.py $W/packed --scope engine-start \
               --out "$out/first-launch-eager-modules.json" 2>&1 | tail -2
             # the Python side of the same (Triton's launcher: its cache keys, binaries, modules)
             python3 bench/start_profile.py $W/packed --scope engine-start --top 60 \
               --out "$out/first-launch-cprofile.json" 2>&1 | grep -v METRIC | tail -18
             # and with torch's own kernels only (no Triton): is it Triton's first launches?
             COLDSTART_TRITON=0 python3 bench/start_profile.py $W/packed --scope engine-start \
               --out "$out/first-launch-no-triton.json" 2>&1 | tail -2 ;;
    firstlaunch-load) # the first launches under torch.profiler beside the warm load and after it
             # (COLDSTART_BUILD_DURING_LOAD=0): what the load's copies add (module loads?)
             python3 bench/start_profile.py $W/packed > /dev/null 2>&1  # (compiles on a new node)
             for b in 1 0; do
               COLDSTART_BUILD_DURING_LOAD=$b python3 bench/start_profile.py $W/packed --profiler torch --top 60 \
                 --out "$out/first-launch-load-$b.json" 2>&1 | grep -v METRIC | tail -3
             done ;;
    prime)   # the replica's start in this process with the engine's kernels primed on a side thread
             # (deployments.prime, the default) and without, two rounds, alternating (COLDSTART_PRIME
             # also takes a list of its steps); first the steps' own costs in a fresh process
             python3 bench/prime_steps.py $W/packed --out "$out/prime-steps.json" 2>&1 | tail -26
             python3 bench/start_profile.py $W/packed --scope engine-start > /dev/null 2>&1  # (compiles on a new node)
             for i in 1 2; do for p in 1 0; do
               COLDSTART_PRIME=$p python3 bench/start_profile.py $W/packed --scope engine-start \
                 --out "$out/prime-$p-$i.json" 2>&1 | tail -1 | sed "s/^/prime=$p: /"
             done; done ;;
    prime-order) # the prime's steps in the engine's order of need (decode first: the first launches
             # come before the first prefills) against the default order and against none: two
             # rounds outside Ray, then three in Ray beside the cached floor
             D=decode_1,decode_2,prefill,prefill_batch,sample
             python3 bench/start_profile.py $W/packed --scope engine-start > /dev/null 2>&1  # (compiles on a new node)
             for i in 1 2; do for p in 1 $D 0; do
               COLDSTART_PRIME=$p python3 bench/start_profile.py $W/packed --scope engine-start \
                 --out "$out/prime-order-$([ $p = $D ] && echo decodefirst || echo $p)-$i.json" 2>&1 | tail -1 | sed "s/^/prime=$p: /"
             done; done
             python3 bench/serve.py --out "$out" --kinds minimal-cached,coldstart --caches warm --repeat 3 \
               --variant decodefirst="{\"env\": {\"COLDSTART_PRIME\": \"$D\"}}" \
               --variant noprime='{"env": {"COLDSTART_PRIME": "0"}}' > "$out/serve-prime-order.log" 2>&1; r=$?
             grep -E "added->RUNNING|deploys|^- " "$out/serve-prime-order.log"; (exit $r) ;;
    serve-prime) # the same as Ray deploys it: four warm rounds beside the cached floor
             python3 bench/serve.py --out "$out" --kinds minimal-cached,coldstart --caches warm --repeat 4 \
               --variant noprime='{"env": {"COLDSTART_PRIME": "0"}}' > "$out/serve-prime.log" 2>&1; r=$?
             grep -E "added->RUNNING|deploys|^- " "$out/serve-prime.log"; (exit $r) ;;
    kvalloc) python3 bench/kv_alloc.py --out "$out/kv-alloc.json" ;;
    firstprefill) python3 bench/first_prefill.py $W/packed --out "$out/first-prefill.json" 2>&1 | grep -v METRIC | tail -12 ;;
    firstanatomy) python3 bench/first_prefill.py $W/packed --anatomy --out "$out/first-prefill-anatomy.json" 2>&1 \
               | grep -v METRIC | tail -12 ;;
    coldimport) python3 bench/cold_import.py $W/packed --out "$out/cold-import.json" ;;
    startenv) # the engine's start under the replica's settings, one at a time (graph capture took
             # 2.1 s in a Ray replica and 0.4 s here); the last with an empty Triton cache
             a="bench/engine.py $W/packed --max-seq-len 4096 --start-only --no-hf"
             python3 $a 2>&1 | grep START
             PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 $a 2>&1 | grep START
             CUDA_MODULE_LOADING=LAZY python3 $a 2>&1 | grep START
             OMP_NUM_THREADS=1 python3 $a 2>&1 | grep START
             TRITON_CACHE_DIR=$(mktemp -d) python3 $a 2>&1 | grep START ;;
    scaleup) python3 bench/serve.py --out "$out" --scale-up-only 2>&1 | tail -40 ;;
    serve-beside-load) # the engine's first launches beside the warm load's copies
             # (bench/results/runs/first-launch-beside-load.json): coldstart as deployed, with fewer
             # reader threads, and with the engine built only after the load; five rounds beside
             # the cached floor (bench/results/runs/serve-v15-beside-load.json also deployed the
             # load held until the first launches, an option taken back since: +0.50 s)
             python3 bench/serve.py --out "$out" --kinds minimal-cached,coldstart --caches warm --repeat 5 \
               --variant threads4='{"load": {"threads": 4}}' \
               --variant after='{"env": {"COLDSTART_BUILD_DURING_LOAD": "0"}}' \
               > "$out/serve-beside-load.log" 2>&1; r=$?
             grep -E "added->RUNNING|deploys|^- " "$out/serve-beside-load.log"; (exit $r) ;;
    serve-cold-trickle) # a cold replica's trickle at 1 MiB (default), 4 MiB and off, three rounds
             # beside the cached floor, with this run's own disk figure
             python3 bench/serve.py --out "$out" --kinds minimal-cached,coldstart --caches cold --repeat 3 \
               --variant trickle4='{"load": {"trickle_read_bytes": 4194304}}' \
               --variant notrickle='{"load": {"trickle": false}}' \
               > "$out/serve-cold-trickle.log" 2>&1; r=$?
             grep -E "added->RUNNING|deploys|^- " "$out/serve-cold-trickle.log"; (exit $r) ;;
    startsplit) # where coldstart's warm start goes beyond the minimal replica's: the imports'
             # source compiles (twice: whether the first run's .pyc files are found), the engine's
             # start outside Ray, then in Ray beside the minimal replica with one part left out at a time
             python3 bench/import_compile.py --out "$out/import-compile-1.json" | head -40
             python3 bench/import_compile.py --out "$out/import-compile-2.json" | grep -E "compiled|import_"
             python3 bench/engine.py $W/packed --max-seq-len 4096 --start-only --no-hf 2>&1 | grep START
             python3 bench/serve.py --out "$out" --kinds minimal,coldstart --caches warm \
               --variant notriton='{"env": {"COLDSTART_TRITON": "0"}}' \
               --variant nopad='{"engine": {"prefill_padding": false}}' \
               --variant onegraph='{"engine": {"graph_batch_sizes": [16], "kv_len_buckets": [4096]}}' \
               --variant pyc='{"env": {"PYTHONPYCACHEPREFIX": "/tmp/coldstart-pyc", "PYTHONDONTWRITEBYTECODE": ""}}' \
               > "$out/serve-split.log" 2>&1; r=$?
             grep -E "added->RUNNING|^- " "$out/serve-split.log"; (exit $r) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  r=$?; [ $r -ne 0 ] && { echo "=== $stage failed: rc=$r"; rc=$r; }
done
echo "=== done $(date +%T)"
exit $rc
