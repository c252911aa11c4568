#!/bin/bash
# EpilogSlurmctld example: remove the job's targets when it ends (see
# prolog-slurmctld.sh). Runs once per job on the controller with SLURM_JOB_ID.
# Removing a file that is already gone is not an error; like the prolog it
# always exits 0, so monitoring never holds up Slurm.

PATH=/usr/local/bin:/usr/bin:/bin
set -u

here=$(dirname "$0")
targets=${COLOSSALAI_SLURM_TARGETS:-$here/colossalai-slurm-targets}
export COLOSSALAI_EXPORTER_FILE_SD_DIR=${COLOSSALAI_EXPORTER_FILE_SD_DIR:-/etc/prometheus/targets}

if ! output=$("$targets" remove 2>&1); then
  logger -t colossalai-slurm-epilog "job ${SLURM_JOB_ID:-?}: targets not removed: $output" \
    2>/dev/null || echo "colossalai-slurm-epilog: $output" >&2
fi
exit 0
