#!/usr/bin/env bash
# Usage: hack/leftovers.sh RUN_ID
# Fails (exit 1, listing them) when a finished e2e run or demo left anything
# behind; kills/removes what it finds so the next run starts clean:
#   - processes whose environment carries AMBIENTD_E2E_RUN=RUN_ID
#   - node network namespaces ambientd-e2e-<pid>-* whose creator is gone
#   - bridges/veths of the chain in the machine's own network namespace
#   - mounts and work dirs of the run
#   - cgroups of the pods' sandbox processes (test/infra/e2eenv/sandbox.go:
#     <cgroup2 mount>/ambientd-e2e-RUN_ID-*/)
#   - the real node's (test/infra/nodeenv): containerd shims serving a containerd
#     of this run, kubelet's cgroup root ambientd-e2e-node-<pid>-* (any
#     hierarchy) whose creating process is gone, the node's bridge and
#     node0 interface in the machine's network namespace
set -uo pipefail
run=${1:?usage: $0 RUN_ID}
# Our own children must not match the search below.
unset AMBIENTD_E2E_RUN
bad=0
report() { echo "leftovers: $*" >&2; bad=1; }
# Kills every process in the cgroup dir $1 and below, and removes the tree.
remove_cgroup_tree() {
  local p
  for p in $(cat $(find "$1" -name cgroup.procs) 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    find "$1" -depth -type d -exec rmdir {} + 2>/dev/null
    [ -d "$1" ] || break
    sleep 0.2
  done
}

for d in /proc/[0-9]*; do
  pid=${d#/proc/}
  [ "$pid" = "$$" ] && continue
  # Read whole, then matched: grep -q in a pipe would exit at the first match
  # and (pipefail) turn a leftover into a miss when tr dies of SIGPIPE.
  environ=$({ tr '\0' '\n' < "$d/environ"; } 2>/dev/null) || continue
  if grep -qx "AMBIENTD_E2E_RUN=$run" <<<"$environ"; then
    report "process $pid still running: $({ tr '\0' ' ' < "$d/cmdline"; } 2>/dev/null)"
    kill -9 "$pid" 2>/dev/null || true
  fi
done

for ns in $(ls /run/netns 2>/dev/null | grep '^ambientd-e2e-' || true); do
  creator=${ns#ambientd-e2e-}; creator=${creator%%-*}
  if ! kill -0 "$creator" 2>/dev/null; then
    report "network namespace $ns left behind"
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  fi
done

# The chain's bridge (ambe2e0) and pod veths live only in the node netns; in
# the machine's netns they would mean the isolation broke.
if ip -o link show ambe2e0 >/dev/null 2>&1; then
  report "bridge ambe2e0 exists in the machine's network namespace"
fi

tmp=${TMPDIR:-/tmp}

# containerd does not stop its shims when it exits; nodeenv kills them by pid.
for d in /proc/[0-9]*; do
  cmd=$({ tr '\0' ' ' < "$d/cmdline"; } 2>/dev/null) || continue
  case "$cmd" in
    *containerd-shim*"-address $tmp/ambientd-e2e-$run-"*)
      report "containerd shim ${d#/proc/} still running: $cmd"
      kill -9 "${d#/proc/}" 2>/dev/null || true ;;
  esac
done
for l in ambnode0 node0; do
  if ip -o link show "$l" >/dev/null 2>&1; then
    report "real-node interface $l exists in the machine's network namespace"
  fi
done
if grep -F "ambientd-e2e-$run" /proc/self/mountinfo >&2; then
  report "mounts of run $run remain (above)"
fi
for d in "$tmp"/ambientd-e2e-"$run"-*; do
  [ -e "$d" ] || continue
  report "work dir $d left behind (removed now)"
  rm -rf "$d"
done

# Pod sandbox cgroups live in the cgroup2 hierarchy, in a dir named like the
# work dir. Look in every cgroup2 mount; with none (a cgroup v1-only host),
# mount the hierarchy for a moment.
cgmnts=$(awk '{ for (i = 1; i <= NF; i++) if ($i == "-") { if ($(i+1) == "cgroup2") print $5; break } }' /proc/self/mountinfo)
tmpcg=
if [ -z "$cgmnts" ]; then
  tmpcg=$(mktemp -d)
  if mount -t cgroup2 none "$tmpcg" 2>/dev/null; then cgmnts=$tmpcg; else rmdir "$tmpcg"; tmpcg=; fi
fi
for m in $cgmnts; do
  for d in "$m"/ambientd-e2e-"$run"-*; do
    [ -d "$d" ] || continue
    report "cgroup $d left behind (removed now): $(find "$d" -mindepth 1 -type d -printf '%f ' 2>/dev/null)"
    remove_cgroup_tree "$d"
  done
done
if [ -n "$tmpcg" ]; then umount "$tmpcg" && rmdir "$tmpcg"; fi

# kubelet's cgroup root (test/infra/nodeenv): one top-level dir per hierarchy,
# named after the process that ran the node; the pods' containers live below.
for m in $(awk '{ for (i = 1; i <= NF; i++) if ($i == "-") { if ($(i+1) == "cgroup" || $(i+1) == "cgroup2") print $5; break } }' /proc/self/mountinfo); do
  for d in "$m"/ambientd-e2e-node-*; do
    [ -d "$d" ] || continue
    creator=${d##*/ambientd-e2e-node-}; creator=${creator%%-*}
    kill -0 "$creator" 2>/dev/null && continue
    report "kubelet cgroup $d left behind (removed now)"
    remove_cgroup_tree "$d"
  done
done

if [ "$bad" -eq 0 ]; then
  echo "leftovers: none (processes, shims, netns, bridges, mounts, work dirs, cgroups checked for run $run)"
fi
exit "$bad"
