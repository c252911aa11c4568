#!/bin/bash
# PrologSlurmctld example: add a job's nodes to Prometheus when the job starts.
#
# slurm.conf (on the controller):
#   PrologSlurmctld=/etc/slurm/colossalai/prolog-slurmctld.sh
#   EpilogSlurmctld=/etc/slurm/colossalai/epilog-slurmctld.sh
#
# slurmctld runs it once per job, on the controller, as SlurmctldUser, with
# SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_JOB_NAME and SLURM_JOB_COMMENT set.
# The file_sd directory must be one Prometheus reads: on the controller's own
# Prometheus, or on a shared filesystem Prometheus mounts.
#
# Node agents are added for every job. Rank servers (rank 0 on the first
# node) only for jobs that say they run TrainingMonitor, with
# `sbatch --comment=colossalai …`: a job without a rank server would
# otherwise show as TrainingRankDown (cause=scrape).
#
# It never fails the job: a non-zero exit from PrologSlurmctld makes Slurm
# requeue or cancel the job, and monitoring must never cost a run. Problems go
# to syslog instead (and the job is then simply not scraped).

# Slurm starts prologs with no search path.
PATH=/usr/local/bin:/usr/bin:/bin
set -u

here=$(dirname "$0")
targets=${COLOSSALAI_SLURM_TARGETS:-$here/colossalai-slurm-targets}
export COLOSSALAI_EXPORTER_FILE_SD_DIR=${COLOSSALAI_EXPORTER_FILE_SD_DIR:-/etc/prometheus/targets}

args=(write)
case "${SLURM_JOB_COMMENT:-}" in
  *colossalai*) ;;
  *) args+=(--training.port 0) ;;
esac

if ! output=$("$targets" "${args[@]}" 2>&1); then
  logger -t colossalai-slurm-prolog "job ${SLURM_JOB_ID:-?}: targets not written: $output" \
    2>/dev/null || echo "colossalai-slurm-prolog: $output" >&2
fi
exit 0
