"""Using a trained model: an OpenAI-compatible server (`grpolab serve`) and offline batch generation
(`grpolab generate`), both over one continuous-batching engine (batcher.py)."""
