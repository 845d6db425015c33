#!/usr/bin/env bash
# Jobs on the device machine that outlive their call: start them in one call, then wait for them and bring
# their logs back in the next ones (a call runs at most 10 minutes; the machine stays only while calls come).
#   bash scripts/device/background.sh start NAME COMMAND   start COMMAND (one string, run by bash) as job NAME
#   bash scripts/device/background.sh await NAME...        block until those jobs ended (inside a job: an order)
#   bash scripts/device/background.sh wait [SECONDS]       until every job ended or SECONDS passed (default 540),
#                                                          then $OUT/bg.tgz: the jobs' logs and outputs
# Jobs run under setsid (a plain `&` job dies with its call) from a private copy of the tree (/tmp/bg/repo, made by
# the first start, without .stage/ and docs/runs/), so later calls' copies of the tree never change a running job's
# files; a later start copies its call's carried .evaldata/ and .ab/ into it (an earlier call may have carried none). Job NAME writes its output to /tmp/bg/NAME.log and its files under $OUT=/tmp/bg/out/NAME; its exit status
# goes to /tmp/bg/NAME.done. Logs are tarred as they are, never edited in place (a process appending to a log
# edited in place writes on into the unlinked file).
# The 2026-11-28 two-GPU block ran this way: docs/runs/2026-11-28-h200x2-speculation/ (lane*.sh, progress.log).
set -uo pipefail
bg=/tmp/bg
mkdir -p $bg/out
# the started jobs' names (other logs under $bg, such as lanes' progress.log, are not jobs)
job_names() { for d in $bg/out/*/; do [ -e "$d" ] && basename "$d"; done; }
case ${1:-} in
  start)
    name=${2:?start NAME COMMAND} cmd=${3:?start NAME COMMAND}
    if [ ! -d $bg/repo ]; then
      mkdir -p $bg/repo && tar cf - --exclude=./.stage --exclude=./docs/runs . | tar xf - -C $bg/repo
    else  # a later call's carried folders (an earlier call may have carried none): the jobs it starts read them
      for d in .evaldata .ab; do [ -d $d ] && cp -r $d $bg/repo/; done
    fi
    [ -e $bg/$name.log ] && { echo "job $name exists already"; exit 2; }
    mkdir -p $bg/out/$name
    OUT=$bg/out/$name setsid nohup bash -c "cd $bg/repo && ( $cmd ); echo \$? > $bg/$name.done" \
      > $bg/$name.log 2>&1 < /dev/null &
    echo "started $name: $cmd" | tee -a $bg/jobs.txt ;;
  await)
    shift
    for name in "$@"; do while [ ! -f $bg/$name.done ]; do sleep 3; done; done ;;
  wait)
    limit=${2:-540} t0=$(date +%s)
    while [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
      left=0
      for name in $(job_names); do [ -f $bg/$name.done ] || left=1; done
      [ $left = 0 ] && break
      sleep 5
    done
    for name in $(job_names); do
      log=$bg/$name.log
      echo "== $name: $([ -f $bg/$name.done ] && echo "exit $(cat $bg/$name.done)" || echo running)"
      tail -c 600 "$log" | tr '\r' '\n' | tail -4
    done
    tar czf "${OUT:-/tmp}/bg.tgz" -C $bg --exclude=./repo . 2>/dev/null
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null ;;
  *)
    sed -n '2,12p' "$0"; exit 2 ;;
esac
