#!/usr/bin/env bash
# The project's GPU measurements, in ten stages, on one machine:
#   bash bench/gpu.sh OUT STAGE...
# Stages: tests load engine kernels serve fresh-node http tp fetch quant
# Each stage writes one results file, OUT/STAGE.json: the stage's command, host, GPU, commit and
# time, and each of its runs' own JSON under "parts" (bench/results.py). Its logs and the runs' own
# files go to OUT/STAGE/. A stage that fails leaves OUT/STAGE.json as it was.
#   bash bench/gpu.sh bench/results STAGE...
# updates the tree's figures and bench/RESULTS.md (git keeps the STAGE.json files only).
# A stage's variants are environment variables, listed at each stage and recorded in its command.
# The 7B random checkpoint and its packed copy are made once under /tmp/coldstart-bench and reused.
set -o pipefail
STAGES="tests load engine kernels serve fresh-node http tp fetch quant"
out=${1:?usage: bash bench/gpu.sh OUT STAGE... (stages: $STAGES)}; shift
for stage in "$@"; do  # every name checked before the first stage runs
  case " $STAGES " in *" $stage "*) ;; *) echo "unknown stage $stage (stages: $STAGES)"; exit 2 ;; esac
done
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
W=${BENCH_WORK:-/tmp/coldstart-bench}  # the checkpoints (BENCH_WORK: elsewhere)
# Triton's kernel cache: empty at the first stage that compiles the 7B's kernels, so that
# stage's first start includes the compile; every later stage finds them cached
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/coldstart-triton-cache}
# serve_config.gpu.yaml's engine (paged, 128 sequences of up to 4096 positions, 2048-token prefill
# chunks): as bench/engine.py's arguments, and as bench/throughput.py's --engine
E="--max-seq-len 4096 --no-hf --max-slots 128 --kv-cache paged --prefill-chunk 2048"
GPU_ENGINE='{"kv_cache": "paged", "max_slots": 128, "max_seq_len": 4096, "prefill_chunk": 2048}'
# each stage's variants, as its command records them
declare -A VARS=([tests]="TESTS_ARGS" [load]="LOAD_ARGS" [kernels]="KERNELS_ONLY PREFILL_ROWS"
  [engine]="ENGINE_CONCURRENCY ENGINE_RUNS ENGINE_ARGS ENGINE_PROFILE ENGINE_8B ENGINE_PREFIX BASELINE"
  [serve]="SERVE_CACHES SERVE_REPEAT SERVE_EXTRA SERVE_PROFILE" [fresh-node]="FRESH_KINDS FRESH_REPEAT SERVE_EXTRA"
  [http]="HTTP_CONCURRENCY HTTP_ROUNDS HTTP_ARGS HTTP_ENVS HTTP_SWITCH_MS BASELINE" [tp]="TP_LAYERS"
  [fetch]="FETCH_ARGS" [quant]="QUANT_ARGS")

ckpt() {  # the 7B-shaped random checkpoint (made on the GPU) and its pack, once
  [ -f $W/packed/model.cst ] && [ -f $W/hf/config.json ] && return
  python3 -c "from pathlib import Path; from bench.load import ensure_checkpoint; print(ensure_checkpoint(Path('$W'), 'llama-7b')[2])"
}

ckpt8b() {  # the grouped-query subject: a Llama-3-8B-shaped random checkpoint, packed, once (its HF
  # copy and the 7B's removed for the disk: ckpt makes the 7B's again where a stage needs it)
  [ -f $W/llama3-8b/packed/model.cst ] && return
  rm -rf $W/hf
  python3 -c "from pathlib import Path; from bench.load import ensure_checkpoint; print(ensure_checkpoint(Path('$W/llama3-8b'), 'llama3-8b')[2])" \
    && rm -rf $W/llama3-8b/hf
}

command_of() {  # the stage's command, with the variants set for it
  local v c=""
  for v in ${VARS[$1]}; do [ -n "${!v:-}" ] && c+="$(printf '%s=%q ' "$v" "${!v}")"; done
  echo "${c}bash bench/gpu.sh OUT $1"
}

stage_tests() {  # the GPU tests (-m gpu); TESTS_ARGS: more pytest arguments
  python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS_ARGS:-} tests/ > "$d/pytest.log" 2>&1; local r=$?
  tail -15 "$d/pytest.log"
  python3 bench/results.py pytest-counts "$d/pytest.log" "$d/pytest.json" && P+=(pytest="$d/pytest.json")
  return $r
}

stage_load() {  # the packed 7B onto the GPU warm and cold, beside the disk, safetensors and HF's
  # from_pretrained (bench/load.py). LOAD_ARGS: its flags instead of --no-sweep (`--warm-only
  # --repeats 5`, `--warm-only --tree DIR` for another checkout's loader, `--cold-sweep-only`)
  python3 bench/load.py --work $W --out "$d" ${LOAD_ARGS:---no-sweep} 2>&1 | tail -40; local r=$? f
  for f in load load-warm load-cold-sweep; do [ -f "$d/$f.json" ] && P+=($f="$d/$f.json"); done
  return $r
}

stage_engine() {  # the engine of serve_config.gpu.yaml alone (bench/engine.py, 128 in / 128 out a
  # request) at ENGINE_CONCURRENCY (1,64,128), ENGINE_RUNS times (1); then, unless ENGINE_8B=0, the
  # same once over the packed Llama-3-8B shape (grouped-query, 8 kv heads, a 128k vocabulary; part
  # llama3-8b-1); then, unless ENGINE_PREFIX=0, 64 chats behind one 1,024-token system prompt, with
  # prefix reuse and without.
  # ENGINE_ARGS: engine.py's flags after those, so they win (`--kv-cache static --max-slots 16
  # --max-seq-len 1024`, `--kv-block-size 32`, `--prefill-chunk 4096`, `--prompt-lens 32,3000
  # --max-slots 256 --concurrency 256` for a load beyond the cache). ENGINE_PROFILE=1: the first run
  # with --profile (decode steps' device time against their wall time, the loop's busiest
  # functions). BASELINE=DIR, a plain checkout of the commit before a change (`git archive REV |
  # tar -x -C DIR`): its runs alternate with this tree's (parts baseline-K and run-K)
  ckpt || return 1
  local r=0 k side tree p pc
  for k in $(seq ${ENGINE_RUNS:-1}); do for side in ${BASELINE:+baseline} run; do
    tree=$PWD; [ $side = baseline ] && tree=$BASELINE
    p=""; [ "${ENGINE_PROFILE:-0}" = 1 ] && [ $k = 1 ] && p=--profile
    (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH python3 bench/engine.py $W/packed $E --concurrency \
      ${ENGINE_CONCURRENCY:-1,64,128} ${ENGINE_ARGS:-} $p --out "$d/$side-$k.json") > "$d/$side-$k.log" 2>&1 \
      || { r=1; tail -20 "$d/$side-$k.log"; }
    grep -E "^(tokens_per_s_b[0-9]+|decode_ms_per_token_b1|ttft_ms_b1|work_b128|preemptions|profile [a-z_]+) " \
      "$d/$side-$k.log" | sed "s/^/$side $k /"
    P+=($side-$k="$d/$side-$k.json")
  done; done
  if [ "${ENGINE_8B:-1}" = 1 ]; then
    if ckpt8b; then
      python3 bench/engine.py $W/llama3-8b/packed $E --concurrency ${ENGINE_CONCURRENCY:-1,64,128} ${ENGINE_ARGS:-} \
        --out "$d/llama3-8b-1.json" > "$d/llama3-8b-1.log" 2>&1 || { r=1; tail -20 "$d/llama3-8b-1.log"; }
      grep -E "^(tokens_per_s_b[0-9]+ |decode_ms_per_token_b1 |bound b)" "$d/llama3-8b-1.log" | sed "s/^/llama3-8b /"
      P+=(llama3-8b-1="$d/llama3-8b-1.json")
    else r=1; fi
  fi
  [ "${ENGINE_PREFIX:-1}" = 0 ] && return $r
  for pc in "" --no-prefix-cache; do
    python3 bench/engine.py $W/packed $E $pc --shared-prefix 1024 --concurrency 64 \
      --out "$d/prefix${pc:+-off}.json" > "$d/prefix${pc:+-off}.log" 2>&1 || { r=1; tail -20 "$d/prefix${pc:+-off}.log"; }
    grep -E "^tokens_per_s_b64 " "$d/prefix${pc:+-off}.log" | sed "s/^/prefix${pc:+ off} /"
    P+=(prefix${pc:+-off}="$d/prefix${pc:+-off}.json")
  done
  return $r
}

stage_kernels() {  # the Triton kernels' sweeps (bench/kernel_sweep.py; KERNELS_ONLY: one of gemv,
  # attention, paged, wide), then a shared prefill's device time by kernel with PREFILL_ROWS (16 32)
  # fresh 128-token prompts in one forward (the engine's 2048- and a 4096-token chunk)
  local r=0 rows
  python3 bench/kernel_sweep.py ${KERNELS_ONLY:+--only $KERNELS_ONLY} --out "$d/sweep.json" 2>&1 | tail -40 || r=1
  P+=(sweep="$d/sweep.json")
  ckpt || return 1
  for rows in ${PREFILL_ROWS:-16 32}; do
    python3 bench/prefill_kernels.py $W/packed --rows $rows --out "$d/prefill-$rows.json" > "$d/prefill-$rows.log" 2>&1 \
      || r=1
    grep -vE "USDT|^\[" "$d/prefill-$rows.log" | head -22
    P+=(prefill-$rows="$d/prefill-$rows.json")
  done
  return $r
}

stage_serve() {  # the cold-start report (bench/serve.py): each kind's replica start in Ray Serve with
  # a warm page cache (SERVE_REPEAT rounds, 5: a host's Ray worker start drifts by seconds), then a
  # cold one (three rounds), added to it; with two GPUs or more also a 1 -> 2 replica scale-up under
  # load. SERVE_CACHES: "warm" or "cold" alone; SERVE_EXTRA: more arguments (`--kinds ...`,
  # `--variant NAME=JSON` without spaces, `--naive --kinds naive` for the article's path: minutes a
  # start). SERVE_PROFILE=1: also the replica's start under cProfile (bench/start_profile.py, after
  # a first start that fills the caches, as on a node that ran the model before)
  local r=0 c a n
  n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  for c in ${SERVE_CACHES:-warm cold}; do
    a="--caches $c"; [ $c = warm ] && a+=" --repeat ${SERVE_REPEAT:-5}"
    [ $c = cold ] && [[ " ${SERVE_CACHES:-warm cold} " = *" warm "* ]] && a+=" --merge $W/serve-partial.json"
    [ $c = cold ] && [ "$n" -ge 2 ] && a+=" --scale-up"
    python3 bench/serve.py --work $W --out "$d" --report "$d" $a ${SERVE_EXTRA:-} > "$d/serve-$c.log" 2>&1 || r=1
    grep -E "added->RUNNING|^- " "$d/serve-$c.log"
  done
  P+=(report="$d/serve.json")
  if [ "${SERVE_PROFILE:-0}" = 1 ]; then
    python3 bench/start_profile.py $W/packed 2>&1 | tail -1
    python3 bench/start_profile.py $W/packed --top 80 --out "$d/start-profile.json" 2>&1 | tail -4 || r=1
    P+=(start-profile="$d/start-profile.json")
  fi
  return $r
}

stage_fresh_node() {  # a new node's first replica: before each deploy Triton's cache (and the
  # verdicts and bytecode kept beside it) emptied, the project's written bytecode removed and the page
  # cache dropped; FRESH_KINDS (minimal,coldstart,coldstart-nokernels: coldstart without the kernels
  # shipped in the packed model by `coldstart kernels`, run first), FRESH_REPEAT rounds (3);
  # SERVE_EXTRA as in serve. First the installed packages' bytecode is compiled, as the image's build
  # does (without it every fresh start compiles torch, Triton and Ray from source)
  python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    ${PYTHONPATH//:/ } > /dev/null 2>&1
  python3 bench/serve.py --work $W --out "$d" --report "$d" --kinds ${FRESH_KINDS:-minimal,coldstart,coldstart-nokernels} \
    --caches fresh --repeat ${FRESH_REPEAT:-3} ${SERVE_EXTRA:-} > "$d/fresh-node.log" 2>&1; local r=$?
  grep -E "added->RUNNING|^- new node" "$d/fresh-node.log"
  P+=(report="$d/serve.json")
  return $r
}

stage_http() {  # the engine of serve_config.gpu.yaml alone at HTTP_CONCURRENCY (128), then the same
  # replica through Ray Serve's HTTP front (bench/throughput.py: 8 client processes sending from one
  # instant, HTTP_ROUNDS bursts, 4), each in its own Ray instance. HTTP_ARGS: throughput.py's flags
  # beside those (`--sample-s 0.02`: the replica's /stats every 20 ms; `--prompt-len 3000 --sample-s
  # 0.5 --rounds 1`: the capacity share under a load beyond the cache; `--clients 1`). HTTP_ENVS:
  # NAME=VALUE words, one more run with each in the environment Ray starts in
  # (RAY_SERVE_THROUGHPUT_OPTIMIZED=1); HTTP_SWITCH_MS=N: one more with Python's switch interval at
  # N ms in every Ray process (a sitecustomize on their PYTHONPATH). BASELINE=DIR: that checkout's
  # HTTP run first (part baseline)
  ckpt || return 1
  local r=0 c=${HTTP_CONCURRENCY:-128} i=1 env envs=${HTTP_ENVS:-} name tree f
  python3 bench/engine.py $W/packed $E --concurrency $c --out "$d/engine.json" > "$d/engine.log" 2>&1 \
    || { r=1; tail -20 "$d/engine.log"; }
  grep -E "^(tokens_per_s_b[0-9]+|work_b128) " "$d/engine.log" | sed 's/^/engine /'
  P+=(engine="$d/engine.json")
  if [ -n "${HTTP_SWITCH_MS:-}" ]; then
    mkdir -p $W/switch && echo "import sys; sys.setswitchinterval($HTTP_SWITCH_MS / 1000)" > $W/switch/sitecustomize.py
    envs="$envs PYTHONPATH=$W/switch:$PYTHONPATH"
  fi
  for env in ${BASELINE:+baseline} "" $envs; do
    name=http; tree=$PWD
    if [ "$env" = baseline ]; then name=baseline; tree=$BASELINE; env=""
    elif [ -n "$env" ] || [ $i -gt 1 ]; then i=$((i + 1)); name=http-$i; fi
    (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH python3 bench/throughput.py --packed $W/packed --out "$d/$name" \
      --concurrency $c --clients 8 --rounds ${HTTP_ROUNDS:-4} ${env:+--env $env} ${HTTP_ARGS:-} \
      --engine "$GPU_ENGINE") > "$d/$name.log" 2>&1 || { r=1; tail -20 "$d/$name.log"; }
    grep -E "concurrent:" "$d/$name.log" | sed "s/^/$name ${env:+$env }/"
    for f in "$d/$name"/throughput-*.json; do [ -f "$f" ] && P+=($name="$f"); done
  done
  return $r
}

stage_tp() {  # one GPU: rank 0 of a 70B-shaped TP=4 split pack (TP_LAYERS of its 80 layers, 20, to
  # fit the disk) loaded warm and cold, the ranks' channel per decode call on this host's cores, and a
  # whole rank's batch-1 decode step (the all-reduce left out); with 2 GPUs or more a 13B-shaped TP=2
  # replica in Ray Serve, with 4 a 70B-shaped TP=4 one (bench/tp.py)
  local r=0 n
  python3 bench/tp.py rank-load --work $W --out "$d" --layers ${TP_LAYERS:-20} 2>&1 | tail -12 || r=1
  python3 bench/tp.py channel --work $W --out "$d" 2>&1 | tail -12 || r=1
  rm -rf $W/llama3-70b-tp4-*  # (tens of GB: the next runs need the disk)
  python3 bench/engine.py --random llama3-70b --tp-rank 4 --max-seq-len 4096 --no-hf \
    --out "$d/engine-rank.json" > "$d/engine-rank.log" 2>&1 || { r=1; tail -20 "$d/engine-rank.log"; }
  grep -E "^(weight_gb|decode_ms_per_token_b1|tokens_per_s_b(1|16)) " "$d/engine-rank.log"
  P+=(rank-load="$d/tp-rank-load.json" channel="$d/tp-channel.json" engine-rank="$d/engine-rank.json")
  n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if [ "$n" -ge 2 ]; then
    python3 bench/tp.py serve --work $W --out "$d" --shape llama2-13b --tp 2 2>&1 | tail -8 || r=1
    P+=(serve-tp2="$d/tp-serve-llama2-13b-tp2.json"); fi
  if [ "$n" -ge 4 ]; then
    python3 bench/tp.py serve --work $W --out "$d" --shape llama3-70b --tp 4 ${TP_LAYERS:+--layers $TP_LAYERS} 2>&1 \
      | tail -8 || r=1
    P+=(serve-tp4="$d/tp-serve-llama3-70b-tp4.json"); fi
  return $r
}

script_stage() {  # NAME ARGS...: bench/NAME.py --out OUT/NAME/NAME.json ARGS, or a line saying why not
  # (the script makes what it measures; bench/load.py's ensure_checkpoint makes the 7B under $W)
  local name=$1; shift
  if [ ! -f bench/$name.py ]; then echo "$name: skipped: bench/$name.py is not in this tree"; SKIP=1; return 0; fi
  python3 bench/$name.py --out "$d/$name.json" "$@" 2>&1 | tail -30; local r=$?
  P+=($name="$d/$name.json")
  return $r
}
# weights from object storage and between nodes (FETCH_ARGS: bench/fetch.py's flags); then each step
# of a transfer's pieces apart (bench/transfer_steps.py), on the model fetch.py served
stage_fetch() {
  script_stage fetch ${FETCH_ARGS:-} || return
  [ $SKIP = 1 ] || [ ! -f bench/transfer_steps.py ] && return 0
  local a prev="" packed=/tmp/coldstart-bench/packed
  for a in ${FETCH_ARGS:-}; do [ "$prev" = --packed ] && packed=$a; prev=$a; done
  python3 bench/transfer_steps.py --packed "$packed" --out "$d/steps.json" 2>&1 | tail -20 || return
  P+=(steps="$d/steps.json")
}
# quantized checkpoints: load and decode (QUANT_ARGS: bench/quant.py's flags)
stage_quant() { script_stage quant ${QUANT_ARGS:-}; }

rc=0
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  d=$out/$stage; rm -rf "$d"; mkdir -p "$d"; P=(); SKIP=0
  stage_${stage//-/_}; r=$?
  if [ $SKIP = 1 ]; then rm -rf "$d"
  elif [ $r -ne 0 ]; then echo "=== $stage failed: rc=$r ($out/$stage.json left as it was)"; rc=$r
  else python3 bench/results.py stage $stage "$out/$stage.json" --command "$(command_of $stage)" \
      "${P[@]/#/--part=}" || rc=1
  fi
done
[ "$out" = "$PWD/bench/results" ] && { python3 bench/results.py || rc=1; }
echo "=== done $(date +%T)"
exit $rc
