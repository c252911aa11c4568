"""Alerting and recording rules generated from one config (``colossalai-exporter rules``)."""
