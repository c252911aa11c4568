"""Add ``/health`` and ``/metrics`` to a FastAPI chat server its owner controls.

>>> from fastapi import FastAPI
>>> from colossalai_exporter.chat import instrument
>>> app = FastAPI()
>>> model_loaded = False
>>> chat_metrics = instrument(app, ready=lambda: model_loaded)

FastAPI and starlette are imported only by this package (the ``chat`` extra);
the rest of colossalai-exporter never needs them.
"""

from colossalai_exporter.chat.instrument import ChatMetrics, instrument

__all__ = ["ChatMetrics", "instrument"]
