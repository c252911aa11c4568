#!/bin/bash
# HealthCheckProgram example: drain this node when `colossalai-exporter node check`
# finds it unhealthy (a GPU lost or missing, a critical Xid since boot, a watched
# disk missing, read-only or hung), with the check's one line as the drain reason.
#
# slurm.conf (on every node):
#   HealthCheckProgram=/etc/slurm/colossalai/healthcheck.sh
#   HealthCheckInterval=300
#   HealthCheckNodeState=ANY
#
# slurmd runs it as root (so it can read /dev/kmsg) with a short deadline. It drains,
# never resumes: a node drained for hardware comes back when someone has acted
# (scontrol update nodename=<n> state=resume). Exit 2 from the check (a bad flag or
# config) drains nothing and says so in syslog.
set -u
COLOSSALAI_EXPORTER=${COLOSSALAI_EXPORTER:-/opt/colossalai-exporter/bin/colossalai-exporter}
CONFIG=${COLOSSALAI_NODE_CONFIG:-/etc/colossalai-exporter/node.yml}
args=(node check)
[ -r "$CONFIG" ] && args+=(--config.file "$CONFIG")

out=$(timeout 60 "$COLOSSALAI_EXPORTER" "${args[@]}" 2>&1)
status=$?
line=${out##*$'\n'}  # the verdict is the last line
case "$status" in
  0) exit 0 ;;
  1) scontrol update nodename="$(hostname -s)" state=drain reason="${line:0:200}"
     logger -t colossalai-healthcheck "drained: $line" ;;
  *) logger -t colossalai-healthcheck "node check could not run (exit $status): $line" ;;
esac
exit 0
