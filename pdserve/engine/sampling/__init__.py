"""The sampler's parts: the counter-based random stream, one step's parameters as tensors, and
the logits processors. `pdserve.engine.sampler.sample` puts them together."""
