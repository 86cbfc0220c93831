"""The sampler's parts: the counter-based random stream, one step's parameters as tensors, the
penalties' state on the device, and the logits processors. `pdserve.engine.sampler` puts them
together."""
