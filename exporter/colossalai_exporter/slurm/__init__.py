"""Slurm integration: Prometheus file_sd targets for a job's nodes (see cli.py)."""
