"""The per-node agent: ``colossalai-exporter node``."""
