#!/bin/bash
# dump chaos rank processes that live longer than $1 seconds
done_pids=""
for i in $(seq 1 120); do
  for pid in $(pgrep -f "cgxchaos-"); do
    et=$(ps -o etimes= -p $pid 2>/dev/null | tr -d ' ')
    [ -z "$et" ] && continue
    if [ "$et" -gt "$1" ] && ! echo "$done_pids" | grep -qw $pid; then
      cmd=$(tr '\0' ' ' < /proc/$pid/cmdline | head -c 80)
      case "$cmd" in *python*) ;; *) continue;; esac
      echo "=== pid $pid etimes $et"
      timeout 60 gdb -p $pid -batch -ex "thread apply all bt 30" 2>&1 | grep -E "^#|^Thread" | head -120
      done_pids="$done_pids $pid"
    fi
  done
  sleep 1
done
