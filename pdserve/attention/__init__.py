"""Attention backends: the runner's one batch description per step (batch.py), the backend
interface and the context that carries it into the model (backend.py), the reference `torch`
backend (torch_backend.py), backends by name (registry.py), the staged upload (staging.py)."""
