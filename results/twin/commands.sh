#!/bin/bash
# The live twin (docs/twin.md): the model, its profile, then the simulated and live runs. Run from the
# repository root, on a machine doing nothing else (every server computes on the same core).
set -euo pipefail
.venv/bin/marsched model --out /tmp/twin/model --layers 2 --hidden 128 --heads 4 --kv-heads 2 --intermediate 256 \
    --max-position 32768
VLLM_CPU_NUM_OF_RESERVED_CPU=1 .venv/bin/marsched calibrate --model /tmp/twin/model --out results/twin/profile.json \
    --name twin-tiny-32k-cpu --kv-cache-gb 1 --prefill-tokens 256,1024,4096,8192,16384 --decode-batches 1,8,32 \
    --decode-contexts 1024,8192 --repeats 3 --force
# The loads the simulator picks (--loads auto, the default; it prints its sweep): light 0.4, queueing 1 task/s.
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out /tmp/twin/sweep --sim-only
# What was run (one live repeat per configuration and load, for the time a session had), at those loads:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run --repeats 1 --loads light:0.4,queueing:1
# The second run (docs/results.md, "The second run, after the fixes"), the same loads, after the
# retention fix, the simulator's queued turns, INFERCEPT's predicted call time and loadgen's last turn:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run2 --repeats 1 --loads light:0.4,queueing:1
# The third run (docs/results.md, "The third run"): after a kept follow-up is priced by what it has left,
# the queueing load only, the three configurations it touches or is measured against, two repeats:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run3 --configs mars,infercept,continuum --repeats 2 --loads queueing:1
# The fourth run (docs/results.md, "The fourth run"): after a promotion lasts a program's life over HTTP,
# the queueing load, MARS and INFERCEPT two interleaved repeats, the other configurations one; then the light load:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run4 --configs mars,infercept --repeats 2 --loads queueing:1
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run4-others --configs vllm-stock,vllm-stock-host,vllm,continuum,autellix --repeats 1 \
    --loads queueing:1
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run4-light --repeats 1 --loads light:0.4
# The fifth run (docs/results.md, "Three repeats"): after the server gives pins up newest program first,
# three repeats of every configuration at both loads. The fourth run's measured runs were copied in as
# repeat 1 (and 2: mars, infercept at the queueing load), their paths in run.json pointed at the new
# folder, with that run's summary.json, except the queueing continuum run, which the change touches
# (it gave 66 pins up for room; at the light load none was);
# --resume kept them and ran the rest, interleaved:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run5-light --repeats 3 --loads light:0.4 --resume
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run5 --repeats 3 --loads queueing:1 --resume
# The sixth run (docs/results.md, "The sixth and seventh runs"): after kept KV gives way inside vLLM's
# allocation and the simulator admits a whole prompt (profile.json's admits_whole_prompt). The fifth run's
# folders were copied in as in the fifth run, but for Continuum's pin at the queueing load (the only run
# that gave pins up for room); --resume simulated anew and ran that configuration's three repeats:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run6-light --repeats 3 --loads light:0.4 --resume
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run6 --repeats 3 --loads queueing:1 --resume
# The seventh run: after a turn takes its program's first arrival as its place (MARS's promoted lane,
# INFERCEPT's FCFS order). The sixth run's folders were copied in but for the three configurations the
# change touches (mars, infercept, continuum), which ran three repeats at both loads:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run7 --repeats 3 --loads queueing:1 --resume
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
    --out results/twin/run7-light --repeats 3 --loads light:0.4 --resume
# Then the simulator kept only a turn's full blocks for its follow-up, as the server does: the same two
# commands again re-simulated both loads and kept every live run (records.json and table.md are the
# re-simulated ones; each load's summary.json is the live comparison as measured).
# The eighth run, on a second machine (2026-12-07): a prefill token took 1/16 of the first machine's time,
# so the first profile did not describe it. Calibrated here, then the loads picked by the simulator
# (light 0.8, queueing 4 tasks/s; the grid now reaches 5 tasks/s), one live repeat of every configuration,
# and the table again at the step costs the marsched servers learned:
VLLM_CPU_NUM_OF_RESERVED_CPU=1 .venv/bin/marsched calibrate --model /tmp/twin/model --out results/twin/run8/profile.json \
    --name twin-tiny-32k-cpu --kv-cache-gb 1 --prefill-tokens 256,1024,4096,8192,16384 --decode-batches 1,8,32 \
    --decode-contexts 1024,8192 --repeats 3 --force
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run8/profile.json \
    --out results/twin/run8 --repeats 1
# The full comparison from nothing: three interleaved repeats (about three hours on two cores).
# .venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/profile.json \
#     --out results/twin/run3-full
# Three repeats of the three lowest at the queueing load (host tier, INFERCEPT, MARS): run8's runs of them
# copied in (paths in run.json rewritten), then the rest run:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run8/profile.json \
    --out results/twin/run8-more --repeats 3 --loads queueing:4 --configs vllm-stock-host,infercept,mars --resume
# Both tables were then made again with --resume (no run left to measure) after the servers' step costs
# became each configuration's own (stock vLLM's those of --policy vllm).
# The ninth run, on a third machine (2026-12-07, later session): a step took 1.25 ms against the second
# machine's 1.95 ms. After the live server's online predictor learned from the replies it served (it had
# predicted its 100-token prior for every reply) and the default grid reached 10 tasks/s (at 5 tasks/s
# MARS, INFERCEPT and the host tier were within 1.23x their unloaded slowdown here), calibrated here and the
# loads picked by the simulator (light 1.2, queueing 10 tasks/s), one live repeat of every configuration:
VLLM_CPU_NUM_OF_RESERVED_CPU=1 .venv/bin/marsched calibrate --model /tmp/twin/model --out results/twin/run9/profile.json \
    --name twin-tiny-32k-cpu --kv-cache-gb 1 --prefill-tokens 256,1024,4096,8192,16384 --decode-batches 1,8,32 \
    --decode-contexts 1024,8192 --repeats 3 --force
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out results/twin/run9 --repeats 1
# Continuum's pin at 10 tasks/s again, twice: once with the server's event trace (a diagnostic; the trace file
# is not kept), then a second repeat beside run9's first (its run copied in, paths in run.json rewritten):
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out results/twin/run9-continuum-traced --repeats 1 --loads queueing:10 --configs continuum \
    --marsched-arg=--trace-out=/tmp/diag/c10-live.jsonl
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out results/twin/run9-continuum --repeats 2 --loads queueing:10 --configs continuum --resume
# run9's second and third repeats (session of 2026-12-07, same machine, code unchanged in behaviour since 9209f63).
# First stock vLLM and --policy vllm at 10 tasks/s once more, to see whether run9's 1.32x gap between them
# repeats (it did not: 88.26 s and 94.75 s); those two runs and run9-continuum's second one were copied into
# run9 as repeat 2 (paths and "repeat" in run.json rewritten), then --resume ran every other repeat:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out /tmp/diag/ab --repeats 1 --loads queueing:10 --configs vllm-stock,vllm
for c in vllm-stock vllm; do
    cp -r /tmp/diag/ab/queueing/runs/$c-r1 results/twin/run9/queueing/runs/$c-r2
    sed -i "s#/tmp/diag/ab/queueing/runs/$c-r1#results/twin/run9/queueing/runs/$c-r2#g; s#\"repeat\": 1#\"repeat\": 2#" \
        results/twin/run9/queueing/runs/$c-r2/run.json
done
cp -r results/twin/run9-continuum/queueing/runs/continuum-r2 results/twin/run9/queueing/runs/continuum-r2
sed -i "s#run9-continuum/queueing/runs/continuum-r2#run9/queueing/runs/continuum-r2#g" \
    results/twin/run9/queueing/runs/continuum-r2/run.json
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out results/twin/run9 --repeats 3 --resume
# The tenth run (session of 2026-12-07, third; same machine as run9, its profile): after stock vLLM's servers
# run vLLM's scheduler with a step meter beside it (vllm/step_meter.py), so that both stock configurations are
# simulated at their own servers' step costs, not --policy vllm's. Three interleaved repeats of every
# configuration, the queueing load first; the twin was then stopped before its first light run, for want of
# session time (that run's empty folder removed). The light load is left to --resume:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out results/twin/run10 --repeats 3 --loads queueing:10,light:1.2
# Session of 2026-12-07, fourth (same machine): every learned cost model also reports its whole run's fit
# (cost_model.run), which the twin now simulates at. The stock configurations' runs at 10 tasks/s, whose
# meters predate it, were set aside (kept in run10/queueing-latest-fit-stock) and run again; the marsched
# configurations' runs were kept (their twins run at the fit their servers decided with); then the light load:
mkdir -p results/twin/run10/queueing-latest-fit-stock
for c in vllm-stock vllm-stock-host; do
    for r in 1 2 3; do git mv results/twin/run10/queueing/runs/$c-r$r results/twin/run10/queueing-latest-fit-stock/; done
done
sed -i 's#results/twin/run10/queueing/runs/vllm-stock#results/twin/run10/queueing-latest-fit-stock/vllm-stock#g' \
    results/twin/run10/queueing-latest-fit-stock/*/run.json
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out results/twin/run10 --repeats 3 --loads queueing:10,light:1.2 --resume
# Before that run, the step logs that explained the host tier's twin (results/twin/run10/step-logs; the script
# as kept writes into its own folder, the runs wrote to /tmp/diag and then were copied there), and their prices:
results/twin/run10/step-logs/live.sh host '{"kv_connector":"HostPrefixTierConnector","kv_role":"kv_both","kv_connector_module_path":"marsched.vllm.prefix_tier","kv_connector_extra_config":{"host_tokens":4194304}}'
results/twin/run10/step-logs/live.sh stock
for n in host stock; do
    .venv/bin/python -m marsched.experiments.twin.step_log results/twin/run10/step-logs/$n.steps.jsonl \
        --profile results/twin/run9/profile.json
done
# The twin had started before records.markdown named the configurations simulated at the fit their servers
# decided with; run10/table.md was then rewritten from run10/records.json with the current records.markdown
# (one heading changed).
# Then one repeat of the marsched configurations at 10 tasks/s with their whole runs' fits, to see how far their
# twins move (written to /tmp/run10-check, copied here with its paths rewritten):
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out /tmp/run10-check --repeats 1 --loads queueing:10 --configs vllm,infercept,continuum,autellix,mars
cp -r /tmp/run10-check results/twin/run10-check
grep -rl /tmp/run10-check results/twin/run10-check | xargs sed -i 's#/tmp/run10-check#results/twin/run10-check#g'
# Session of 2026-12-07, fifth: a fourth machine (a step of the same light load took about 2.4x run10's). The
# host tier and MARS at 1.2 tasks/s, three interleaved repeats each, to see whether run10's 1.1% between them
# holds on other runs (run9's profile, which does not describe this machine: only the live columns and the
# table at the servers' own step costs count); written to /tmp/run10-light-pairs, copied here, paths rewritten:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile results/twin/run9/profile.json \
    --out /tmp/run10-light-pairs --repeats 3 --loads light:1.2 --configs vllm-stock-host,mars
cp -r /tmp/run10-light-pairs results/twin/run11-light-pairs
grep -rl /tmp/run10-light-pairs results/twin/run11-light-pairs | xargs sed -i 's#/tmp/run10-light-pairs#results/twin/run11-light-pairs#g'
# Then the README's three twin commands exactly as written, in a fresh clone (git clone; scripts/setup.sh --vllm;
# /tmp/twin moved aside first), copied here as run11 with its paths rewritten:
git clone -q /work/main /tmp/fresh && cd /tmp/fresh && scripts/setup.sh --vllm
.venv/bin/marsched model --out /tmp/twin/model --layers 2 --hidden 128 --heads 4 --kv-heads 2 --intermediate 256 --max-position 32768
VLLM_CPU_NUM_OF_RESERVED_CPU=1 .venv/bin/marsched calibrate --model /tmp/twin/model --out /tmp/twin/profile.json --kv-cache-gb 1 --prefill-tokens 256,1024,4096,8192,16384 --decode-batches 1,8,32 --decode-contexts 1024,8192
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile /tmp/twin/profile.json --out /tmp/twin/run --repeats 1
cd /work/main
cp -r /tmp/twin/run results/twin/run11 && cp /tmp/twin/profile.json results/twin/run11/profile.json
grep -rl /tmp/twin/run results/twin/run11 | xargs sed -i 's#/tmp/twin/run#results/twin/run11#g'
# Two more repeats at the queueing load (4 tasks/s) of the three lowest there (host tier, INFERCEPT, MARS), run11's
# runs kept (--resume in a copy of /tmp/twin/run), copied here as run11-more with their paths rewritten:
cp -r /tmp/twin/run /tmp/twin/run-more
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile /tmp/twin/profile.json \
    --out /tmp/twin/run-more --repeats 3 --loads queueing:4 --configs vllm-stock-host,infercept,mars --resume
cp -r /tmp/twin/run-more results/twin/run11-more
grep -rl /tmp/twin/run-more results/twin/run11-more | xargs sed -i 's#/tmp/twin/run-more#results/twin/run11-more#g'
rm -rf results/twin/run11-more/light  # a copy of run11's light load
grep -rl /tmp/twin/run/ results/twin/run11-more | xargs sed -i 's#/tmp/twin/run/#results/twin/run11-more/#g'  # run11's first repeats, kept
# Which tasks make the p99 at 4 tasks/s, simulated only at run11-more's served terms:
.venv/bin/python results/twin/run11-more/simtail.py
# Session of 2026-12-07, sixth (the fourth machine's kind: servers' steps 1.17-1.29x run11's profile). Two more
# workload seeds live at the queueing load, the three lowest there, copied here as run12-seeds with paths rewritten:
for s in 1 2; do
    .venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile /tmp/twin/profile.json \
        --out /tmp/twin/seeds/seed$s --repeats 1 --loads queueing:4 --configs vllm-stock-host,infercept,mars --seed $s \
        > /tmp/twin/seeds/seed$s.log 2>&1
    cp -r /tmp/twin/seeds/seed$s results/twin/run12-seeds/seed$s
    cp /tmp/twin/seeds/seed$s.log results/twin/run12-seeds/seed$s/twin.log
done
grep -rl /tmp/twin/seeds results/twin/run12-seeds | xargs sed -i 's#/tmp/twin/seeds#results/twin/run12-seeds#g'
# Eight seeds simulated on both machines' served terms, MARS's starvation multiples and tail-bounded orders:
.venv/bin/python results/twin/run12-seeds/simseeds.py > results/twin/run12-seeds/simseeds.txt
# The host tier's step log against its simulated run at three fits (after the whole-run fit was weighed by time):
.venv/bin/python results/twin/run10/step-logs/simulated.py
# Then the twin at the queueing load, every configuration, one repeat, with the whole-run fit weighed by time,
# copied here as run13 with its paths rewritten:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile /tmp/twin/profile.json \
    --out /tmp/twin/run13 --repeats 1 --loads queueing:4 > /tmp/twin/run13.log 2>&1
cp -r /tmp/twin/run13 results/twin/run13 && cp /tmp/twin/profile.json results/twin/run13/profile.json
cp /tmp/twin/run13.log results/twin/run13/twin.log
grep -rl /tmp/twin/run13 results/twin/run13 | xargs sed -i 's#/tmp/twin/run13#results/twin/run13#g'
# Stock vLLM against `marsched serve --policy vllm` at the light load, three interleaved repeats each, copied here as
# run13-light-vllm with paths rewritten, then their turns' TTFT and decode:
.venv/bin/python -m marsched.experiments.twin --model /tmp/twin/model --profile /tmp/twin/profile.json \
    --out /tmp/twin/light-pairs --repeats 3 --loads light:0.8 --configs vllm-stock,vllm > /tmp/twin/light-pairs.log 2>&1
mkdir -p results/twin/run13-light-vllm
cp -r /tmp/twin/light-pairs/light /tmp/twin/light-pairs/records.json /tmp/twin/light-pairs/table.md results/twin/run13-light-vllm/
cp /tmp/twin/light-pairs.log results/twin/run13-light-vllm/twin.log
grep -rl /tmp/twin/light-pairs results/twin/run13-light-vllm | xargs sed -i 's#/tmp/twin/light-pairs#results/twin/run13-light-vllm#g'
.venv/bin/python results/twin/run13-light-vllm/turns.py results/twin/run13-light-vllm/light/runs vllm-stock vllm
